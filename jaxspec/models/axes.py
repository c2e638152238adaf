"""Parameters with logical axis names.

Every parameter is created through `param`, which records its logical axis names (vocab, embed, q_heads,
kv_heads, head_dim, ffn, ...) as Flax sharding metadata: `nnx.get_partition_spec(state)` reads them back,
and jaxspec/sharding.py maps them to mesh axes with one rules table per family. Nothing is sharded at creation.
"""
from __future__ import annotations

import jax
from flax import nnx


def param(value: jax.Array, axes: tuple[str, ...]) -> nnx.Param:
    """A parameter with logical axis names, one per dimension (metadata only: no sharding happens here)."""
    assert len(axes) == value.ndim, (axes, value.shape)
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)
