"""Weight-only quantised weights kept packed on device: int8 / int4 codes with group-wise scales (and, for
GGUF Q4_1, a per-group offset), read packed by the product (a native kernel on CPU, XLA's fused forms
elsewhere).

A packed weight W [out, in] (stacked experts: [E, out, in]) is three arrays:

    codes   int8 [..., out, in]        8-bit codes, one per byte
            uint8 [..., out, in / 2]   4-bit codes, two per byte in GGUF's block order: in each block of 32
                                       inputs byte j holds input j (low nibble) and input j + 16 (high nibble);
                                       stored unsigned [0, 15], a symmetric code c as c + 8
    scale   [..., out, in / g]         one scale per g consecutive inputs (g = in: one per output channel)
    offset  [..., out, in / g]         optional:  W = scale * nibble + offset  (Q4_1); without it
                                       W = scale * code, code = nibble - 8 for 4-bit codes

The dtype of `codes` tells the two storages apart. Int4 weights therefore need `in` to be a multiple of 32.

How the product runs: `kernels.packed_matmul`, whose reference (`kernels.xla.packed_matmul`) is XLA's fused
form. A decode step is bound by the bytes it reads, so 4-bit weights (0.75 bytes per weight with a float32
scale and offset per 32) are what make it fast:
  * batch-1 products of int8 codes with group scales: XLA folds `x @ dequantize(codes).T` into one loop
    fusion over the codes (no float weight; the `[out, in]` layout is required: `in` major makes XLA
    materialise the float weight). 4-bit codes are unpacked first (XLA:CPU cannot unpack nibbles inside that
    fusion and stay vectorised).
  * per-channel int8 (one scale per output): the activations are split into three int8 limbs and the
    product is one int8 x int8 -> int32 dot, which XLA:CPU runs in its int8 GEMM, reading each code once.
  * forwards of more rows dequantise to a transient float weight and run XLA's ordinary dot.
  * the CPU backend runs decode and verify products in its native kernel, which reads each packed byte once
    (jaxspec/kernels/cpu.py); bench/quant.py measures all of them.

`matmul` is the fused product, `dequantize` the reference (float weight first); tests hold them equal.
The host side (`PackedTensor`, `quantize`, `Scheme`) is jaxspec/checkpoint/packed.py: what the checkpoint
readers yield for tensors that stay packed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec import kernels
from jaxspec.checkpoint.packed import (  # noqa: F401
    INT4_GROUP,
    QUANTIZE,
    PackedTensor,
    Scheme,
    check_quantize,
    pack_nibbles,
    quantize,
    scheme_of,
)
from jaxspec.kernels.xla import dequantize, unpack_nibbles  # noqa: F401
from jaxspec.models.axes import param


class Packed(nnx.Module):
    """A packed weight [..., out, in] as parameters with logical axes (codes and scales share the weight's
    axes: a group axis shards like the input axis it groups).

    On a mesh (`sharding.Layout`) the codes split like the float weight's out / in axes. The scale (and
    offset) split with them when their group count divides by the mesh axis; then in / tp is a whole number
    of groups, so each device holds exactly its codes' groups. Otherwise, by the layout's rule for any
    dimension that does not divide, they are replicated: int8's one scale per output on a weight split by
    its input (down_proj, o_proj), or fewer int4 groups than devices. That is correct (the partitioner
    gathers what a product needs) and costs little, as scales are 1/g of the codes."""

    def __init__(self, shape: tuple[int, ...], axes: tuple[str, ...], scheme: Scheme, *, dtype=jnp.float32):
        *lead, out, cols = shape
        g = scheme.group or cols
        if cols % g:
            raise ValueError(f"a packed weight with {cols} inputs cannot have groups of {g}")
        self.bits, self.group = scheme.bits, g
        if scheme.bits == 4 and cols % 32:
            raise ValueError(f"a 4-bit packed weight needs a multiple of 32 inputs, not {cols}")
        codes = (*lead, out, cols // 2) if scheme.bits == 4 else shape
        self.codes = param(jnp.zeros(codes, jnp.uint8 if scheme.bits == 4 else jnp.int8), axes)
        self.scale = param(jnp.ones((*lead, out, cols // g), dtype), axes)
        self.offset = param(jnp.zeros((*lead, out, cols // g), dtype), axes) if scheme.offset else None

    @property
    def dtype(self):
        return self.scale.dtype

    def parts(self):
        return self.codes[...], self.scale[...], None if self.offset is None else self.offset[...]


def matmul(x: jax.Array, p: Packed) -> jax.Array:
    """x [..., in] @ W.T -> [..., out], reading the packed codes (`kernels.packed_matmul`)."""
    return kernels.packed_matmul(x, *p.parts())


def rows(p: Packed, idx: jax.Array) -> jax.Array:
    """Rows idx [...] of a packed [V, H] table (an embedding), dequantised -> [..., H]."""
    codes, scale, offset = p.parts()
    take = lambda a: None if a is None else jnp.take(a, idx, axis=0)  # noqa: E731
    return dequantize(take(codes), take(scale), take(offset))


def as_float(w) -> jax.Array:
    """A parameter's float value: a float Variable's array, or a Packed weight dequantised ([..., out, in])."""
    return dequantize(*w.parts()) if isinstance(w, Packed) else w[...]


def packed_bytes(state) -> int:
    """Bytes of every array in a parameter state (what one decode step reads, counting a tied table once)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def pack_module(module: nnx.Module, plan: dict[str, Scheme], *, fill: bool = False) -> nnx.Module:
    """Replace the float parameters named in `plan` (dotted paths: `layers.0.mlp.up_proj.kernel`,
    `embed_tokens`, `layers.1.mlp.experts.gate_proj`) by `Packed` weights of the same logical shape, in place.
    Works on an abstract module (inside `nnx.eval_shape`), which is how the loader builds packed targets;
    fill: quantise the current float values into them (round to nearest, `quantize`)."""
    for path, scheme in plan.items():
        *parents, attr = path.split(".")
        owner = module
        for p in parents:
            owner = owner[int(p)] if p.isdigit() else getattr(owner, p)
        var = getattr(owner, attr)
        shape, axes = tuple(var.shape), tuple(var.out_sharding)
        if scheme.transposed:  # float [..., in, out] -> packed [..., out, in]
            shape, axes = (*shape[:-2], shape[-1], shape[-2]), (*axes[:-2], axes[-1], axes[-2])
        packed = Packed(shape, axes, scheme, dtype=var.dtype)
        if fill:
            w = np.asarray(var[...], np.float32)
            for k, v in quantize(np.swapaxes(w, -1, -2) if scheme.transposed else w, scheme).parts().items():
                getattr(packed, k).set_value(jnp.asarray(v, getattr(packed, k).dtype))
        setattr(owner, attr, packed)
    return module


def linear_plan(module: nnx.Module, scheme: Scheme, *, embeddings: bool = True) -> dict[str, Scheme]:
    """The on-the-fly plan: every weight a module lists as `packable` (Linear kernels, stacked expert
    projections) and (if `embeddings`) the token embedding, except routers (an expert choice must not move)
    and weights whose input dimension the group does not divide (they stay float)."""
    plan = {}
    for path, node in nnx.iter_graph(module):
        name = ".".join(str(p) for p in path)
        for attr in getattr(node, "packable", ()):
            var = getattr(node, attr)
            if not isinstance(var, nnx.Param) or var.out_sharding[-1] in ("experts", "shared_gate"):
                continue
            if var.shape[-2] % (scheme.group or 1) == 0:  # [..., in, out]
                plan[f"{name}.{attr}"] = scheme
    if embeddings and hasattr(module, "embed_tokens"):
        cols = module.embed_tokens.shape[-1]
        if cols % (scheme.group or 1) == 0:
            plan["embed_tokens"] = Scheme(scheme.bits, scheme.group, scheme.offset, transposed=False)
    return plan
