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

How the product runs (measured; bench/quant.py and the README hold the numbers):
  * On a CPU, products of up to KERNEL_MAX_ROWS rows (decode steps, tree verifies) run in jaxspec's native
    kernel (`cpu_matmul.cc`, through the XLA FFI), which reads each packed byte once per call and,
    with AVX-512 VNNI, multiplies in integers (the activations split into int8 limbs, float32-exact): a
    decode step is bound by the bytes it reads, so 4-bit weights (0.75 bytes per weight with a float32 scale
    and offset per 32) are what make it fast. Elsewhere (GPU, prefill, no C++ compiler), XLA's forms:
  * batch-1 products of int8 codes with group scales: XLA folds `x @ dequantize(codes).T` into one loop
    fusion over the codes (`copy_dot_fusion`, no float weight; `[out, in]` layout required, `in` major makes
    XLA materialise the float weight, 40x slower). 4-bit codes are unpacked first (XLA:CPU cannot unpack
    nibbles inside that fusion and stay vectorised).
  * per-channel int8 (one scale per output): the activations are split into three int8 limbs and the
    product is one int8 x int8 -> int32 dot, which XLA:CPU runs in its int8 GEMM (YNNPACK), reading each code
    once (the kernel above is faster still: 2.5x float32 AR on SmolLM2 against 1.8x).
  * forwards of more rows dequantise to a transient float weight and run XLA's ordinary dot.

`matmul` is the fused form, `dequantize` the reference (float weight first); tests hold them equal.
Host-side helpers (`PackedTensor`, `quantize`) build packed weights from float arrays (round to nearest)
and are what the checkpoint readers yield for tensors that stay packed.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.models import cpu_kernel

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


def unpack_nibbles(packed):
    """uint8 [..., in / 2] (numpy or jax) -> the 4-bit codes [..., in] as uint8 in [0, 15]."""
    xp = np if isinstance(packed, np.ndarray) else jnp
    b = packed.reshape(*packed.shape[:-1], -1, 16)
    return xp.concatenate([b & 15, b >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


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
        from jaxspec.models.layers import param  # layers imports this module

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


def dequantize(codes, scale, offset=None, dtype=None) -> jax.Array:
    """codes, scale/offset [..., out, in / g] -> float weight [..., out, in] in the scale's dtype."""
    dtype = dtype or scale.dtype
    if codes.dtype == jnp.uint8:  # 4-bit: unpack; symmetric codes are stored + 8
        codes = unpack_nibbles(codes).astype(jnp.int8) - jnp.int8(0 if offset is not None else 8)
    *lead, out, cols = codes.shape
    ng = scale.shape[-1]
    w = codes.reshape(*lead, out, ng, cols // ng).astype(dtype) * scale[..., None].astype(dtype)
    if offset is not None:
        w = w + offset[..., None].astype(dtype)
    return w.reshape(codes.shape)


def matmul(x: jax.Array, p: Packed) -> jax.Array:
    """x [..., in] @ W.T -> [..., out]. On a CPU with the native kernel built (`cpu_kernel`), products of up
    to KERNEL_MAX_ROWS rows run there, reading the packed codes once; elsewhere (GPU, larger prefill, no
    compiler) XLA's forms below."""
    return matmul_parts(x, *p.parts())


def matmul_parts(x: jax.Array, codes, scale, offset=None) -> jax.Array:
    """`matmul` on a packed weight's parts (e.g. a subset of a packed table's rows)."""
    rows = int(np.prod(x.shape[:-1]))
    if rows <= KERNEL_MAX_ROWS and _kernel_fits(x, codes, scale, offset):
        y = cpu_kernel.on_cpu(cpu_kernel.packed_matmul, _matmul_xla, x.reshape(rows, x.shape[-1]), codes, scale, offset)
        return y.reshape(*x.shape[:-1], codes.shape[0])
    return _matmul_xla(x, codes, scale, offset)


KERNEL_MAX_ROWS = 80  # measured: the kernel beats dequantise-then-dot up to 65 rows (a budget-64 verify)


def _kernel_fits(x, codes, scale, offset) -> bool:
    """The CPU kernel's cases: one [out, in] weight, float32 throughout, groups of a multiple of 32 inputs, on
    a CPU backend and one device (`cpu_kernel.usable`; elsewhere it is neither built nor asked for)."""
    f32 = all(a.dtype == jnp.float32 for a in (x, scale) + (() if offset is None else (offset,)))
    cols = codes.shape[-1] * (2 if codes.dtype == jnp.uint8 else 1)
    return codes.ndim == 2 and f32 and (cols // scale.shape[-1]) % 32 == 0 and cpu_kernel.usable(codes)


def _per_channel_int8(codes, scale, offset) -> bool:
    """int8 with one scale per output: XLA's best form for it is the limb product below (its int8 GEMM)."""
    return codes.dtype == jnp.int8 and scale.shape[-1] == 1 and offset is None


def _matmul_xla(x, codes, scale, offset):
    """XLA's product, written as a matmul with an explicit transpose of the dequantised expression: for a
    single row XLA:CPU folds that transpose into one loop fusion over the codes (`copy_dot_fusion`). The same
    product as an einsum / dot_general contracting `in` directly is NOT fused (the float weight is
    materialised: 10x slower); tests/test_quant.py checks the compiled HLO."""
    if _per_channel_int8(codes, scale, offset):
        return _matmul_limbs(x, codes, scale)
    # Inside a decode loop the weights are loop-invariant, and XLA's while-loop invariant code motion hoists
    # their int8 -> float conversion out of the loop: every float weight materialised (the memory packing
    # saves) and a slower transposed loop left inside (measured: AR 0.3x float32). Clamping the codes to a
    # bound XLA cannot see is constant (127 = max(127, any int8)) keeps the conversion in the loop.
    top = jnp.iinfo(codes.dtype).max
    cap = jnp.maximum(codes.dtype.type(top), jax.lax.convert_element_type(jnp.sum(x[..., :1]), codes.dtype))
    return x @ dequantize(jnp.minimum(codes, cap), scale, offset, dtype=x.dtype).T


def _matmul_limbs(x, codes, scale, n: int = 3):
    """Per-channel int8: x is split into n int8 limbs (x ~ s (a0 + a1/256 + a2/256^2), s = max|x| / 127 per
    row, error ~ 2^-24 max|x| like float32 rounding) so the product is ONE int8 x int8 -> int32 dot over the
    codes, which XLA:CPU hands to its int8 GEMM (YNNPACK) reading each code once."""
    s = jnp.max(jnp.abs(x), -1, keepdims=True).astype(jnp.float32) / 127.0  # [..., 1]
    r = x.astype(jnp.float32) / jnp.where(s > 0, s, 1.0)
    limbs = []
    for _ in range(n):
        a = jnp.round(r)
        limbs.append(a)
        r = (r - a) * 256.0
    a = jnp.stack(limbs, 0).astype(jnp.int8)  # [n, ..., K]
    y = jax.lax.dot_general(a, codes, (((a.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    y = y.astype(jnp.float32)  # [n, ..., N]
    y = sum(y[i] * (256.0 ** -i) for i in range(n))
    return (y * s * scale[:, 0]).astype(x.dtype)


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


def check_quantize(quantize) -> None:
    if quantize not in QUANTIZE:
        raise ValueError(f"unsupported quantize={quantize!r}; use None, 'int8', 'int4' or 'native'")


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


def scheme_of(quantize: str) -> Scheme:
    """The Scheme `quantize="int8"` / `"int4"` packs with on the fly; one place, as the loader and the memory
    planner must agree on it."""
    return Scheme(8, None) if quantize == "int8" else Scheme(4, INT4_GROUP)


def linear_plan(module: nnx.Module, scheme: Scheme, *, embeddings: bool = True) -> dict[str, Scheme]:
    """The on-the-fly plan: every Linear kernel, every stacked expert projection and (if `embeddings`) the
    token embedding, except routers (an expert choice must not move) and weights whose input dimension the
    group does not divide (they stay float)."""
    from jaxspec.models.layers import Linear
    from jaxspec.models.moe import Experts

    plan = {}
    for path, node in nnx.iter_graph(module):
        name = ".".join(str(p) for p in path)
        if isinstance(node, Linear) and node.kernel.out_sharding[-1] not in ("experts", "shared_gate"):
            if node.kernel.shape[0] % (scheme.group or 1) == 0:
                plan[f"{name}.kernel"] = scheme
        elif isinstance(node, Experts):
            for attr in ("gate_proj", "up_proj", "down_proj"):
                if getattr(node, attr).shape[-2] % (scheme.group or 1) == 0:
                    plan[f"{name}.{attr}"] = scheme
    if embeddings and hasattr(module, "embed_tokens"):
        cols = module.embed_tokens.shape[-1]
        if cols % (scheme.group or 1) == 0:
            plan["embed_tokens"] = Scheme(scheme.bits, scheme.group, scheme.offset, transposed=False)
    return plan
