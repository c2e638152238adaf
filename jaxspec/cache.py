"""Caches that commit themselves: one pytree with a shared header and one entry per layer.

The header is shared by every layer: `length`, the committed slots (left padding included), and `start`,
each row's first real slot (prompts are left-padded, so row b's committed tokens are slots
`start[b] .. length-1` at positions `slot - start[b]`). A forward appends N tokens as *pending* state
without moving `length`; the engine then keeps them in one of two ways, and each entry type decides what
that means for its own buffers:

  * `advance(n)`: keep the first n appended tokens as they are (prefill, AR decode);
  * `commit(path, n)`: keep tree nodes `path[:n]` in that order (speculative verify: the accepted path).

A KV entry is slot-addressed: the forward writes K/V at slots `length ..`, `advance` has nothing to do,
and `commit` moves the accepted rows into place (`pallas_kernels.kv_commit`). An MLA latent entry is the
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
        """New k, v [B, N, KVH, D] go to slots length .. length+N-1 (the caller sizes the cache so they fit)."""
        def put(buf, x):
            return jax.lax.dynamic_update_slice(buf, x.transpose(0, 2, 1, 3).astype(buf.dtype), (0, 0, length, 0))

        return KVEntry(put(self.k, k), put(self.v, v))

    def advance(self, n) -> "KVEntry":
        return self  # the appended slots already sit where they belong

    def commit(self, path, n, length, impl: str) -> "KVEntry":
        """Slot length + path[i] -> length + i for i < n. RoPE needs no fix-up: node path[i] sits at depth
        i, so its position was already length + i."""
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
        """New latents [B, N, width] go to slots length .. length+N-1."""
        return LatentEntry(jax.lax.dynamic_update_slice(self.latent, latent.astype(self.latent.dtype), (0, length, 0)))

    def advance(self, n) -> "LatentEntry":
        return self

    def commit(self, path, n, length, impl: str) -> "LatentEntry":
        """Slot length + path[i] -> length + i for i < n; k_pe was rotated at position length + i already."""
        return LatentEntry(latent_commit(self.latent, path, length, n, impl=impl))


@jax.tree_util.register_dataclass
@dataclass
class Cache:
    layers: tuple[Any, ...]  # one entry per layer (KVEntry, LatentEntry, ...)
    length: jax.Array  # [] int32: committed slots, left padding included
    start: jax.Array  # [B] int32: first real slot of each row
    max_len: int = field(metadata=dict(static=True))  # slots per row

    @staticmethod
    def init(layers, batch: int, max_len: int) -> "Cache":
        return Cache(tuple(layers), jnp.zeros((), jnp.int32), jnp.zeros((batch,), jnp.int32), max_len)

    def with_start(self, start) -> "Cache":
        return replace(self, start=jnp.asarray(start, jnp.int32))

    def advance(self, n) -> "Cache":
        """Keep the first n appended tokens (traced n is fine)."""
        return replace(self, layers=tuple(e.advance(n) for e in self.layers), length=self.length + n)

    def commit(self, path, n, *, impl: str = "xla") -> "Cache":
        """Keep tree nodes path[:n] (path [P] int32, path[0] = 0 the root, strictly increasing) in order.

        impl: the KV commit's implementation, "xla" or "pallas" (pallas_kernels.kv_commit)."""
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
        new.length slots: its slots land at length - new.length .. length - 1, so each new prompt ends where
        the other rows' committed tokens end and decodes on with them. Rows past the batch (padding of `rows`
        to a fixed R) are dropped. Needs new.length <= length (reslot first)."""
        offset = self.length - new.length

        def put(x, y, axes):
            if "seq" not in axes:
                return x.at[rows].set(y.astype(x.dtype), mode="drop")
            seq = axes.index("seq")
            at = [jnp.int32(0)] * x.ndim
            at[seq] = offset
            fresh = jnp.zeros((y.shape[0], *x.shape[1:]), x.dtype)  # slots before the prompt stay hidden by start
            return x.at[rows].set(jax.lax.dynamic_update_slice(fresh, y.astype(x.dtype), at), mode="drop")

        layers = tuple(_map_buffers(e, put, n) for e, n in zip(self.layers, new.layers))
        return replace(self, layers=layers, start=self.start.at[rows].set(new.start + offset, mode="drop"))

    def logical_axes(self) -> "Cache":
        """The same pytree with a logical PartitionSpec in place of every buffer."""
        def spec(entry):
            return replace(entry, **{name: PartitionSpec(*axes) for name, axes in entry.AXES.items()})

        return replace(self, layers=tuple(spec(e) for e in self.layers), length=PartitionSpec(),
                       start=PartitionSpec("batch"))


def _map_buffers(entry, fn, other=None):
    """`entry` with fn(buffer, axes) (or fn(buffer, other's buffer, axes)) applied to each buffer named in AXES;
    every AXES layout starts with the batch axis."""
    def one(name, axes):
        assert axes[0] == "batch", (type(entry).__name__, name, axes)
        x = getattr(entry, name)
        return fn(x, axes) if other is None else fn(x, getattr(other, name), axes)

    return replace(entry, **{name: one(name, axes) for name, axes in entry.AXES.items()})
