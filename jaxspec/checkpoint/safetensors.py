"""HF safetensors directories: one file or an index of shards, read one tensor at a time."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

from jaxspec.checkpoint.core import WeightsError


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shard files of `model_dir` in index order (or its one model.safetensors), each checked to exist."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = [model_dir / f for f in dict.fromkeys(_weight_map(index).values())]
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


def _weight_map(index: Path) -> dict[str, str]:
    """A safetensors index's {tensor name: shard file name}."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise TypeError("weight_map is not an object of file names")
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # ValueError: bad JSON or bad UTF-8
        raise WeightsError(f"{index} is not a valid safetensors index ({e}); re-download the model") from e
    return weight_map


def check_depth(num_layers: int, model_dir: Path) -> None:
    """WeightsError where a config claims more layers than the checkpoint's tensors fill (`layers.N.` in their
    names, read from the index or the header alone), found before the module is built: it is built layer by layer
    (0.15 s a layer for a tiny model on a CPU), so a corrupt num_hidden_layers of millions would seem to hang
    where it should fail."""
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.is_file():
        names = list(_weight_map(index))
    else:
        (f,) = safetensors_files(Path(model_dir))  # its one model.safetensors, or WeightsError
        with open(f, "rb") as fh:
            names = [name for name, _ in _header(f, fh)[1]]
    depth = 1 + max((int(m.group(1)) for n in names if (m := re.search(r"\blayers\.(\d+)\.", n))), default=-1)
    if num_layers > depth:
        raise WeightsError(f"{index.parent / 'config.json'} says num_hidden_layers {num_layers}, but the checkpoint's "
                           f"tensors fill {depth} layers; re-download the model or correct config.json")


def _header(f: Path, fh) -> tuple[int, list]:
    """(header length n, [(name, (dtype name, shape, begin, end))] in file order) of the safetensors file `f`
    open as `fh`: 8-byte little-endian n, n bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}},
    then the data (offsets relative to its start)."""
    size = f.stat().st_size
    n = int.from_bytes(fh.read(8), "little")
    try:
        if not 2 <= n <= size - 8:
            raise ValueError(f"header length {n} does not fit a file of {size} bytes")
        header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        return n, sorted(((name, _entry(name, info)) for name, info in header.items()), key=lambda e: e[1][2])
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:  # JSONDecodeError and
        # UnicodeDecodeError are ValueErrors
        raise WeightsError(f"cannot read {f}: invalid header ({e}); the file is corrupt or truncated, "
                           "re-download it") from e


def _read_file(f: Path) -> Iterator[tuple[str, np.ndarray]]:
    """One safetensors file's tensors, in file order."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        n, entries = _header(f, fh)
        for name, (dtype_name, shape, begin, end) in entries:
            if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
                raise WeightsError(f"tensor {name!r} in {f} has dtype {dtype_name}, which jaxspec does not read "
                                   f"({', '.join(_DTYPES)}); convert the checkpoint to BF16 or F32")
            dtype = np.dtype(_DTYPES[dtype_name])
            count = math.prod(shape)
            if end - begin != count * dtype.itemsize or 8 + n + end > size:
                raise WeightsError(f"cannot read {f}: tensor {name!r} lies outside the file or does not match its "
                                   "shape; the file is corrupt or truncated, re-download it")
            fh.seek(8 + n + begin)
            yield name, np.fromfile(fh, dtype=dtype, count=count).reshape(shape)


def _entry(name: str, info) -> tuple:
    """A header entry -> (dtype name, shape, begin, end), or ValueError where its fields are not the natural
    numbers the format has there (a flipped bit can make a shape a string or an offset negative)."""
    def naturals(v, n=None):
        if not isinstance(v, list) or n is not None and len(v) != n or \
                not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
            return None
        return tuple(v)

    shape, offsets = naturals(info.get("shape")), naturals(info.get("data_offsets"), 2)
    if shape is None or offsets is None or offsets[0] > offsets[1]:
        raise ValueError(f"tensor {name!r} has shape {info.get('shape')!r} and data_offsets "
                         f"{info.get('data_offsets')!r}")
    return info.get("dtype"), shape, *offsets


# safetensors dtype names jaxspec reads (FP8 weights are dequantised with their block scales: checkpoint/fp8.py)
_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F64": np.float64, "F32": np.float32, "F16": np.float16,
           "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
           "U8": np.uint8, "BOOL": np.bool_}
