"""HF safetensors directories: one file or an index of shards, read one tensor at a time."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

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
    """Yield every tensor of every shard, one at a time, in its stored dtype (bf16 as ml_dtypes.bfloat16)."""
    from safetensors import SafetensorError, safe_open

    for f in safetensors_files(Path(model_dir)):
        try:
            with safe_open(str(f), framework="numpy") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise WeightsError(f"cannot read {f}: {e}; the file is corrupt or truncated, re-download it") from e
