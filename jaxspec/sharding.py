"""Sharding: logical axes -> mesh axes, one rules table per family; `make_mesh`; placing params and caches.

Every parameter and cache buffer names a logical axis per dimension (models/layers.py `param`, cache entries'
`AXES`). A family's rules table maps each logical axis to a mesh axis or to None (replicated):

  * "tp" (tensor / expert parallel): q heads, kv heads, ffn, vocab; MoE experts (expert parallel: each
    device holds E / tp whole experts); GDN value heads, key heads and conv channels.
  * "dp" (data parallel): the batch of every cache buffer.

A dimension stays replicated when its size, or its number of heads, does not divide by the mesh axis: a
projection [embed, kv_heads * head_dim] is split between heads, never inside one. A mesh axis shards at most
one dimension of an array (stacked experts [E, in, out] are split by expert, not also by ffn).

KV heads fewer than tp (Qwen3.6-27B: 4 KV heads, 24 query heads, on tp = 8): the layout names its arrays on
a view of the mesh whose tp axis is split in two, tp_kv (g = gcd(kv_heads, tp) devices) major and tp_rep
(tp / g) minor, with the same devices in the same order. Everything tp splits is split over both, exactly as
over tp; K/V (projections and caches) only over tp_kv, so each device holds the KV heads its own query
heads read (query block i of tp reads KV heads inside block i // (tp / g) of g) and attention, the write and
the commit stay on the device. Replicated K/V instead were gathered whole: the partitioner split attention
and the write across the devices, and pinning the written buffers back to replicated cost 4 all-gathers of
an entire K or V buffer per attention layer and step (AR decode and verify alike; tests/test_sharding.py
counts collectives). The bytes per device are those of vLLM's copying of each KV head to the tp / kv_heads
devices that read it, with no change to the parameters or the cache.

The MLA latent cache ([batch, seq, kv_lora_rank + rope dims]) is sharded by batch and replicated over tp:
absorbed attention reads the whole latent row for every head, so splitting it by head is impossible and
splitting it by position would need a cross-device softmax. The cost is tp copies of 68.6 KiB per token
(DeepSeek-V3, bf16, 61 layers), still 71x less than one copy of expanded K/V.

Inside jit the engine pins every cache buffer to its sharding (`Layout.constrain`), so the loop carries
caches sharded like the layers that write them; XLA's partitioner (GSPMD) inserts the collectives. The rest of a
decode state (outputs, counters, rng keys) is pinned by rows over dp (`Layout.constrain_rows`) in every program
that returns one, so a prefill hands the decode loop the shardings it was compiled for.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("dp", "tp")
TP_SPLIT = ("tp_kv", "tp_rep")  # tp as a layout's view splits it where KV heads are fewer than tp

_COMMON = {"batch": "dp", "seq": None, "window": None, "vocab": "tp", "embed": None, "q_heads": "tp", "kv_heads": "tp",
           "head_dim": None, "ffn": "tp", "tap_embed": None}
RULES: dict[str, Mapping[str, str | None]] = {
    "dense": _COMMON,
    "deepseek": {**_COMMON, "experts": "tp", "latent": None, "q_latent": None},
    "hybrid_gdn": {**_COMMON, "experts": "tp", "shared_gate": None, "gdn_heads": "tp", "gdn_key_heads": "tp",
                   "gdn_key_dim": None, "gdn_value_dim": None, "conv_kernel": None},
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

    mesh: Mesh  # as the caller made it (make_mesh): what the target and its drafter must share
    rules: tuple[tuple[str, str | None], ...]
    heads: tuple[tuple[str, int], ...]  # logical axis -> heads along it (a head is never split)
    view: Mesh  # the mesh the shardings name: `mesh`, or its tp split in (tp_kv, tp_rep)

    @staticmethod
    def of(family: str, mesh: Mesh, heads: Mapping[str, int] | None = None) -> "Layout":
        """family: a RULES key; heads: e.g. {"q_heads": 32, "kv_heads": 8} (the family's `head_counts`)."""
        if family not in RULES:
            raise ValueError(f"no sharding rules for family {family!r}; add a table to jaxspec/sharding.py RULES")
        heads = dict(heads or {})
        dp, tp = mesh.shape["dp"], mesh.shape["tp"]
        g = math.gcd(heads.get("kv_heads", tp), tp)
        view = mesh if g in (1, tp) else _split_tp(mesh, dp, g, tp // g)  # g = 1: K/V replicated
        return Layout(mesh, tuple(sorted(RULES[family].items())), tuple(sorted(heads.items())), view)

    def _mesh_axes(self, axis: str, rule: str | None) -> tuple[str, ...]:
        """The view's axes a logical axis with mesh rule `rule` splits over (major first)."""
        if rule is None:
            return ()
        if rule == "tp" and "tp_kv" in self.view.shape:
            return ("tp_kv",) if axis == "kv_heads" else TP_SPLIT
        return (rule,)

    def spec(self, axes, shape) -> PartitionSpec:
        """Logical axes (one per dimension) of an array of `shape` -> its PartitionSpec on the view."""
        rules, heads, used, out = dict(self.rules), dict(self.heads), set(), []
        for axis, size in zip(axes, shape, strict=True):
            if axis not in rules:
                raise ValueError(f"logical axis {axis!r} has no rule in this family's sharding table")
            names = self._mesh_axes(axis, rules[axis])
            n = math.prod(self.view.shape[a] for a in names)
            if not names or used & set(names) or size % n or heads.get(axis, size) % n:
                out.append(None)
            else:
                used.update(names)
                out.append(names[0] if len(names) == 1 else names)
        return PartitionSpec(*out)

    def shards(self, axes, shape) -> int:
        """How many pieces an array is split into (the product of the view's axes its spec uses)."""
        spec = self.spec(axes, shape)
        return math.prod(self.view.shape[a] for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e))

    def sharding(self, axes, shape) -> NamedSharding:
        return NamedSharding(self.view, self.spec(axes, shape))

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

    def row_sharding(self, x) -> NamedSharding:
        """A per-row array [B, ...] split by rows over dp (where B divides); a scalar replicated."""
        dp = self.view.shape["dp"]
        return NamedSharding(self.view, PartitionSpec("dp") if np.ndim(x) and np.shape(x)[0] % dp == 0 else
                             PartitionSpec())

    def constrain_rows(self, tree):
        """Pin a pytree of per-row arrays (a decode state's outputs, counters, keys) by rows inside jit."""
        return jax.lax.with_sharding_constraint(tree, jax.tree.map(self.row_sharding, tree))


def _split_tp(mesh, dp: int, kv: int, rep: int):
    """`mesh` (dp, tp) as (dp, tp_kv, tp_rep): the same devices in the same order (a Mesh or an AbstractMesh)."""
    shape, names = (dp, kv, rep), ("dp", *TP_SPLIT)
    types = (AxisType.Auto,) * 3
    if isinstance(mesh, AbstractMesh):
        return AbstractMesh(shape, names, axis_types=types)
    return Mesh(mesh.devices.reshape(shape), names, axis_types=types)


def on_one_device(*arrays) -> bool:
    """Whether none of `arrays` (traced, inside jit) is split over a mesh of several devices: a custom call may
    take them (the partitioner cannot split a custom call; it would gather whole operands onto every device).
    Inside a shard_map, the axes it made manual split nothing: each device holds its own block."""
    for x in arrays:
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if mesh is None or mesh.empty:
            continue
        if math.prod(n for n, t in zip(mesh.axis_sizes, mesh.axis_types, strict=True) if t != AxisType.Manual) > 1:
            return False
    return True


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
