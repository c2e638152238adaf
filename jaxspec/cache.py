"""Cache pytrees.

`KVCache` is a dense per-layer K/V buffer shared by every row of the batch at the same slot index:
prompts are left-padded, so one `dynamic_update_slice` at slot `length` writes a step for all rows,
and row b's committed tokens are slots `start[b] .. length-1` at RoPE positions `slot - start[b]`.
Slots at and past `length` are scratch: a forward writes its new tokens there ("pending"), and
`length` only moves when tokens are committed (AR: +N; tree verify: the accepted path, compacted).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # per layer [B, KVH, T, D]
    v: tuple[jax.Array, ...]  # per layer [B, KVH, T, D]
    length: jax.Array  # [] int32: slots in use (committed tokens, incl. left padding)
    start: jax.Array  # [B] int32: first real slot of each row (left padding before it)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @staticmethod
    def init(num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int, dtype) -> "KVCache":
        z = lambda: jnp.zeros((batch, num_kv_heads, max_len, head_dim), dtype)  # noqa: E731
        return KVCache(
            k=tuple(z() for _ in range(num_layers)),
            v=tuple(z() for _ in range(num_layers)),
            length=jnp.zeros((), jnp.int32),
            start=jnp.zeros((batch,), jnp.int32),
        )

    def advance(self, n) -> "KVCache":
        """Commit the next n pending slots as they are (prefill and AR decode)."""
        return KVCache(self.k, self.v, self.length + n, self.start)
