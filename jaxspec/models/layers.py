"""Shared building blocks: Linear, RMSNorm variants, RoPE variants, gated MLP, the LM head.

Math follows the Hugging Face implementations exactly (see ../shared/reference/architectures.md §1):
norms and softmax run in float32 whatever the parameter dtype. Products go through the kernel seam
(`jaxspec.kernels`), which picks the backend that runs them; parameters are created with logical axis names
(`axes.param`).
"""
from __future__ import annotations

import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec import kernels
from jaxspec.config import RopeConfig
from jaxspec.models import quant
from jaxspec.models.axes import param


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel is [in, out] (HF stores [out, in]: the loader transposes), held as a
    float array (in the kernel backend's layout where it has one: `kernels.prepare`) or as a `quant.Packed`
    weight [out, in] (int8 / int4 codes + group scales, read packed by the product; `quant.pack_module`
    swaps it in).

    axes: logical names of (in, out), e.g. ("embed", "q_heads")."""

    packable: ClassVar[tuple[str, ...]] = ("kernel",)  # what quant.linear_plan may pack

    def __init__(self, d_in: int, d_out: int, axes: tuple[str, str], *, bias: bool = False, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.kernel = param(jax.random.normal(rngs.params(), (d_in, d_out), dtype) * (d_in**-0.5), axes)
        self.bias = param(jnp.zeros((d_out,), dtype), axes[1:]) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        k = self.kernel
        y = quant.matmul(x, k) if isinstance(k, quant.Packed) else kernels.dense(x, k[...])
        return y + self.bias[...] if self.bias is not None else y

    def weight(self) -> jax.Array:
        """The float kernel [in, out] (dequantised if packed), for the few uses that need the matrix itself."""
        k = self.kernel
        if isinstance(k, quant.Packed):
            return quant.as_float(k).T
        w = k[...]
        return w if isinstance(w, jax.Array) else w.weight()  # a backend layout gives its array back


def project(x: jax.Array, *linears: Linear) -> list[jax.Array]:
    """[lin(x) for lin in linears], float weights in one call together (`kernels.dense_many`) where the backend
    runs each alone otherwise; packed weights each alone."""
    if any(isinstance(lin.kernel, quant.Packed) for lin in linears):
        return [lin(x) for lin in linears]
    ys = kernels.dense_many(x, [lin.kernel[...] for lin in linears])
    return [y + lin.bias[...] if lin.bias is not None else y for y, lin in zip(ys, linears)]


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
        parts = W.parts() if vocab is None else [None if a is None else jnp.take(a, vocab, axis=0) for a in W.parts()]
        return kernels.packed_matmul(h, *parts).astype(jnp.float32)  # rows taken still packed
    return kernels.dense(h, W[...], transposed=lm_head is None, select=vocab, out_dtype=jnp.float32)


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
    evaluates them once per head and half (18x for SmolLM2's 9 query heads), which made RoPE a visible share
    of a verify round and of a prefill (docs/benchmarks/cpu.md, "The three cuts"). A float32 reduce_precision
    to float32's own widths changes no value; XLA does not fuse through it.
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
