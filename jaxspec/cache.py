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
same with one row per token instead of one per KV head (`latent_commit`). A recurrent entry will fold
its pending state instead. The conformance tests (tests/test_cache.py) hold every entry type to one promise:
verify + commit equals a causal prefill of the accepted tokens.

Every buffer declares logical axis names (`AXES`), the metadata that sharding maps onto a mesh; a
`seq` axis also tells generic code (and the conformance tests) which slots are committed.
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

    def advance(self, n) -> "KVEntry":
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

    def advance(self, n) -> "LatentEntry":
        return self

    def commit(self, path, n, length, impl: str) -> "LatentEntry":
        """As KVEntry.commit; k_pe was rotated at position length[b] + i already."""
        return LatentEntry(latent_commit(self.latent, path, length, n, impl=impl))


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
        return replace(self, layers=tuple(e.advance(n) for e in self.layers), length=self.length + n)

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

        layers = tuple(_map_buffers(e, lambda x, axes: move(x, axes.index("seq")) if "seq" in axes else x)
                       for e in self.layers)
        return replace(self, layers=layers, length=self.length - shift, start=self.start - shift, max_len=max_len)

    def put_rows(self, rows, new: "Cache") -> "Cache":
        """Rows `rows` [R] replaced by the R rows of `new`, a freshly prefilled cache of new.max_len ==
        new.length slots: new row r's slots land so that it ends where row rows[r]'s committed tokens end
        (continuous batching keeps AR rows in lockstep). Rows past the batch (padding of `rows` to a fixed R)
        are dropped. Needs new.length <= length (reslot first)."""
        offset = self.length[jnp.minimum(rows, self.length.shape[0] - 1)] - new.length  # [R]

        def put(x, y, axes):
            if "seq" not in axes:
                return x.at[rows].set(y.astype(x.dtype), mode="drop")
            fresh = jnp.zeros((y.shape[0], *x.shape[1:]), x.dtype)  # slots before the prompt stay hidden by start
            return x.at[rows].set(write_rows(fresh, y, offset, axes.index("seq")), mode="drop")

        layers = tuple(_map_buffers(e, put, n) for e, n in zip(self.layers, new.layers))
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
