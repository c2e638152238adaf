"""Sharding: logical axes -> mesh axes, one rules table per family; `make_mesh`; placing params and caches.

Every parameter and cache buffer names a logical axis per dimension (models/layers.py `param`, cache entries'
`AXES`). A family's rules table maps each logical axis to a mesh axis or to None (replicated):

  * "tp" (tensor / expert parallel): q heads, kv heads, ffn, vocab; MoE experts (expert parallel: each
    device holds E / tp whole experts); GDN value heads, key heads and conv channels.
  * "dp" (data parallel): the batch of every cache buffer.

A dimension stays replicated when its size, or its number of heads, does not divide by the mesh axis: a
projection [embed, kv_heads * head_dim] is split between heads, never inside one, so a model with 4 KV heads
on tp = 8 keeps K/V whole on every device (correct, only bigger, and no resharding between the projection
and the cache). A mesh axis shards at most one dimension of an array (stacked experts [E, in, out] are split
by expert, not also by ffn).

The MLA latent cache ([batch, seq, kv_lora_rank + rope dims]) is sharded by batch and replicated over tp:
absorbed attention reads the whole latent row for every head, so splitting it by head is impossible and
splitting it by position would need a cross-device softmax. The cost is tp copies of 68.6 KiB per token
(DeepSeek-V3, bf16, 61 layers), still 71x less than one copy of expanded K/V.

Inside jit the engine pins every cache buffer to its sharding (`Layout.constrain`), so the loop carries
caches sharded like the layers that write them; XLA's partitioner (GSPMD) inserts the collectives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("dp", "tp")

_COMMON = {"batch": "dp", "seq": None, "vocab": "tp", "embed": None, "q_heads": "tp", "kv_heads": "tp",
           "head_dim": None, "ffn": "tp", "tap_embed": None}
RULES: dict[str, Mapping[str, str | None]] = {
    "dense": _COMMON,
    "deepseek": {**_COMMON, "experts": "tp", "latent": None, "q_latent": None},
    "hybrid_gdn": {**_COMMON, "experts": "tp", "shared_gate": None, "gdn_heads": "tp", "gdn_key_heads": "tp",
                   "gdn_key_dim": None, "gdn_value_dim": None, "conv_channels": "tp", "conv_kernel": None},
    # per_layer: Gemma 4's per-layer-input width (L * P packed, or P); small, so replicated
    "gemma4": {**_COMMON, "experts": "tp", "per_layer": None},
    "drafter": _COMMON,  # DFlash drafters: dense attention + MLP over the target's taps
}


def make_mesh(tp: int = 1, dp: int = 1, *, devices=None) -> Mesh:
    """A (dp, tp) mesh over the first dp * tp devices (all processes' devices under jax.distributed).

    Axes are Auto: the partitioner propagates shardings from the parameters and the pinned caches."""
    for name, n in (("tp", tp), ("dp", dp)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{name} must be a positive integer, got {n!r}")
    devices = list(jax.devices() if devices is None else devices)
    if tp * dp > len(devices):
        raise ValueError(f"a mesh of dp={dp} x tp={tp} needs {dp * tp} devices, but {len(devices)} are visible; "
                         "lower tp/dp (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N fakes N devices)")
    return jax.make_mesh((dp, tp), MESH_AXES, axis_types=(AxisType.Auto,) * 2, devices=devices[: dp * tp])


@dataclass(frozen=True)
class Layout:
    """How one model's arrays lie on a mesh: the mesh and its family's rules (hashable: a static jit arg)."""

    mesh: Mesh
    rules: tuple[tuple[str, str | None], ...]
    heads: tuple[tuple[str, int], ...] = ()  # logical axis -> heads along it (a head is never split)

    @staticmethod
    def of(family: str, mesh: Mesh, heads: Mapping[str, int] | None = None) -> "Layout":
        """family: a RULES key; heads: e.g. {"q_heads": 32, "kv_heads": 8} (the family's `head_counts`)."""
        if family not in RULES:
            raise ValueError(f"no sharding rules for family {family!r}; add a table to jaxspec/sharding.py RULES")
        return Layout(mesh, tuple(sorted(RULES[family].items())), tuple(sorted((heads or {}).items())))

    def spec(self, axes, shape) -> PartitionSpec:
        """Logical axes (one per dimension) of an array of `shape` -> its mesh PartitionSpec."""
        rules, heads, used, out = dict(self.rules), dict(self.heads), set(), []
        for axis, size in zip(axes, shape, strict=True):
            if axis not in rules:
                raise ValueError(f"logical axis {axis!r} has no rule in this family's sharding table")
            m = rules[axis]
            if m is None or m in used or size % self.mesh.shape[m] or heads.get(axis, size) % self.mesh.shape[m]:
                out.append(None)
            else:
                used.add(m)
                out.append(m)
        return PartitionSpec(*out)

    def sharding(self, axes, shape) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, shape))

    def param_shardings(self, params) -> Any:
        """nnx.State of parameters (concrete or abstract) -> the same tree with a NamedSharding per variable."""
        return jax.tree.map(lambda v: self.sharding(_axes(v), v.shape), params, is_leaf=_is_var)

    def place_params(self, params) -> Any:
        """Put every parameter onto its shards (each device receives only its slice)."""
        return jax.tree.map(lambda v: v.replace(place(v.get_value(), self.sharding(_axes(v), v.shape))),
                            params, is_leaf=_is_var)

    def cache_shardings(self, cache) -> Any:
        """A Cache (or any pytree with `logical_axes()`) -> the same tree of NamedShardings."""
        specs = cache.logical_axes()
        is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
        return jax.tree.map(lambda s, x: self.sharding(tuple(s), np.shape(x)), specs, cache, is_leaf=is_spec)

    def constrain(self, cache):
        """Pin a cache's buffers to their shardings inside jit."""
        return jax.lax.with_sharding_constraint(cache, self.cache_shardings(cache))


def place(x, sharding: NamedSharding) -> jax.Array:
    """Host (or single-device) array -> a global array with `sharding`, built slice by slice so no device
    ever holds more than its shard; works across processes (every process passes the same full array)."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def to_host(x) -> np.ndarray:
    """A (possibly multi-process) array -> numpy on this host; every process must call it (a collective
    gathers what other processes hold)."""
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _axes(v: nnx.Variable) -> tuple[str, ...]:
    axes = v.get_metadata().get("out_sharding")
    if axes is None:
        raise ValueError(f"parameter of shape {v.shape} has no logical axes; create it with models.layers.param")
    return tuple(axes)


__all__ = ["make_mesh", "Layout", "RULES", "MESH_AXES", "place", "to_host"]
