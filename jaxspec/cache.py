"""Caches that commit themselves: one pytree with a shared header and one entry per layer.

The header is shared by every layer and holds two numbers per row: `length[b]`, the committed slots (left
padding included), and `start[b]`, the first real slot (row b's committed tokens are slots
`start[b] .. length[b]-1` at positions `slot - start[b]`). Lengths are per row because a batch of speculative
rows accepts a different number of tokens each round; AR rows move in lockstep, so theirs stay equal. A
forward appends N tokens per row as *pending* state without moving `length`; the engine then keeps them in
one of two ways, and each entry type decides what that means for its own buffers:

  * `advance(n)`: keep the first n appended tokens as they are (prefill, AR decode);
  * `commit(path, n)`: keep each row's tree nodes `path[b, :n[b]]` in that order (speculative verify: the
    accepted paths).

A KV entry is slot-addressed: the forward writes row b's K/V at slots `length[b] ..`, `advance` has nothing to
do, and `commit` moves the accepted rows into place (`pallas_kernels.kv_commit`). An MLA latent entry is the
same with one row per token instead of one per KV head (`latent_commit`). A sliding-window layer keeps a ring
of its last `window` tokens (`RingKVEntry`) and writes the kept ones into it. A recurrent entry folds its
pending state instead. The conformance tests (tests/test_cache.py) hold every entry type to one promise:
verify + commit equals a causal prefill of the accepted tokens.

Every buffer declares logical axis names (`AXES`), the metadata that sharding maps onto a mesh; a
`seq` axis also tells generic code (and the conformance tests) which slots are committed, a `window` axis that
the buffer is a ring.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from pallas_kernels.kv_commit import kv_commit, latent_commit


@jax.tree_util.register_dataclass
@dataclass
class KVEntry:
    """K and V of one attention layer, by slot."""

    k: jax.Array  # [B, KVH, T, D]
    v: jax.Array  # [B, KVH, T, D]
    AXES: ClassVar[dict[str, tuple[str, ...]]] = {"k": ("batch", "kv_heads", "seq", "head_dim"),
                                                  "v": ("batch", "kv_heads", "seq", "head_dim")}

    @staticmethod
    def init(batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype) -> "KVEntry":
        return KVEntry(*(jnp.zeros((batch, num_kv_heads, max_len, head_dim), dtype) for _ in range(2)))

    def write(self, k: jax.Array, v: jax.Array, length) -> "KVEntry":
        """New k, v [B, N, KVH, D] go to row b's slots length[b] .. length[b]+N-1 (the caller sizes the cache so
        they fit)."""
        return KVEntry(write_rows(self.k, k.transpose(0, 2, 1, 3), length, 2),
                       write_rows(self.v, v.transpose(0, 2, 1, 3), length, 2))

    def advance(self, n, length) -> "KVEntry":
        return self  # the appended slots already sit where they belong

    def commit(self, path, n, length, impl: str) -> "KVEntry":
        """Row b's slot length[b] + path[b, i] -> length[b] + i for i < n[b]. RoPE needs no fix-up: node
        path[b, i] sits at depth i, so its position was already length[b] + i."""
        return KVEntry(kv_commit(self.k, path, length, n, impl=impl), kv_commit(self.v, path, length, n, impl=impl))


@jax.tree_util.register_dataclass
@dataclass
class LatentEntry:
    """One MLA layer's cache, by slot: [normalised c_kv | rotated k_pe] per token (models/mla.py).

    One buffer rather than two, because absorbed attention reads it as one shared key of width r + dr
    (c_kv as the shared value), and a commit then moves one row of r + dr values per accepted token."""

    latent: jax.Array  # [B, T, kv_lora_rank + qk_rope_head_dim]
    AXES: ClassVar[dict[str, tuple[str, ...]]] = {"latent": ("batch", "seq", "latent")}

    @staticmethod
    def init(batch: int, max_len: int, width: int, dtype) -> "LatentEntry":
        return LatentEntry(jnp.zeros((batch, max_len, width), dtype))

    def write(self, latent: jax.Array, length) -> "LatentEntry":
        """New latents [B, N, width] go to row b's slots length[b] .. length[b]+N-1."""
        return LatentEntry(write_rows(self.latent, latent, length, 1))

    def advance(self, n, length) -> "LatentEntry":
        return self

    def commit(self, path, n, length, impl: str) -> "LatentEntry":
        """As KVEntry.commit; k_pe was rotated at position length[b] + i already."""
        return LatentEntry(latent_commit(self.latent, path, length, n, impl=impl))


@jax.tree_util.register_dataclass
@dataclass
class RingKVEntry:
    """K and V of one sliding-window layer in a ring of R = min(window, max_len) slots: committed slot s sits at
    ring slot s mod R. A query at slot q >= length sees keys at slots > q - window, so the last R committed
    tokens are all any query can see, and the cache holds window slots per layer instead of max_len.

    A forward keeps its own K/V beside the ring (`pending`): its queries read the ring as it was plus those
    (`attention.ring_mask`), and advance / commit write only the kept tokens into the ring, overwriting the
    oldest. Tree nodes that are not accepted never touch it, so no committed slot is lost to them."""

    k: jax.Array  # [B, KVH, R, D]
    v: jax.Array  # [B, KVH, R, D]
    window: int = field(metadata=dict(static=True))  # the layer's window (R when max_len allows)
    pending: tuple[jax.Array, jax.Array] | None = None  # this forward's k, v [B, N, KVH, D]
    AXES: ClassVar[dict[str, tuple[str, ...]]] = {"k": ("batch", "kv_heads", "window", "head_dim"),
                                                  "v": ("batch", "kv_heads", "window", "head_dim")}

    @staticmethod
    def init(batch: int, max_len: int, window: int, num_kv_heads: int, head_dim: int, dtype) -> "RingKVEntry":
        R = min(window, max_len)
        return RingKVEntry(*(jnp.zeros((batch, num_kv_heads, R, head_dim), dtype) for _ in range(2)), window)

    @property
    def slots(self) -> int:
        return self.k.shape[2]

    def write(self, k: jax.Array, v: jax.Array, length) -> "RingKVEntry":
        """New k, v [B, N, KVH, D], kept as pending until advance or commit."""
        return replace(self, pending=(k, v))

    def advance(self, n, length) -> "RingKVEntry":
        """Keep the first n[b] pending tokens of row b as slots length[b] ..."""
        k, v = self.pending
        n = jnp.broadcast_to(jnp.asarray(n, jnp.int32), length.shape)
        return RingKVEntry(_ring_put(self.k, k, length, n), _ring_put(self.v, v, length, n), self.window)

    def commit(self, path, n, length, impl: str) -> "RingKVEntry":
        """Row b's pending node path[b, i] -> slot length[b] + i for i < n[b] (`impl` names the slot-addressed
        entries' kernel; a ring's write is one scatter)."""
        def take(x):  # [B, N, KVH, D] -> the path's nodes [B, P, KVH, D]
            return jnp.take_along_axis(x, path[:, :, None, None], axis=1)

        k, v = self.pending
        return RingKVEntry(_ring_put(self.k, take(k), length, n), _ring_put(self.v, take(v), length, n), self.window)

    def rering(self, length, shift, max_len: int) -> "RingKVEntry":
        """The ring for a cache of `max_len` slots per row whose committed length is `length` [B], where new slot
        s holds what old slot s + shift[b] held (Cache.reslot, put_rows)."""
        R = min(self.window, max_len)
        s = length[:, None] - 1 - jnp.mod(length[:, None] - 1 - jnp.arange(R)[None, :], R)  # [B, R] slot held
        old = jnp.mod(s + shift[:, None], self.slots)[:, None, :, None]
        return RingKVEntry(*(jnp.take_along_axis(x, old, axis=2) for x in (self.k, self.v)), self.window)


def _ring_put(ring, x, length, n):
    """ring [B, KVH, R, D] with row b's x[b, i] ([B, M, KVH, D]) written as slot length[b] + i for i < n[b]; when
    n[b] > R only the last R of them (one scatter, no slot written twice)."""
    R = ring.shape[2]
    i = jnp.arange(x.shape[1])[None, :]
    keep = (i < n[:, None]) & (i >= n[:, None] - R)
    slot = jnp.where(keep, jnp.mod(length[:, None] + i, R), R)  # [B, M]; R: dropped

    def one(r, s, xb):  # r [KVH, R, D], s [M], xb [M, KVH, D]
        return r.at[:, s].set(xb.transpose(1, 0, 2).astype(r.dtype), mode="drop")

    return jax.vmap(one)(ring, slot, x)


@jax.tree_util.register_dataclass
@dataclass
class Cache:
    layers: tuple[Any, ...]  # one entry per layer (KVEntry, LatentEntry, ...)
    length: jax.Array  # [B] int32: committed slots of each row, left padding included
    start: jax.Array  # [B] int32: first real slot of each row
    max_len: int = field(metadata=dict(static=True))  # slots per row

    @staticmethod
    def init(layers, batch: int, max_len: int) -> "Cache":
        return Cache(tuple(layers), jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32), max_len)

    def with_start(self, start) -> "Cache":
        return replace(self, start=jnp.asarray(start, jnp.int32))

    def advance(self, n) -> "Cache":
        """Keep the first n appended tokens: n [] or [B] (traced is fine)."""
        return replace(self, layers=tuple(e.advance(n, self.length) for e in self.layers), length=self.length + n)

    def commit(self, path, n, *, impl: str = "xla") -> "Cache":
        """Keep each row's tree nodes path[b, :n[b]] in order (path [B, P] int32, or [P] shared by every row;
        path[b, 0] = 0 the root, strictly increasing; n [B] or []).

        impl: the KV commit's implementation, "xla" or "pallas" (pallas_kernels.kv_commit)."""
        B = self.length.shape[0]
        path = jnp.broadcast_to(jnp.asarray(path, jnp.int32), (B, jnp.shape(path)[-1]))
        n = jnp.broadcast_to(jnp.asarray(n, jnp.int32), (B,))
        layers = tuple(e.commit(path, n, self.length, impl) for e in self.layers)
        return replace(self, layers=layers, length=self.length + n)

    def grow(self, max_len: int) -> "Cache":
        """The same cache with `max_len` slots per row: every buffer with a `seq` axis gets empty slots at the
        end, the rest (recurrent state) is kept. Attention reads every slot of its buffer, so a batched AR
        decode starts small and grows by windows instead of reading a mostly empty full-length buffer."""
        assert max_len >= self.max_len, (max_len, self.max_len)
        return self.reslot(0, max_len)

    def reslot(self, shift, max_len: int) -> "Cache":
        """The same committed tokens in a buffer of `max_len` slots, moved `shift` slots left (old slot s is new
        slot s - shift; traced shift is fine, negative moves right): continuous batching slides the live rows'
        tokens to the front of a short buffer instead of growing it for ever. Slots moved off either end are
        lost, so the caller keeps every live row's committed slots inside."""

        def move(x, axis):
            pad = [(0, 0)] * x.ndim
            pad[axis] = (max_len, max_len)  # every shift in [-max_len, T] stays inside
            return jax.lax.dynamic_slice_in_dim(jnp.pad(x, pad), shift + max_len, max_len, axis=axis)

        length = self.length - shift
        layers = tuple(e.rering(length, jnp.broadcast_to(shift, length.shape), max_len) if isinstance(e, RingKVEntry)
                       else _map_buffers(e, lambda x, axes: move(x, axes.index("seq")) if "seq" in axes else x)
                       for e in self.layers)
        return replace(self, layers=layers, length=length, start=self.start - shift, max_len=max_len)

    def put_rows(self, rows, new: "Cache") -> "Cache":
        """Rows `rows` [R] replaced by the R rows of `new`, a freshly prefilled cache of new.max_len ==
        new.length slots: new row r's slots land so that it ends where row rows[r]'s committed tokens end
        (continuous batching keeps AR rows in lockstep). Rows past the batch (padding of `rows` to a fixed R)
        are dropped. Needs new.length <= length (reslot first)."""
        ends = self.length[jnp.minimum(rows, self.length.shape[0] - 1)]  # [R]
        offset = ends - new.length

        def put(x, y, axes):
            if "seq" not in axes:
                return x.at[rows].set(y.astype(x.dtype), mode="drop")
            fresh = jnp.zeros((y.shape[0], *x.shape[1:]), x.dtype)  # slots before the prompt stay hidden by start
            return x.at[rows].set(write_rows(fresh, y, offset, axes.index("seq")), mode="drop")

        def put_ring(e, n):  # new's ring turned so that its slots sit where the rows' slots end
            ring = n.rering(ends, -offset, self.max_len)
            return replace(e, k=e.k.at[rows].set(ring.k.astype(e.k.dtype), mode="drop"),
                           v=e.v.at[rows].set(ring.v.astype(e.v.dtype), mode="drop"))

        layers = tuple(put_ring(e, n) if isinstance(e, RingKVEntry) else _map_buffers(e, put, n)
                       for e, n in zip(self.layers, new.layers))
        return replace(self, layers=layers, start=self.start.at[rows].set(new.start + offset, mode="drop"))

    def logical_axes(self) -> "Cache":
        """The same pytree with a logical PartitionSpec in place of every buffer."""
        def spec(entry):
            return replace(entry, **{name: PartitionSpec(*axes) for name, axes in entry.AXES.items()})

        return replace(self, layers=tuple(spec(e) for e in self.layers), length=PartitionSpec("batch"),
                       start=PartitionSpec("batch"))


def write_rows(buf, x, at, axis: int):
    """buf [B, ...] with row b's x[b] written from index at[b] of `axis` (at [B] or []; x's other dimensions
    equal buf's): one dynamic_update_slice per row, which XLA merges into one scatter."""
    at = jnp.broadcast_to(jnp.asarray(at, jnp.int32), buf.shape[:1])

    def one(b, xb, a):
        idx = [jnp.int32(0)] * b.ndim
        idx[axis - 1] = a
        return jax.lax.dynamic_update_slice(b, xb.astype(b.dtype), idx)

    return jax.vmap(one)(buf, x, at)


def _map_buffers(entry, fn, other=None):
    """`entry` with fn(buffer, axes) (or fn(buffer, other's buffer, axes)) applied to each buffer named in AXES;
    every AXES layout starts with the batch axis."""
    def one(name, axes):
        assert axes[0] == "batch", (type(entry).__name__, name, axes)
        x = getattr(entry, name)
        return fn(x, axes) if other is None else fn(x, getattr(other, name), axes)

    return replace(entry, **{name: one(name, axes) for name, axes in entry.AXES.items()})
