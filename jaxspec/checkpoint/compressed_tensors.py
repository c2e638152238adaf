"""compressed-tensors `pack-quantized` INT4 weights (Kimi K2-Thinking, K2.5, K2.6 routed experts): kept packed, or
dequantised on load.

Each quantised Linear `<p>.weight` is stored as three tensors: `<p>.weight_packed` int32 [out, in/8] (eight
4-bit values per word, least significant nibble first, stored with offset 8), `<p>.weight_scale` [out, in/g]
(one scale per g consecutive input columns, symmetric: no zero point) and `<p>.weight_shape` [2] = [out, in].
`dequantize_pack_quantized` wraps a tensor stream and turns each complete triple into `<p>.weight` =
(q - 8) * scale, so the family's name table sees plain HF names; every other tensor passes through.

With `jaxspec.load(..., quantize=...)` set (any value) the triples stay packed instead
(`packed`): `<p>.weight` arrives as a `PackedTensor` (the 4-bit codes regrouped two per byte in jaxspec's
block order, the scales widened to float32) and fills a packed parameter, never a float one. That is how a
real Kimi K2 fits: dequantised to bf16 its experts need ~1.9 TiB. Without `quantize` they are dequantised
(small checkpoints, tests);
requantising an INT4 checkpoint to int8 would only lose precision, so `int8` keeps them as stored too.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from jaxspec.checkpoint.core import WeightsError
from jaxspec.checkpoint.fp8 import dequantize_fp8_blocks, fp8_block_size
from jaxspec.checkpoint.packed import PackedTensor, Scheme, pack_nibbles
from jaxspec.checkpoint.safetensors import safetensors_files

_PARTS = ("weight_packed", "weight_scale", "weight_shape")


def pack_quantized_group_size(quantization_config: dict | None) -> int | None:
    """The group size if `quantization_config` is compressed-tensors pack-quantized INT4 (symmetric, group
    strategy), None if the checkpoint is not quantised; raises WeightsError for schemes jaxspec cannot read."""
    q = quantization_config or {}
    if not q:
        return None
    if q.get("quant_method") != "compressed-tensors" or q.get("format") != "pack-quantized":
        raise WeightsError(f"unsupported quantization_config (quant_method {q.get('quant_method')!r}, format "
                           f"{q.get('format')!r}); jaxspec reads compressed-tensors pack-quantized INT4 only")
    sizes = set()
    for group in (q.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("symmetric"), w.get("strategy")) != (4, "int", True, "group"):
            raise WeightsError(f"unsupported pack-quantized weights {w}; "
                               "jaxspec reads symmetric int4 with group scales")
        sizes.add(int(w["group_size"]))
    if len(sizes) != 1:
        raise WeightsError(f"pack-quantized config_groups must share one group_size, got {sorted(sizes)}")
    return sizes.pop()


def unpack_int4(packed: np.ndarray, cols: int) -> np.ndarray:
    """int32 [out, words] -> int8 [out, cols] in [-8, 7]: nibble i of word w is column 8 w + i."""
    words = packed.astype(np.int32).view(np.uint32)
    nibbles = (words[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF  # [out, words, 8]
    return (nibbles.reshape(packed.shape[0], -1)[:, :cols].astype(np.int8) - 8).astype(np.int8)


def dequantize(packed: np.ndarray, scale: np.ndarray, shape, group_size: int) -> np.ndarray:
    """One quantised Linear's triple -> float32 weight [out, in] (HF layout)."""
    out, cols = (int(s) for s in np.asarray(shape).reshape(-1))
    if packed.shape != (out, -(-cols // 8)) or scale.shape != (out, -(-cols // group_size)):
        raise WeightsError(f"packed {packed.shape} / scale {scale.shape} do not fit weight_shape {(out, cols)} "
                           f"with group_size {group_size}")
    q = unpack_int4(packed, cols).astype(np.float32)
    return q * np.repeat(scale.astype(np.float32), group_size, axis=1)[:, :cols]


def packed(packed_words: np.ndarray, scale: np.ndarray, shape, group_size: int) -> PackedTensor:
    """One quantised Linear's triple -> PackedTensor [out, in] (4-bit codes two per byte in jaxspec's block
    order, stored + 8 as here; one scale per group)."""
    out, cols = (int(s) for s in np.asarray(shape).reshape(-1))
    if cols % group_size:
        raise WeightsError(f"a packed weight with {cols} inputs is not a whole number of groups of {group_size}; "
                           "load it with quantize=None")
    if packed_words.shape != (out, -(-cols // 8)) or scale.shape != (out, cols // group_size):
        raise WeightsError(f"packed {packed_words.shape} / scale {scale.shape} do not fit weight_shape {(out, cols)} "
                           f"with group_size {group_size}")
    if cols % 32:
        raise WeightsError(f"a packed weight with {cols} inputs cannot be kept in 4-bit blocks of 32 inputs; "
                           "load it with quantize=None")
    return PackedTensor(pack_nibbles(unpack_int4(packed_words, cols) + 8), scale.astype(np.float32))


def dequantize_pack_quantized(tensors: Iterable[tuple[str, np.ndarray]], group_size: int, *,
                              keep_packed: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """Pass tensors through, replacing each complete (weight_packed, weight_scale, weight_shape) triple by its
    float32 `.weight` (a `PackedTensor` if keep_packed) as soon as its last part arrives (shards may split a
    triple, so parts wait by prefix)."""
    waiting: dict[str, dict[str, np.ndarray]] = {}
    for name, arr in tensors:
        prefix, _, part = name.rpartition(".")
        if part not in _PARTS:
            yield name, arr
            continue
        parts = waiting.setdefault(prefix, {})
        parts[part] = arr
        if len(parts) == len(_PARTS):
            del waiting[prefix]
            join = packed if keep_packed else dequantize
            yield f"{prefix}.weight", join(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"],
                                           group_size)
    if waiting:
        prefix, parts = next(iter(waiting.items()))
        missing = [p for p in _PARTS if p not in parts]
        raise WeightsError(f"quantised weight {prefix!r} lacks {', '.join(missing)}; the checkpoint is incomplete")


def maybe_dequantize(model_dir: Path, tensors: Iterable[tuple[str, np.ndarray]], *,
                     keep_packed: bool = False) -> Iterable[tuple[str, np.ndarray]]:
    """The tensor stream of a HF directory, dequantised if its config.json says fp8; its pack-quantized
    triples (if it says so) joined into float `.weight`s, or into `PackedTensor`s if keep_packed."""
    q = _quantization_config(model_dir)
    block = fp8_block_size(q)
    if block is not None:
        return dequantize_fp8_blocks(tensors, block)
    group_size = pack_quantized_group_size(q)
    return tensors if group_size is None else dequantize_pack_quantized(tensors, group_size, keep_packed=keep_packed)


def packed_schemes(model_dir: Path) -> dict[str, Scheme]:
    """HF name (`<p>.weight`) -> Scheme of every pack-quantized weight of a HF directory (from the shards'
    tensor names only: nothing is read); empty if the checkpoint is not pack-quantized (fp8 is dequantised)."""
    from safetensors import safe_open


    q = _quantization_config(model_dir)
    group_size = None if fp8_block_size(q) is not None else pack_quantized_group_size(q)
    if group_size is None:
        return {}
    out = {}
    for f in safetensors_files(Path(model_dir)):
        with safe_open(str(f), framework="numpy") as st:
            out.update({n.removesuffix("_packed"): Scheme(4, group_size)
                        for n in st.keys() if n.endswith(".weight_packed")})
    return out


def _quantization_config(model_dir: Path) -> dict | None:
    return json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config")
