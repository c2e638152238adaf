"""What one target forward appends: the N new tokens' positions, what each sees, and whom each continues.

Every forward (prefill, AR decode, tree verify) appends N tokens behind the committed cache. Attention
layers need only `positions` and `visible`; recurrent layers (Gated DeltaNet) also need `parents`, since a
tree node must continue from its parent's state, never from the node before it in the array, and
`lengths`, since right padding must never be folded into a state.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass
class Segment:
    positions: jax.Array  # [B, N] int32: RoPE positions
    visible: jax.Array  # [B, N, N] bool: new token i sees new token j (j is i or an ancestor of i)
    parents: jax.Array  # [B, N] int32: the new token each one continues from; -1 = the last committed token
    lengths: jax.Array  # [B] int32: real tokens per row; tokens at and past it are right padding
    # Static: every token continues from the one before it (parents = i - 1, causal `visible`). Recurrent
    # layers may then scan the segment in chunks, carrying one state between them; a tree (False) has no
    # single state at a chunk boundary, so it is folded as one block. False is always exact.
    chain: bool = field(default=False, metadata=dict(static=True))

    @staticmethod
    def causal(positions: jax.Array, lengths: jax.Array | None = None) -> "Segment":
        """A linear run of tokens (prefill, AR decode). positions [B, N]; lengths [B] (default N)."""
        B, N = positions.shape
        i = jnp.arange(N, dtype=jnp.int32)
        return Segment(
            positions=positions.astype(jnp.int32),
            visible=jnp.broadcast_to(i[None, :] <= i[:, None], (B, N, N)),
            parents=jnp.broadcast_to(i - 1, (B, N)),
            lengths=(jnp.full((B,), N, jnp.int32) if lengths is None
                     else jnp.broadcast_to(lengths, (B,)).astype(jnp.int32)),
            chain=True,
        )
