"""GQA attention that appends N tokens at explicit positions with an explicit visibility mask.

The one entry point serves prefill (N = prompt, causal), AR decode (N = 1) and tree verification
(N = 1 + budget, ancestor mask): new K/V are written into the cache at slots `length .. length+N-1`
and the queries attend over the whole buffer `[cache | new]` through a boolean mask.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.config import DenseConfig
from jaxspec.models.layers import Linear, RMSNorm, apply_rope, rope_inv_freq

NEG_INF = -1e30  # finite, so fully masked padding rows give a uniform softmax instead of NaN


def cache_mask(positions, length, start, visible, max_len):
    """Visibility of every cache slot for every new token.

    positions: [B, N] RoPE positions of the new tokens; length: [] committed slots; start: [B] first
    real slot per row; visible: [B, N, N] which new tokens each new token sees (causal or ancestors).
    Slots before `start` are hidden here even when new, so a left-padded prefill may pass a plain causal
    `visible`. Returns mask [B, N, T] bool and key positions [B, T] (used by sliding windows).
    """
    B, N = positions.shape
    slot = jnp.arange(max_len)
    real = slot[None, :] >= start[:, None]  # [B, T]: left-padding slots are never visible, even when new
    committed = real & (slot[None, :] < length)  # [B, T]
    j = slot - length  # index into the new tokens
    is_new = (j >= 0) & (j < N)
    jc = jnp.clip(j, 0, N - 1)
    new_vis = jnp.take_along_axis(visible, jnp.broadcast_to(jc, (B, N, max_len)), axis=2)
    new_vis = new_vis & (is_new & real)[:, None, :]  # [B, N, T]
    mask = committed[:, None, :] | new_vis
    key_pos = jnp.where(is_new[None, :], jnp.take_along_axis(positions, jnp.broadcast_to(jc, (B, max_len)), 1),
                        slot[None, :] - start[:, None])
    return mask, key_pos


def sliding(mask, positions, key_pos, window):
    """Restrict a mask to keys within `window` positions (the window counts the query itself)."""
    return mask & (positions[:, :, None] - key_pos[:, None, :] < window)


def attend(q, k, v, mask, scale, softcap=None):
    """Softmax attention in float32. q: [B, N, H, D]; k, v: [B, KVH, T, D]; mask: [B, N, T] -> [B, N, H, D]."""
    B, N, H, D = q.shape
    KVH = k.shape[1]
    qg = q.reshape(B, N, KVH, H // KVH, D)
    s = jnp.einsum("bnkgd,bktd->bkgnt", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(mask[:, None, None, :, :], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bkgnt,bktd->bnkgd", p, v, preferred_element_type=jnp.float32)
    return o.reshape(B, N, H, D).astype(q.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: DenseConfig, layer: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        H, nH, nKV, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = nH, nKV, D
        self.scale, self.softcap = cfg.query_scale, cfg.attn_logit_softcapping
        self.window = cfg.sliding_window if cfg.is_sliding[layer] else None
        rope = cfg.rope_local if cfg.is_sliding[layer] else cfg.rope_global
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(D, rope))  # static
        self.q_proj = Linear(H, nH * D, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(H, nKV * D, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(H, nKV * D, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(nH * D, H, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps, plus_one=cfg.norm_plus_one, dtype=dtype)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, plus_one=cfg.norm_plus_one, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x, positions, k_cache, v_cache, length, mask, key_pos):
        """x: [B, N, H]; k_cache, v_cache: [B, KVH, T, D]; mask: [B, N, T]; returns out, k_cache, v_cache."""
        B, N, _ = x.shape
        D = self.head_dim
        q = self.q_proj(x).reshape(B, N, self.num_heads, D)
        k = self.k_proj(x).reshape(B, N, self.num_kv_heads, D)
        v = self.v_proj(x).reshape(B, N, self.num_kv_heads, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        # write the new K/V at slots length .. length+N-1 (the caller sizes the cache so they fit)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.transpose(0, 2, 1, 3).astype(k_cache.dtype), (0, 0, length, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.transpose(0, 2, 1, 3).astype(v_cache.dtype), (0, 0, length, 0))
        if self.window is not None:
            mask = sliding(mask, positions, key_pos, self.window)
        o = attend(q, k_cache, v_cache, mask, self.scale, self.softcap)
        return self.o_proj(o.reshape(B, N, self.num_heads * D)), k_cache, v_cache
