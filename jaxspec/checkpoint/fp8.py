"""FP8 block-scaled weights (DeepSeek-V3's released checkpoints), dequantised on load.

With `quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}`, each
quantised Linear `<p>.weight` is stored as float8_e4m3fn [out, in] beside `<p>.weight_scale_inv` float32
[ceil(out / 128), ceil(in / 128)]: one scale per 128 x 128 block, weight = fp8 value x scale. Embeddings,
norms, routers and the LM head stay in bf16. `dequantize_fp8_blocks` wraps a tensor stream and turns each
pair into a float32 `<p>.weight`, so the family's name table sees plain HF names.

Like compressed-tensors INT4, this makes FP8 checkpoints loadable (tiny tests, or a model that fits in the
dequantised dtype); a 671B DeepSeek-V3 needs its FP8 weights kept packed on device, which is not done yet.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import ml_dtypes
import numpy as np

from jaxspec.checkpoint.core import WeightsError

SCALE = "weight_scale_inv"


def fp8_block_size(quantization_config: dict | None) -> tuple[int, int] | None:
    """(rows, cols) of a scale block if the config is FP8 block-scaled, else None; WeightsError for other FP8 kinds."""
    q = quantization_config or {}
    if q.get("quant_method") != "fp8":
        return None
    block = q.get("weight_block_size")
    if q.get("fmt", "e4m3") != "e4m3" or not block or len(block) != 2:
        raise WeightsError(f"unsupported fp8 quantization_config {q}; jaxspec reads e4m3 weights with 2-D block scales")
    return int(block[0]), int(block[1])


def dequantize_block(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float8 [out, in] x float32 [ceil(out/b0), ceil(in/b1)] -> float32 [out, in]."""
    out, cols = w.shape
    b0, b1 = block
    if scale_inv.shape != (-(-out // b0), -(-cols // b1)):
        raise WeightsError(f"weight {w.shape} and its {SCALE} {scale_inv.shape} do not fit blocks of {block}")
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), b0, axis=0), b1, axis=1)[:out, :cols]
    return w.astype(np.float32) * s


def dequantize_fp8_blocks(tensors: Iterable[tuple[str, np.ndarray]],
                          block: tuple[int, int]) -> Iterator[tuple[str, np.ndarray]]:
    """Pass tensors through, replacing each (float8 `<p>.weight`, `<p>.weight_scale_inv`) pair by a float32
    `<p>.weight` as soon as both have arrived (shards may split a pair, so the first waits by prefix)."""
    waiting: dict[str, dict[str, np.ndarray]] = {}
    for name, arr in tensors:
        prefix, _, part = name.rpartition(".")
        if part == SCALE or part == "weight" and arr.dtype == ml_dtypes.float8_e4m3fn:
            pair = waiting.setdefault(prefix, {})
            pair[part] = arr
            if len(pair) == 2:
                del waiting[prefix]
                yield f"{prefix}.weight", dequantize_block(pair["weight"], pair[SCALE], block)
            continue
        yield name, arr
    if waiting:
        prefix, pair = next(iter(waiting.items()))
        lacking = SCALE if "weight" in pair else "weight"
        raise WeightsError(f"fp8 weight {prefix!r} lacks its {lacking}; the checkpoint is incomplete")
