"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2) over a latent cache, in two equal forms.

Per token the layer caches only `[c_kv | k_pe]` (`LatentEntry`): the normalised KV latent
c_kv = RMSNorm(x W_kva[:r]) [kv_lora_rank] and the rotated shared rope key k_pe [qk_rope_head_dim], 576 values
for DeepSeek-V3 against 2 x 128 x 192 for expanded K/V. The per-head keys and values are up-projections
of c_kv through `kv_b_proj` (W_UK for k_nope, W_UV for v), so attention has two exact forms:

  * expanded (HF's): K = [c_kv W_UK | k_pe], V = c_kv W_UV for every slot, then MHA. Its cost is the
    expansion of all T slots, independent of the N new tokens: cheapest when N is large (prefill).
  * absorbed: q_lat = q_nope W_UK^T, then MQA with one shared key of width r + dr over the latent buffer
    itself, o = (softmax(.) c_kv) W_UV. No per-head K/V is built; the cost grows with N only: cheapest
    for decode (N = 1) and tree verify (N = 1 + budget).

Per head, the expanded form spends r (dn + dv) per cache slot on the expansion (once per forward) and
dn + dr + dv per (query, slot); the absorbed form spends r + dr + r per (query, slot) and nothing per slot.
So absorbed is cheaper while N < r (dn + dv) / (2r - dn - dv): 170 tokens for DeepSeek-V3 and Kimi K2
(`absorb_threshold`), which covers decode and a budget-64 tree; longer prefill chunks expand. bench/mla.py
times both forms by N (16 heads of DeepSeek-V3's shape over 1024 cached slots; figures in
docs/design/mla-moe.md): absorbed is the faster below the threshold, expanded above it.

RoPE: DeepSeek rotates interleaved pairs (2i, 2i+1) and writes the result de-interleaved
(`apply_rotary_pos_emb_interleave` in transformers' modeling_deepseek_v3.py); q and k get the same
permutation, so dot products are those of the interleaved rotation. Frequencies are YaRN's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec import kernels
from jaxspec.cache import LatentEntry
from jaxspec.models.layers import Linear, RMSNorm, rope_cos_sin

# q_a_layernorm and kv_a_layernorm: HF builds them with the default eps, whatever the config says
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLARope:
    """RoPE of the rope part (HF `rope_parameters`): "default" or "yarn"."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float | None = None  # None: max_position_embeddings / original_max_position_embeddings
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_tables(rope: MLARope, dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """(inv_freq [dim/2] float32, factor on cos/sin), as transformers' `_compute_yarn_parameters`."""
    exponent = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
    pos_freqs = np.float32(rope.theta) ** exponent
    if rope.rope_type == "default":
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
    orig = rope.original_max_position_embeddings
    factor = rope.factor if rope.factor is not None else max_position_embeddings / orig
    attn = rope.attention_factor
    if attn is None:
        attn = (_yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
                if rope.mscale and rope.mscale_all_dim else _yarn_mscale(factor))

    def corr(rot):  # the dimension whose wavelength makes `rot` turns over the original context
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = corr(rope.beta_fast or 32), corr(rope.beta_slow or 1)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp (Kimi: beta_fast == beta_slow)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = 1 - ramp  # HF's inv_freq_extrapolation_factor
    inv = (np.float32(1.0) / (np.float32(factor) * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return inv.astype(np.float32), float(attn)


def absorb_threshold(kv_lora_rank: int, qk_nope_head_dim: int, v_head_dim: int) -> int:
    """The largest N for which the absorbed form needs fewer FLOPs than the expanded one (module docstring)."""
    extra_per_query = 2 * kv_lora_rank - qk_nope_head_dim - v_head_dim
    if extra_per_query <= 0:
        return 2**31 - 1  # absorbed is never the dearer form
    return kv_lora_rank * (qk_nope_head_dim + v_head_dim) // extra_per_query


def softmax_scale(rope: MLARope, qk_head_dim: int) -> float:
    """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when the rope is scaled (`yarn_apply_mscale`)."""
    scale = qk_head_dim**-0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = _yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale *= m * m
    return scale


def apply_rope(x, positions, inv_freq, cos_sin_factor: float, interleave: bool):
    """x [B, N, heads, d]; positions [B, N]. Interleaved pairs (2i, 2i+1) -> de-interleaved output (HF), or
    half-split pairs (i, i + d/2)."""
    cos, sin = rope_cos_sin(positions, inv_freq)  # [B, N, 1, d/2]
    cos, sin = (cos * cos_sin_factor).astype(x.dtype), (sin * cos_sin_factor).astype(x.dtype)
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@dataclass(frozen=True)
class MLASpec:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None  # None: a plain q_proj (small variants)
    kv_lora_rank: int  # r
    qk_nope_head_dim: int  # dn
    qk_rope_head_dim: int  # dr
    v_head_dim: int  # dv
    inv_freq: tuple[float, ...]
    rope_factor: float  # YaRN's attention_factor on cos/sin
    scale: float  # softmax scale
    interleave: bool = True
    bias: bool = False
    absorb_max_tokens: int = 170  # forwards of at most this many tokens use the absorbed form


def attend_expanded(q_nope, q_pe, latent, mask, w_kvb, spec: MLASpec):
    """HF's form. q_nope [B, N, nH, dn], q_pe [B, N, nH, dr], latent [B, T, r + dr], w_kvb [r, nH*(dn+dv)],
    mask [B, N, T] -> o [B, N, nH, dv]."""
    return kernels.expanded_latent_attention(jnp.concatenate([q_nope, q_pe], -1), latent, mask, w_kvb, spec.scale,
                                             spec.qk_nope_head_dim)


def attend_absorbed(q_nope, q_pe, latent, mask, w_kvb, spec: MLASpec, length=None):
    """W_UK folded into q, W_UV applied after attention; same signature and result as `attend_expanded`.

    The latent buffer is the one shared key [c_kv | k_pe] of width r + dr, and c_kv the one shared value. length:
    the rows' committed lengths, with this forward's latents written after them (`MLA.__call__`): every query sees
    the same committed slots, which a GPU reads with its flash-decoding kernel (`kernels.latent_attention`)."""
    r, dn = spec.kv_lora_rank, spec.qk_nope_head_dim
    w = w_kvb.reshape(r, spec.num_heads, dn + spec.v_head_dim)
    w_uk, w_uv = w[..., :dn], w[..., dn:]  # [r, nH, dn], [r, nH, dv]
    q_lat = jnp.einsum("bnhd,rhd->bnhr", q_nope, w_uk, preferred_element_type=jnp.float32).astype(q_nope.dtype)
    q = jnp.concatenate([q_lat, q_pe], -1)  # [B, N, nH, r + dr]
    o_lat = kernels.latent_attention(q, latent, mask, spec.scale, r, length)  # [B, nH, N, r]
    return jnp.einsum("bhnr,rhd->bnhd", o_lat, w_uv, preferred_element_type=jnp.float32).astype(q_nope.dtype)


class MLA(nnx.Module):
    """DeepseekV3Attention's parameters under their HF names; appends N tokens' latents to a `LatentEntry`."""

    def __init__(self, spec: MLASpec, *, dtype=jnp.float32, rngs: nnx.Rngs):
        H, nH, r, dr = spec.hidden_size, spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim
        qk = spec.qk_nope_head_dim + dr
        self.spec = spec
        if spec.q_lora_rank is None:
            self.q_proj = Linear(H, nH * qk, ("embed", "q_heads"), dtype=dtype, rngs=rngs)
        else:
            self.q_a_proj = Linear(H, spec.q_lora_rank, ("embed", "q_latent"), bias=spec.bias, dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, LATENT_NORM_EPS, axis="q_latent", dtype=dtype)
            self.q_b_proj = Linear(spec.q_lora_rank, nH * qk, ("q_latent", "q_heads"), dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(H, r + dr, ("embed", "latent"), bias=spec.bias, dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(r, LATENT_NORM_EPS, axis="latent", dtype=dtype)
        self.kv_b_proj = Linear(r, nH * (spec.qk_nope_head_dim + spec.v_head_dim), ("latent", "q_heads"),
                                dtype=dtype, rngs=rngs)
        self.o_proj = Linear(nH * spec.v_head_dim, H, ("q_heads", "embed"), bias=spec.bias, dtype=dtype, rngs=rngs)

    def _rope(self, x, positions):
        return apply_rope(x, positions, np.asarray(self.spec.inv_freq, np.float32), self.spec.rope_factor,
                          self.spec.interleave)

    def queries(self, x, positions):
        """x [B, N, H] -> q_nope [B, N, nH, dn], rotated q_pe [B, N, nH, dr]."""
        B, N, _ = x.shape
        s = self.spec
        q = self.q_proj(x) if s.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, N, s.num_heads, s.qk_nope_head_dim + s.qk_rope_head_dim)
        return q[..., :s.qk_nope_head_dim], self._rope(q[..., s.qk_nope_head_dim:], positions)

    def latents(self, x, positions):
        """x [B, N, H] -> what the cache keeps: [normalised c_kv | rotated k_pe] [B, N, r + dr]."""
        r = self.spec.kv_lora_rank
        ckv = self.kv_a_proj_with_mqa(x)
        k_pe = self._rope(ckv[..., None, r:], positions)[..., 0, :]
        return jnp.concatenate([self.kv_a_layernorm(ckv[..., :r]), k_pe], -1)

    def __call__(self, x, positions, entry: LatentEntry, length, mask, *, absorbed: bool | None = None):
        """x [B, N, H]; mask [B, N, T] over [cache | new]. Returns (out [B, N, H], entry with the new latents).

        absorbed: the attention form; None chooses by N (see the module docstring)."""
        B, N, _ = x.shape
        entry = entry.write(self.latents(x, positions), length)
        q_nope, q_pe = self.queries(x, positions)
        if absorbed is None:
            absorbed = N <= self.spec.absorb_max_tokens
        w_kvb = self.kv_b_proj.weight()
        if absorbed:
            o = attend_absorbed(q_nope, q_pe, entry.latent, mask, w_kvb, self.spec, length)
        else:
            o = attend_expanded(q_nope, q_pe, entry.latent, mask, w_kvb, self.spec)
        return self.o_proj(o.reshape(B, N, self.spec.num_heads * self.spec.v_head_dim)), entry
