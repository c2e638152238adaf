"""Packed weights on the host: what the checkpoint readers yield for tensors that stay packed (GGUF
Q4_0 / Q4_1 / Q8_0, compressed-tensors INT4), what on-the-fly quantisation (`quantize`) produces, and the
schemes both are described by. The device side (packed parameters and their product) is
jaxspec/models/quant.py, which documents the layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxspec.kernels.xla import unpack_nibbles

QUANTIZE = (None, "int8", "int4", "native")
INT4_GROUP = 32  # on-the-fly int4: one scale per 32 inputs (GGUF Q4_0's block); int8: one per output channel


@dataclass(frozen=True)
class Scheme:
    """How a parameter is packed. bits: 8 or 4 (the range of its codes); group: inputs per scale (None: the
    whole input dimension); offset: asymmetric (Q4_1). transposed: the float parameter is [in, out] (a Linear
    kernel, stacked experts), so packing it transposes; False for [out, in] tables (embeddings)."""

    bits: int
    group: int | None
    offset: bool = False
    transposed: bool = True


@dataclass
class PackedTensor:
    """A packed weight on the host in the device layout [..., out, in]: what a reader yields for a tensor
    that stays packed (GGUF Q4_0/Q4_1/Q8_0, compressed-tensors INT4) and what `quantize` returns."""

    codes: np.ndarray  # int8 [..., out, in], or uint8 [..., out, in / 2] for 4-bit codes (see above)
    scale: np.ndarray  # float [..., out, in / g]
    offset: np.ndarray | None = None  # float [..., out, in / g]

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's [..., out, in]."""
        c = self.codes
        return (*c.shape[:-1], c.shape[-1] * 2) if c.dtype == np.uint8 else c.shape

    def parts(self) -> dict[str, np.ndarray]:
        d = {"codes": self.codes, "scale": self.scale}
        return d if self.offset is None else d | {"offset": self.offset}

    def map(self, f) -> "PackedTensor":
        """Apply a row operation (e.g. llama.cpp's q/k row unpermute) to every part alike."""
        return PackedTensor(*(None if a is None else f(a) for a in (self.codes, self.scale, self.offset)))

    def dequantize(self) -> np.ndarray:
        """float32 [..., out, in] (numpy reference)."""
        codes = self.codes
        if codes.dtype == np.uint8:
            codes = unpack_nibbles(codes).astype(np.int8) - np.int8(0 if self.offset is not None else 8)
        g = codes.shape[-1] // self.scale.shape[-1]
        w = codes.astype(np.float32) * np.repeat(self.scale.astype(np.float32), g, axis=-1)
        return w if self.offset is None else w + np.repeat(self.offset.astype(np.float32), g, axis=-1)


def quantize(w: np.ndarray, scheme: Scheme) -> PackedTensor:
    """Round-to-nearest, symmetric: float [..., out, in] -> codes in [-qmax, qmax] (qmax 127 or 7) with one
    scale max|w| / qmax per group, so each weight is off by at most half its group's scale."""
    w = np.asarray(w, np.float32)
    cols = w.shape[-1]
    g = scheme.group or cols
    if cols % g:
        raise ValueError(f"cannot quantise a weight with {cols} inputs in groups of {g}; "
                         "the input dimension must be a multiple of the group size")
    qmax = 127 if scheme.bits == 8 else 7
    wg = w.reshape(*w.shape[:-1], cols // g, g)
    scale = np.abs(wg).max(-1) / qmax  # [..., out, in / g]
    safe = np.where(scale > 0, scale, 1.0)[..., None]
    codes = np.clip(np.rint(wg / safe), -qmax, qmax).astype(np.int8).reshape(w.shape)
    return PackedTensor(codes if scheme.bits == 8 else pack_nibbles(codes + 8), scale.astype(np.float32))


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes [..., in] with values in [0, 15] -> uint8 [..., in / 2] in GGUF's block order."""
    *lead, cols = codes.shape
    if cols % 32:
        raise ValueError(f"4-bit codes are packed in blocks of 32 inputs; a weight with {cols} inputs cannot be")
    c = codes.astype(np.uint8).reshape(*lead, cols // 32, 2, 16)
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(*lead, cols // 2)


def check_quantize(quantize) -> None:
    if quantize not in QUANTIZE:
        raise ValueError(f"unsupported quantize={quantize!r}; use None, 'int8', 'int4' or 'native'")


def scheme_of(quantize: str) -> Scheme:
    """The Scheme `quantize="int8"` / `"int4"` packs with on the fly; one place, as the loader and the memory
    planner must agree on it."""
    return Scheme(8, None) if quantize == "int8" else Scheme(4, INT4_GROUP)
