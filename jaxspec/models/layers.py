"""Shared building blocks: RMSNorm variants, RoPE variants, gated MLP.

Math follows the Hugging Face implementations exactly (see ../shared/reference/architectures.md §1):
norms and softmax run in float32 whatever the parameter dtype.

Every parameter is created through `param`, which records its logical axis names (vocab, embed, q_heads,
kv_heads, head_dim, ffn, ...) as Flax sharding metadata: `nnx.get_partition_spec(state)` reads them back,
and sharding maps them to mesh axes with one rules table per family. Nothing is sharded at creation.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.config import RopeConfig
from jaxspec.models import cpu_kernel, quant


def param(value: jax.Array, axes: tuple[str, ...]) -> nnx.Param:
    """A parameter with logical axis names, one per dimension (metadata only: no sharding happens here)."""
    assert len(axes) == value.ndim, (axes, value.shape)
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


class Tiled(nnx.Module):
    """A float32 kernel [in, out] kept in column tiles [ceil(out / 48), in, 48] (`cpu_kernel.tile`), the layout
    the CPU kernel streams at memory speed: on the 2-core VM a decode step runs about 1.3x faster, and a
    9-node tree verify's products cost about what one row's do. `tile_linears` swaps it in where that kernel runs
    (`jaxspec.load` on one CPU device) and `untile_linears` swaps it back (sharding, quantising, saving).
    The tiles hold bfloat16 when every value of the kernel is one (`compact`): the same products from half the
    bytes."""

    def __init__(self, kernel: nnx.Param, compact: bool = False):
        in_axis, out_axis = kernel.out_sharding
        self.out = int(kernel.shape[1])  # static: the graphdef carries it
        self.tiles = param(cpu_kernel.tile(kernel[...], jnp.bfloat16 if compact else None), (out_axis, in_axis, None))

    @property
    def dtype(self):
        """The kernel's dtype (float32), whatever the tiles are stored in."""
        return jnp.dtype(jnp.float32)

    def weight(self) -> jax.Array:
        """The kernel [in, out], float32."""
        return cpu_kernel.untile(self.tiles[...], self.out)

    def kernel(self) -> nnx.Param:
        """The [in, out] parameter this was made from."""
        out_axis, in_axis, _ = self.tiles.out_sharding
        return param(self.weight(), (in_axis, out_axis))


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel is [in, out] (HF stores [out, in]: the loader transposes; on a CPU, a
    product of a few rows runs `cpu_kernel.dense`), the same in column tiles (`Tiled`, how `jaxspec.load` keeps
    it on a CPU), or a `quant.Packed` weight [out, in] (int8 / int4 codes + group scales), whose dequantisation
    is fused into the matmul (`quant.pack_module` swaps it in; see jaxspec/models/quant.py).

    axes: logical names of (in, out), e.g. ("embed", "q_heads")."""

    def __init__(self, d_in: int, d_out: int, axes: tuple[str, str], *, bias: bool = False, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.kernel = param(jax.random.normal(rngs.params(), (d_in, d_out), dtype) * (d_in**-0.5), axes)
        self.bias = param(jnp.zeros((d_out,), dtype), axes[1:]) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        k = self.kernel
        if isinstance(k, quant.Packed):
            y = quant.matmul(x, k)
        elif isinstance(k, Tiled):
            y = cpu_kernel.dense_tiled(x, k.tiles[...], k.out)
        else:
            y = cpu_kernel.dense(x, k[...])
        return y + self.bias[...] if self.bias is not None else y

    def weight(self) -> jax.Array:
        """The float kernel [in, out] (dequantised if packed), for the few uses that need the matrix itself."""
        k = self.kernel
        if isinstance(k, quant.Packed):
            return quant.as_float(k).T
        return k.weight() if isinstance(k, Tiled) else k[...]


def project(x: jax.Array, *linears: Linear) -> list[jax.Array]:
    """[lin(x) for lin in linears]: on a CPU, float weights go through one kernel call together
    (`cpu_kernel.dense_many`, or `dense_many_tiled` for tiled kernels) where each would run the kernel alone."""
    kernels = [lin.kernel for lin in linears]
    if all(isinstance(k, Tiled) for k in kernels):
        ys = cpu_kernel.dense_many_tiled(x, [k.tiles[...] for k in kernels], [k.out for k in kernels])
    elif any(isinstance(k, (quant.Packed, Tiled)) for k in kernels):
        return [lin(x) for lin in linears]
    else:
        ys = cpu_kernel.dense_many(x, [k[...] for k in kernels])
    return [y + lin.bias[...] if lin.bias is not None else y for y, lin in zip(ys, linears)]


def tile_linears(module: nnx.Module, compact: bool = True) -> nnx.Module:
    """Every float32 Linear kernel of `module` into column tiles (`Tiled`), in place; returns the module.
    Only where the CPU kernel runs (one CPU device, the kernel built): elsewhere the module is left as it is.
    compact: tiles in bfloat16 for kernels whose every value is one (a bfloat16 checkpoint loaded in float32,
    such as a drafter saved in bfloat16), which needs concrete values (not under `nnx.eval_shape`)."""
    if cpu_kernel.usable(tiles=True):
        for _, node in list(nnx.iter_graph(module)):
            if isinstance(node, Linear) and isinstance(node.kernel, nnx.Param) and node.kernel.dtype == jnp.float32:
                node.kernel = Tiled(node.kernel, compact and cpu_kernel.bf16_exact(node.kernel[...]))
    return module


def untile_linears(module: nnx.Module) -> nnx.Module:
    """`tile_linears`' inverse, in place (kernels [in, out] again); returns the module."""
    for _, node in list(nnx.iter_graph(module)):
        if isinstance(node, Linear) and isinstance(node.kernel, Tiled):
            node.kernel = node.kernel.kernel()
    return module


def embed_rows(table, tokens: jax.Array) -> jax.Array:
    """Rows of the token embedding [V, H] (a float Param or a packed table) for tokens [...] -> [..., H]."""
    return quant.rows(table, tokens) if isinstance(table, quant.Packed) else jnp.take(table[...], tokens, axis=0)


class RMSNorm(nnx.Module):
    """RMSNorm; `plus_one` is Gemma's (1 + w) form, otherwise Llama's w * x_hat.

    Llama/Qwen3 cast the normalised input back to the input dtype before the multiply; Gemma multiplies
    in float32 and casts after. Both are reproduced so bf16 runs match HF too.
    """

    def __init__(self, dim: int, eps: float, *, plus_one: bool = False, axis: str = "embed", dtype=jnp.float32):
        self.eps, self.plus_one = eps, plus_one
        self.weight = param(jnp.zeros((dim,), dtype) if plus_one else jnp.ones((dim,), dtype), (axis,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        xn = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        w = self.weight[...]
        if self.plus_one:
            return (xn * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
        return w * xn.astype(x.dtype)


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU (silu) or GeGLU (gelu tanh)."""

    def __init__(self, d: int, d_ff: int, act: str, *, bias: bool = False, dtype=jnp.float32, rngs: nnx.Rngs):
        self.act = act
        self.gate_proj = Linear(d, d_ff, ("embed", "ffn"), bias=bias, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, d_ff, ("embed", "ffn"), bias=bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(d_ff, d, ("ffn", "embed"), bias=bias, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        g, u = project(x, self.gate_proj, self.up_proj)
        g = jax.nn.silu(g) if self.act == "silu" else jax.nn.gelu(g, approximate=True)
        return self.down_proj(g * u)


def lm_logits(h: jax.Array, embed_tokens, lm_head: "Linear | None", vocab: jax.Array | None = None) -> jax.Array:
    """Final hidden (already normed) [..., H] -> float32 logits [..., V] through the LM head, or the tied
    embedding [V, H] (the Param, float or packed) when there is none; [..., K] for the K token ids in `vocab`
    only (a drafter's draft vocabulary). A packed head is [V, H] either way: the rows of the vocabulary."""
    W = embed_tokens if lm_head is None else lm_head.kernel
    if isinstance(W, quant.Packed):
        if vocab is None:
            return quant.matmul(h, W).astype(jnp.float32)
        rows = [None if a is None else jnp.take(a, vocab, axis=0) for a in W.parts()]  # still packed
        return quant.matmul_parts(h, *rows).astype(jnp.float32)
    if lm_head is None:
        return cpu_kernel.dense(h, W[...], nk=True, rows=vocab, preferred_element_type=jnp.float32)
    if isinstance(W, Tiled):  # a float32 kernel (its tiles float32 or bfloat16)
        if vocab is None:
            return cpu_kernel.dense_tiled(h, W.tiles[...], W.out)
        cols = W.tiles[...][vocab // cpu_kernel.TILE, :, vocab % cpu_kernel.TILE]  # [K, H]: those columns' weights
        return cpu_kernel.dense(h, cols.astype(jnp.float32), nk=True)
    W = W[...] if vocab is None else jnp.take(W[...], vocab, axis=1)
    return cpu_kernel.dense(h, W, preferred_element_type=jnp.float32)


def finish(model, x: jax.Array, tapped: dict, tap_layers, logits_idx) -> tuple[jax.Array, jax.Array | None]:
    """The end every target family's forward shares: the final norm and LM head over the rows `logits_idx`
    [B, K] picks (all rows when None), and the taps (layer outputs [B, N, H] by index) concatenated in
    `tap_layers` order -> (logits [B, K or N, V] float32, taps [B, N, len(tap_layers) * H] or None)."""
    if logits_idx is not None:
        x = jnp.take_along_axis(x, logits_idx[..., None], axis=1)
    taps = jnp.concatenate([tapped[t] for t in tap_layers], -1) if tap_layers else None
    return model.head(model.norm(x)), taps


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> np.ndarray:
    """inv_freq [head_dim/2] for the default, linear and llama3 RoPE types (HF modeling_rope_utils), and
    llama.cpp's explicit per-frequency factors."""
    # float32 like HF, so long positions rotate by exactly the same angles
    exponent = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    inv = np.float32(1.0) / (np.float32(rope.theta) ** exponent)
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        orig, lo, hi = rope.original_max_position_embeddings, rope.low_freq_factor, rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > orig / lo, inv / rope.factor, inv)
        smooth = (orig / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_mid = (wavelen >= orig / hi) & (wavelen <= orig / lo)
        inv = np.where(is_mid, mid, scaled)
    if rope.freq_factors:  # llama.cpp's rope_freqs divide the angle of each frequency
        inv = inv / np.asarray(rope.freq_factors, np.float32)
    return inv.astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq) -> tuple[jax.Array, jax.Array]:
    """positions [B, N] -> float32 (cos, sin) [B, N, 1, D/2] of the rotation angles, broadcast over heads.

    The tables are materialised once per call: XLA:CPU otherwise fuses cos and sin into the rotation and
    evaluates them once per head and half (18x for SmolLM2's 9 query heads), which made RoPE 1 ms of a
    9-node verify and tens of ms of a prefill. A float32 reduce_precision to float32's own widths changes no
    value; XLA does not fuse through it.
    """
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, N, D/2]
    cs = jax.lax.reduce_precision(jnp.stack([jnp.cos(ang), jnp.sin(ang)]), exponent_bits=8, mantissa_bits=23)
    return cs[0][:, :, None, :], cs[1][:, :, None, :]


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Half-split ("rotate_half") RoPE. x: [B, N, heads, D]; positions: [B, N]."""
    cos, sin = rope_cos_sin(positions, inv_freq)
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
