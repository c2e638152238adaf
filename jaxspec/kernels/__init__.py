"""The kernel seam: the few ops model code calls, and the one place that picks who runs them.

Model code never asks which machine it is on. It calls

    dense(x, w)              a float product, w [in, out] (or a tied embedding [out, in], `transposed`)
    dense_many(x, ws)        several products over one input (a layer's q, k, v; gate and up)
    packed_matmul(x, ...)    a product over packed int8 / int4 codes (`jaxspec.models.quant`)
    attention(q, k, v, ...)  attention over a whole KV buffer with a mask (prefill, shared-KV layers)
    cache_attention(q, ...)  the attention of this forward's tokens over a KV cache and themselves
    latent_attention(q, ...) MLA's absorbed attention over a latent cache (one shared key and value)
    expanded_latent_attention(q, ...)  MLA's expanded form: per-head keys and values up-projected per slot
    ragged_dot(x, w, sizes)  a grouped product: the rows of each group times its own matrix (MoE experts)
    argmax(logits)           the greedy token

each defined by its pure-JAX reference in `xla.py`. A backend implements some of them and leaves the rest
to the reference:

    "xla"  the references themselves: any platform, a sharded model on a CPU, a lowering for another platform.
    "cpu"  native kernels for XLA:CPU through the FFI (`cpu.py`, `cpu_matmul.cc`); a product that it cannot
           take (too many rows, another dtype) runs the reference.
    "gpu"  attention that reads only the cache slots in use (`gpu.py`: blocked loops with an online softmax, and
           Mosaic GPU kernels for a committed prefix and for grouped products in a `cuda` program); the rest as
           the references. Its CPU side is pure JAX, so it runs (and is tested) on a CPU too.

The choice is made once per handle (`resolve`, at `jaxspec.load`: "auto" picks "cpu" on one CPU device where
the kernels build, "gpu" on a GPU, "xla" anywhere else or when asked) and the engine traces each program under
it (`use`).
Code traced outside any `use` gets the process's automatic choice (`default`). A backend may also keep
weights in a layout of its own (`prepare`: the CPU backend's column tiles); the parameter tree keeps its
paths and axes, and `plain` gives back the plain arrays that sharding, quantising, saving and training use.

Lowering for another platform from this host (`jax.export(..., platforms=("cuda",))`) stays correct under
any choice: the CPU backend's custom calls sit behind `lax.platform_dependent`, whose other branch is the GPU
path's form of the op, so a GPU program exported from a CPU host is the one the GPU backend runs.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

from jaxspec.kernels import cpu, gpu, xla

KERNELS = ("auto", "xla", "gpu")  # what a user may ask for
BACKENDS = ("xla", "cpu", "gpu")

_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxspec_kernels", default=None)


@functools.cache
def default() -> str:
    """The automatic choice for this process: "cpu" where the platform is a CPU and the kernels build here, "gpu"
    on a GPU."""
    platform = jax.default_backend()
    if platform == "gpu":
        return "gpu"
    return "cpu" if platform == "cpu" and cpu.level() > 0 else "xla"


def resolve(kernels: str = "auto", *, sharded: bool = False) -> str:
    """The backend for a handle: `kernels` ("auto", "xla" or "gpu") on this machine; a sharded model never gets
    the CPU backend (a custom call cannot be split by the partitioner)."""
    if kernels not in KERNELS:
        raise ValueError(f"unsupported kernels={kernels!r}; use 'auto' (the fastest this machine has), 'xla' "
                         "(the pure-JAX reference forms) or 'gpu' (the GPU path's forms, on any platform)")
    if kernels != "auto":
        return kernels
    choice = default()
    return "xla" if sharded and choice == "cpu" else choice


@contextlib.contextmanager
def use(backend: str):
    """Trace the ops inside this block on `backend` (one of BACKENDS)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; one of {BACKENDS}")
    token = _backend.set(backend)
    try:
        yield
    finally:
        _backend.reset(token)


def current() -> str:
    """The backend ops are traced on now."""
    return _backend.get() or default()


def prepare(state, backend: str):
    """A parameter state in `backend`'s weight layout (the CPU backend's column tiles; others: as it is)."""
    return cpu.to_layout(state) if backend == "cpu" else state


def plain(state):
    """Every backend layout in a parameter state back to plain arrays (the tree every backend shares)."""
    return cpu.from_layout(state)


# ------------------------------------------------------------------------------------------ the ops


def dense(x: jax.Array, w, *, transposed: bool = False, select: jax.Array | None = None, out_dtype=None):
    """x [..., K] @ w -> [..., N] (see xla.dense); w an array or a backend layout of one (`prepare`)."""
    if isinstance(w, cpu.Tiles):
        if select is None:
            return cpu.dense_tiled(x, w.tiles, w.n)
        return cpu.dense(x, w.columns(select), nk=True)
    if current() != "cpu":
        return xla.dense(x, w, transposed=transposed, select=select, out_dtype=out_dtype)
    if select is not None and not transposed:  # an untied head's columns: the kernel takes [K, M]
        w, select = jnp.take(w, select, axis=1), None
    return cpu.dense(x, w, nk=transposed, rows=select, preferred_element_type=out_dtype)


def dense_many(x: jax.Array, ws: list) -> list[jax.Array]:
    """[dense(x, w) for w in ws]: weights that share one input, in one call where the backend has one."""
    if all(isinstance(w, cpu.Tiles) for w in ws):
        return cpu.dense_many_tiled(x, [w.tiles for w in ws], [w.n for w in ws])
    if any(isinstance(w, cpu.Tiles) for w in ws) or current() != "cpu":
        return [dense(x, w) for w in ws]
    return cpu.dense_many(x, ws)


def packed_matmul(x: jax.Array, codes, scale, offset=None) -> jax.Array:
    """x [..., in] @ W.T -> [..., out] for a packed W [out, in] (see xla.packed_matmul)."""
    if current() != "cpu" or not cpu.packed_fits(x, codes, scale, offset):
        return xla.packed_matmul(x, codes, scale, offset)
    rows = x.reshape(-1, x.shape[-1])
    y = cpu.on_cpu(cpu.packed_matmul, xla.packed_matmul, rows, codes, scale, offset)
    return y.reshape(*x.shape[:-1], codes.shape[0])


def _backend_op(ref, fast, on_cpu, *args):
    """An op on the current backend: the reference ("xla"), the GPU path ("gpu"), or on "cpu" what
    runs on a CPU (`on_cpu`) with the GPU path for any other platform a program is lowered for."""
    backend = current()
    if backend == "xla":
        return ref(*args)
    if backend == "gpu":
        return fast(*args)
    return jax.lax.platform_dependent(*args, cpu=on_cpu, default=fast)


def attention(q, k, v, mask, scale: float, softcap: float | None = None):
    """q [B, N, H, D] over k, v [B, KVH, T, D] where mask [B, N, T] -> [B, N, H, D] (see xla.attention)."""
    ref = functools.partial(xla.attention, scale=scale, softcap=softcap)
    return _backend_op(ref, functools.partial(gpu.attention, scale=scale, softcap=softcap), ref, q, k, v, mask)


def latent_attention(q, latent, mask, scale: float, value_dim: int, length=None):
    """q [B, N, H, C] over a latent cache [B, T, C] -> [B, H, N, value_dim] (see xla.latent_attention). length:
    each row's committed length, where every query sees the same committed slots and this forward's latents sit at
    length[b] .., which the GPU path's flash-decoding kernel reads alone (gpu.latent_attention)."""
    ref = functools.partial(xla.latent_attention, scale=scale, value_dim=value_dim)
    fast = functools.partial(gpu.latent_attention, scale=scale, value_dim=value_dim, length=length)
    return _backend_op(ref, fast, ref, q, latent, mask)


def expanded_latent_attention(q, latent, mask, w_kvb, scale: float, nope_dim: int):
    """q [B, N, H, dn + dr] over a latent cache [B, T, r + dr] expanded through w_kvb [r, H * (dn + dv)] ->
    [B, N, H, dv] (see xla.expanded_latent_attention)."""
    ref = functools.partial(xla.expanded_latent_attention, scale=scale, nope_dim=nope_dim)
    fast = functools.partial(gpu.expanded_latent_attention, scale=scale, nope_dim=nope_dim)
    return _backend_op(ref, fast, ref, q, latent, mask, w_kvb)


def cache_attention(q, k_old, v_old, k_new, v_new, length, mask, scale: float, softcap: float | None = None,
                    ranged: bool = False):
    """q [B, N, H, D] over a KV cache's committed slots and this forward's keys -> [B, N, H, D] (see
    xla.cache_attention). ranged: every query sees the same committed slots, one range per row (no sliding
    window), which the GPU path's flash-decoding kernel reads alone (gpu.cache_attention)."""
    ref = functools.partial(xla.cache_attention, scale=scale, softcap=softcap)
    fast = functools.partial(gpu.cache_attention, scale=scale, softcap=softcap, ranged=ranged)

    def on_cpu(*args):
        return cpu.cache_attention(*args, scale, softcap, ref)

    return _backend_op(ref, fast, on_cpu, q, k_old, v_old, k_new, v_new, length, mask)


def ragged_dot(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """x [M, K] with rows in G contiguous groups of sizes [G], group g times w[g] [K, N] -> [M, N] in x's dtype
    (lax.ragged_dot; rows past the groups' sum: unspecified). The GPU path runs a Mosaic GPU grouped matmul."""
    return _backend_op(jax.lax.ragged_dot, gpu.ragged_dot, jax.lax.ragged_dot, x, w, sizes)


def argmax(logits: jax.Array) -> jax.Array:
    """Row-wise argmax -> int32 [...] (the first maximum; the first NaN if any)."""
    return cpu.argmax(logits, xla.argmax) if current() == "cpu" else xla.argmax(logits)
