"""HF safetensors directories: one file or an index of shards, read one tensor at a time."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

from jaxspec.checkpoint.core import WeightsError


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shard files of `model_dir` in index order (or its one model.safetensors), each checked to exist."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightsError(f"{index} is not a valid safetensors index ({e}); re-download the model") from e
        files = [model_dir / f for f in dict.fromkeys(weight_map.values())]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        raise WeightsError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    for f in files:
        if not f.is_file():
            raise WeightsError(f"shard {f} listed in the index is missing; re-download the model")
    return files


def read_safetensors(model_dir: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield every tensor of every shard, one at a time in file order, in its stored dtype (bf16 as
    ml_dtypes.bfloat16). Each tensor is read into a fresh buffer (plain reads, no memory map), so the host
    holds only the tensor being loaded, never a mapped shard's pages."""
    for f in safetensors_files(Path(model_dir)):
        yield from _read_file(f)


def _read_file(f: Path) -> Iterator[tuple[str, np.ndarray]]:
    """One safetensors file: 8-byte little-endian header length n, n bytes of JSON header
    {name: {dtype, shape, data_offsets: [begin, end]}}, then the data (offsets relative to its start)."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        try:
            if not 2 <= n <= size - 8:
                raise ValueError(f"header length {n} does not fit a file of {size} bytes")
            header = json.loads(fh.read(n))
            header.pop("__metadata__", None)
            entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
            raise WeightsError(f"cannot read {f}: invalid header ({e}); the file is corrupt or truncated, "
                               "re-download it") from e
        for name, info in entries:
            if info.get("dtype") not in _DTYPES:
                raise WeightsError(f"tensor {name!r} in {f} has dtype {info.get('dtype')}, which jaxspec does not read "
                                   f"({', '.join(_DTYPES)}); convert the checkpoint to BF16 or F32")
            dtype, shape = np.dtype(_DTYPES[info["dtype"]]), tuple(info["shape"])
            begin, end = info["data_offsets"]
            count = int(np.prod(shape, dtype=np.int64))
            if end - begin != count * dtype.itemsize or 8 + n + end > size:
                raise WeightsError(f"cannot read {f}: tensor {name!r} lies outside the file or does not match its "
                                   "shape; the file is corrupt or truncated, re-download it")
            fh.seek(8 + n + begin)
            yield name, np.fromfile(fh, dtype=dtype, count=count).reshape(shape)


# safetensors dtype names jaxspec reads (FP8 weights are dequantised with their block scales: checkpoint/fp8.py)
_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F64": np.float64, "F32": np.float32, "F16": np.float16,
           "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
           "U8": np.uint8, "BOOL": np.bool_}
