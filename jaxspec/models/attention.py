"""GQA attention, shared by the dense targets and the DFlash drafter.

A target layer appends N tokens at explicit positions with an explicit visibility mask: the new K/V go into
the layer's `KVEntry` at slots `length .. length+N-1` and the queries attend over the whole buffer
`[cache | new]`. One entry point serves prefill (causal), AR decode (N = 1) and tree verification
(N = 1 + budget, ancestor mask). The drafter uses the same projections (`queries`, `keys_values`) over its
own context and block.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from flax import nnx

from jaxspec import kernels
from jaxspec.cache import Cache, KVEntry, RingKVEntry
from jaxspec.config import RopeConfig
from jaxspec.models.layers import Linear, RMSNorm, apply_rope, project, rope_inv_freq


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer's geometry and switches."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    scale: float  # softmax scale (head_dim ** -0.5 unless the model says otherwise)
    eps: float = 1e-6
    bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k (Qwen3, Gemma 3, DFlash)
    norm_plus_one: bool = False  # Gemma's (1 + w) norms
    window: int | None = None  # sliding window (counts the query itself), None = full
    softcap: float | None = None  # attention logit soft-capping


def cache_mask(positions, length, start, visible, max_len):
    """Visibility of every cache slot for every new token.

    positions: [B, N] RoPE positions of the new tokens; length: [B] committed slots; start: [B] first
    real slot per row; visible: [B, N, N] which new tokens each new token sees (causal or ancestors).
    Slots before `start` are hidden here even when new, so a left-padded prefill may pass a plain causal
    `visible`. Returns mask [B, N, T] bool and key positions [B, T] (used by sliding windows).
    """
    B, N = positions.shape
    slot = jnp.arange(max_len)
    real = slot[None, :] >= start[:, None]  # [B, T]: left-padding slots are never visible, even when new
    committed = real & (slot[None, :] < length[:, None])  # [B, T]
    j = slot[None, :] - length[:, None]  # [B, T]: index into the new tokens
    is_new = (j >= 0) & (j < N)
    jc = jnp.clip(j, 0, N - 1)
    new_vis = jnp.take_along_axis(visible, jnp.broadcast_to(jc[:, None, :], (B, N, max_len)), axis=2)
    new_vis = new_vis & (is_new & real)[:, None, :]  # [B, N, T]
    mask = committed[:, None, :] | new_vis
    key_pos = jnp.where(is_new, jnp.take_along_axis(positions, jc, 1), slot[None, :] - start[:, None])
    return mask, key_pos


def ring_mask(positions, length, start, visible, slots: int, window: int):
    """Visibility for a sliding-window layer's ring (cache.RingKVEntry) of `slots` slots: mask [B, N, slots + N]
    as kernels.cache_attention takes it with length min(length, slots). Column j is ring slot j, which holds
    committed slot s = length - 1 - ((length - 1 - j) mod slots) (s < start: empty or padding); new token i is
    column min(length, slots) + i. Both restricted to the window; arguments as cache_mask's."""
    B, N = positions.shape
    L, first = length[:, None], start[:, None]
    s = L - 1 - jnp.mod(L - 1 - jnp.arange(slots)[None, :], slots)  # [B, slots]
    old = (s >= first)[:, None, :] & (positions[:, :, None] - (s - first)[:, None, :] < window)  # [B, N, slots]
    real = (L + jnp.arange(N)[None, :]) >= first  # [B, N]: left padding is never visible
    own = visible & real[:, None, :] & (positions[:, :, None] - positions[:, None, :] < window)  # [B, N, N]
    used = jnp.minimum(length, slots)[:, None]
    col = jnp.arange(slots + N)[None, :]
    i = col - used  # [B, slots + N]: index into the new tokens
    new = jnp.take_along_axis(own, jnp.broadcast_to(jnp.clip(i, 0, N - 1)[:, None, :], (B, N, slots + N)), axis=2)
    old = jnp.pad(old, ((0, 0), (0, 0), (0, N))) & (col < used)[:, None, :]
    return jnp.where(((i >= 0) & (i < N))[:, None, :], new, old)


def masks(segment, cache: Cache):
    """A forward's masks: cache_mask's (mask [B, N, T], key positions [B, T]) for slot-addressed entries, and
    ring_mask's for the cache's ring entries (None without any; a model's rings share one window)."""
    mask, key_pos = cache_mask(segment.positions, cache.length, cache.start, segment.visible, cache.max_len)
    rings = {(e.slots, e.window) for e in cache.layers if isinstance(e, RingKVEntry)}
    assert len(rings) <= 1, rings
    ring = (ring_mask(segment.positions, cache.length, cache.start, segment.visible, *rings.pop()) if rings
            else None)
    return mask, key_pos, ring


def sliding(mask, positions, key_pos, window):
    """Restrict a mask to keys within `window` positions (the window counts the query itself)."""
    return mask & (positions[:, :, None] - key_pos[:, None, :] < window)


def attend(q, k, v, mask, scale, softcap=None):
    """Softmax attention in float32. q: [B, N, H, D]; k, v: [B, KVH, T, D]; mask: [B, N, T] -> [B, N, H, D]
    (`kernels.attention`)."""
    return kernels.attention(q, k, v, mask, scale, softcap)


def attend_and_write(q, entry: KVEntry, k_new, v_new, length, mask, scale, softcap=None, ranged: bool = False):
    """`attend` q over the cache plus this forward's k_new, v_new [B, N, KVH, D] (mask [B, N, T] as over the
    written cache: row b's new keys' columns are length[b] .. length[b] + N - 1), and the entry with them written.

    Why not write first and attend over the written buffer: XLA:CPU then duplicates the write into the
    attention's operand fusion and copies every cache buffer several times a step. Here the attention reads
    the cache as it was (slots < length) and the new keys beside it (`kernels.cache_attention`), and the write
    is made to depend on the attention's output, so XLA sees the read happen first and updates the buffer in
    place: no copies."""
    o = attend_cache(q, entry.k, entry.v, k_new, v_new, length, mask, scale, softcap, ranged)
    after = (o[0, 0, 0, 0] * 0).astype(k_new.dtype)  # 0 (NaN only if o is): a data dependence on the read
    return o, entry.write(k_new + after, v_new + after, length)


def attend_ring(q, entry: RingKVEntry, k_new, v_new, length, mask, scale, softcap=None):
    """`attend` q over a ring entry's slots plus this forward's k_new, v_new [B, N, KVH, D] (mask from ring_mask),
    and the entry with them pending. The pending keys depend on the attention's output, as in attend_and_write,
    so the ring's later in-place write comes after this read."""
    o = attend_cache(q, entry.k, entry.v, k_new, v_new, jnp.minimum(length, entry.slots), mask, scale, softcap)
    after = (o[0, 0, 0, 0] * 0).astype(k_new.dtype)
    return o, entry.write(k_new + after, v_new + after, length)


def attend_cache(q, k_old, v_old, k_new, v_new, length, mask, scale, softcap=None, ranged: bool = False):
    """q [B, N, H, D] over the committed slots of k_old, v_old [B, KVH, T, D] (row b's slots < length[b] where
    mask) and k_new, v_new [B, N, KVH, D] (new key i where mask[b, :, length[b] + i]) -> [B, N, H, D]
    (`kernels.cache_attention`). ranged: every query sees the same committed slots [start, length) (a layer
    without a sliding window), so a GPU may read them with its flash-decoding kernel."""
    return kernels.cache_attention(q, k_old, v_old, k_new, v_new, length, mask, scale, softcap, ranged)


class Attention(nnx.Module):
    def __init__(self, spec: AttentionSpec, *, dtype=jnp.float32, rngs: nnx.Rngs):
        H, nH, nKV, D = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.spec = spec
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(D, spec.rope))  # static
        self.q_proj = Linear(H, nH * D, ("embed", "q_heads"), bias=spec.bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(H, nKV * D, ("embed", "kv_heads"), bias=spec.bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(H, nKV * D, ("embed", "kv_heads"), bias=spec.bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(nH * D, H, ("q_heads", "embed"), bias=spec.bias, dtype=dtype, rngs=rngs)
        if spec.qk_norm:
            norm = lambda: RMSNorm(D, spec.eps, plus_one=spec.norm_plus_one, axis="head_dim", dtype=dtype)  # noqa: E731
            self.q_norm, self.k_norm = norm(), norm()
        else:
            self.q_norm = self.k_norm = None

    def keys_values(self, x, positions):
        """x [B, N, H] -> k, v [B, N, kv_heads, D], k normed and rotated."""
        return self._keys_values(*project(x, self.k_proj, self.v_proj), positions)

    def qkv(self, x, positions):
        """x [B, N, H] -> q [B, N, heads, D] normed and rotated, and keys_values; one product call for the
        three projections (layers.project)."""
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        return (self._queries(q, positions), *self._keys_values(k, v, positions))

    def _queries(self, q, positions):  # q_proj's output [B, N, heads * D]
        B, N, _ = q.shape
        q = q.reshape(B, N, self.spec.num_heads, self.spec.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, positions, jnp.asarray(self.inv_freq, jnp.float32))

    def _keys_values(self, k, v, positions):  # k_proj's and v_proj's outputs [B, N, kv_heads * D]
        B, N, _ = k.shape
        k = k.reshape(B, N, self.spec.num_kv_heads, self.spec.head_dim)
        v = v.reshape(B, N, self.spec.num_kv_heads, self.spec.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, positions, jnp.asarray(self.inv_freq, jnp.float32)), v

    def output(self, q, k, v, mask):
        """Attend q [B, N, heads, D] over k, v [B, kv_heads, T, D] with mask [B, N, T]; project -> [B, N, H]."""
        B, N = q.shape[:2]
        o = attend(q, k, v, mask, self.spec.scale, self.spec.softcap)
        return self.o_proj(o.reshape(B, N, self.spec.num_heads * self.spec.head_dim))

    def __call__(self, x, positions, entry: KVEntry | RingKVEntry, length, mask, key_pos):
        """x: [B, N, H]; mask: [B, N, T] over [cache | new] (a ring entry: ring_mask's); returns (out [B, N, H],
        entry with the new K/V)."""
        q, k, v = self.qkv(x, positions)
        B, N = x.shape[:2]
        if isinstance(entry, RingKVEntry):
            o, entry = attend_ring(q, entry, k, v, length, mask, self.spec.scale, self.spec.softcap)
        else:
            if self.spec.window is not None:
                mask = sliding(mask, positions, key_pos, self.spec.window)
            o, entry = attend_and_write(q, entry, k, v, length, mask, self.spec.scale, self.spec.softcap,
                                        ranged=self.spec.window is None)
        return self.o_proj(o.reshape(B, N, self.spec.num_heads * self.spec.head_dim)), entry
