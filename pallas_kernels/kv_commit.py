"""Commit an accepted tree path into a KV cache: in-place row compaction.

Tree verification writes the K (or V) of all N = 1 + budget tree nodes of batch row b at cache slots
`start[b] .. start[b]+N-1`. After the acceptance walk only the nodes on the row's accepted path survive
(`path: [B, P]`, P = max depth + 1, which may be smaller than N for wide trees), and they must sit
contiguously at `start[b] .. start[b]+n[b]-1` so the cache again holds one linear sequence per row:

    for i in range(n[b]): cache[b, :, start[b] + i] = cache[b, :, start[b] + path[b, i]]

Each row's path is strictly increasing with path[b, 0] == 0, so path[b, i] >= i: token i only ever reads a
slot that no earlier token has written, and the loop is safe in place in increasing i. Slots < start[b] are
never touched; slots >= start[b]+n[b] are scratch afterwards (the next forward overwrites them). Callers must
keep start[b] + max(N, P) <= T (`dynamic_update_slice` would otherwise clamp the write). A path [P] and
scalar start, n apply to every row.

What runs where:
  * `kv_commit_reference` (impl="xla"): gather the P accepted rows, write them back at start. Plain
    XLA, runs on every backend; with a donated cache the update is in place.
  * `kv_commit_pallas`: a TPU (Mosaic) kernel. path/start/n are scalar-prefetched into SMEM, the
    cache stays in HBM (`pl.ANY`), aliased input -> output, and each grid step (b, i < n[b]) issues one
    HBM -> HBM DMA of a [1, H, 1, D] row, skipping rows already in place (path[b, i] == i). Only slots
    start[b] .. start[b]+n[b]-1 are written, and nothing passes through VMEM (no VMEM block-shape rules).
    Tested only on CPU: under `interpret=True` and the TPU simulator `pltpu.InterpretParams()`, and
    lowered to Mosaic for platform "tpu" via `jax.export`; never compiled or run on a real TPU (a
    single-row DMA of a packed dtype such as bf16 is the first thing to check there).
  * `kv_commit_mosaic_gpu`: the GPU kernel (Mosaic GPU, `pl.core_map` over GMEM refs inside
    `pl.run_state`, so the cache operand is aliased to the output: in place). One CTA per (batch, head)
    row; it TMA-copies the P candidate rows start+path[i] into shared memory, waits on one barrier, then
    TMA-copies rows i < n back to start+i: every read lands before any write, so no ordering between
    copies is needed. A row is viewed as [W/c, c] with c <= 256 (a TMA box dimension's limit) and must be
    a multiple of 128 bytes (a warpgroup's copy granule): head_dim 64/128 and the MLA latent 576 in bf16
    or f32 are. Checked on CPU two ways (tests/test_kv_commit.py): run under JAX's Mosaic GPU interpreter
    (`GPU_INTERPRET`: simulated GMEM/SMEM, TMA copies and barriers; plain `interpret=True` has no rule
    for TMA copies) against the reference, and lowered by `jax.export(..., platforms=("cuda",))` to one
    `mosaic_gpu` custom call with the cache aliased to the output. The interpreter checks the indexing and
    the data moved (SMEM starts as NaN); it completes each TMA copy at once, so it would not notice a
    missing `barrier_wait` (tried: a write-back before the wait passes). Never run on a real GPU here.
  * `kv_commit(impl="pallas")`: the TPU kernel in interpret mode on CPU, compiled on TPU, and the Mosaic
    GPU kernel on GPU (`effective_impl` says which runs).

`latent_commit` applies the same commit to an MLA latent cache [B, T, C] (no head axis).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import MOSAIC_GPU_PARAMS, hopper_or_no_gpu

try:  # JAX's Mosaic GPU interpreter (private in 0.10; the tests skip without it)
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    GPU_INTERPRET = InterpretGPUParams(uninitialized_memory="nan")
except ImportError:
    GPU_INTERPRET = None


def per_row(B: int, path, start, n):
    """path [P] or [B, P], start and n [] or [B] -> path [B, P], start [B], n [B] (int32)."""
    path = jnp.asarray(path, jnp.int32)
    return (jnp.broadcast_to(path, (B, path.shape[-1])), jnp.broadcast_to(jnp.asarray(start, jnp.int32), (B,)),
            jnp.broadcast_to(jnp.asarray(n, jnp.int32), (B,)))


def kv_commit_reference(cache, path, start, n):
    """Pure-JAX commit. cache: [B, H, T, D]; path: [B, P] int32; start, n: [B] int32 (may be traced; the
    scalar forms apply to every row)."""
    path, start, n = per_row(cache.shape[0], path, start, n)

    def one(c, p, s, m):  # c [H, T, D]
        i = jnp.arange(p.shape[0], dtype=jnp.int32)
        src = jnp.where(i < m, p, i)  # tokens past n keep themselves
        rows = jnp.take(c, s + src, axis=1)  # [H, P, D]; path may point past P (wide trees)
        return lax.dynamic_update_slice_in_dim(c, rows, s, axis=1)

    return jax.vmap(one)(cache, path, start, n)


def _commit_kernel(path_ref, sn_ref, cache_in_ref, cache_ref, sem):
    """Grid step (b, i): copy row b's slot start+path[b, i] -> start+i with one DMA (HBM -> HBM).

    cache_in_ref aliases cache_ref (one HBM buffer); every copy goes through cache_ref, the buffer
    being updated. Steps run in order ("arbitrary") and each DMA completes before the next starts:
    token j may read slot path[b, j] == k that a later token k > j overwrites.
    """
    del cache_in_ref
    b, i = pl.program_id(0), pl.program_id(1)
    P = pl.num_programs(1)
    start, n = sn_ref[2 * b], sn_ref[2 * b + 1]
    src = path_ref[b * P + i]

    @pl.when((i < n) & (src != i))
    def _():
        row = cache_ref.at[pl.ds(b, 1)]
        copy = pltpu.make_async_copy(row.at[:, :, pl.ds(start + src, 1), :], row.at[:, :, pl.ds(start + i, 1), :], sem)
        copy.start()
        copy.wait()


@functools.partial(jax.jit, static_argnames="interpret")
def kv_commit_pallas(cache, path, start, n, *, interpret=False):
    """Pallas commit, same contract as `kv_commit_reference`; in place when `cache` is donated.

    interpret: False (compile for TPU), True (generic interpreter), or `pltpu.InterpretParams()`.
    """
    B = cache.shape[0]
    path, start, n = per_row(B, path, start, n)
    sn = jnp.stack([start, n], axis=1).reshape(2 * B)  # [2B]: SMEM arrays stay one-dimensional
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        _commit_kernel,
        out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, path.shape[1]),
            in_specs=[hbm],
            out_specs=hbm,
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        input_output_aliases={2: 0},  # operands are (path, sn, cache)
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret,
    )(path.reshape(-1), sn, cache)


def gpu_fits(cache) -> bool:
    """Whether the Mosaic GPU kernel copies this cache's rows: a multiple of 128 bytes (a warpgroup's copy
    granule; head_dim 64 and up in bf16 is)."""
    return cache.shape[-1] * cache.dtype.itemsize % 128 == 0


def _tma_chunk(width: int) -> int:
    """The TMA box's last dimension for a row of `width` values: the largest divisor <= 256."""
    return max(d for d in range(1, 257) if width % d == 0)


@functools.partial(jax.jit, static_argnames="interpret")
def kv_commit_mosaic_gpu(cache, path, start, n, *, interpret=False):
    """Mosaic GPU commit, same contract as `kv_commit_reference`; in place (the cache is aliased to the output).

    interpret: False (compile for GPU) or `GPU_INTERPRET` (JAX's Mosaic GPU interpreter, on CPU)."""
    B, H, T, D = cache.shape
    path, start, n = per_row(B, path, start, n)
    P = path.shape[1]
    if not gpu_fits(cache):
        raise ValueError(f"the Mosaic GPU KV commit needs rows of a multiple of 128 bytes, got {D} x "
                         f"{cache.dtype.itemsize} B; use impl='xla'")
    c = _tma_chunk(D)
    rows = cache.reshape(B * H, T, D // c, c)  # [R, T, D/c, c]: one TMA box per token row
    sn = jnp.stack([start, n], axis=1)  # [B, 2]

    def stateful(refs):
        cache_ref, path_ref, sn_ref = refs

        @pl.core_map(plgpu.Mesh(grid=(B * H,), grid_names=("row",)), compiler_params=MOSAIC_GPU_PARAMS,
                     interpret=interpret)
        def _():
            r = lax.axis_index("row")
            b = r // H

            def scoped(stage, barrier):  # stage: SMEM [P, D/c, c]
                s0, m = sn_ref[b, 0], sn_ref[b, 1]
                for i in range(P):  # gather every candidate row before any write
                    plgpu.copy_gmem_to_smem(cache_ref.at[r, s0 + path_ref[b, i]], stage.at[i], barrier)
                plgpu.barrier_wait(barrier)
                for i in range(P):
                    @pl.when(i < m)
                    def _():
                        plgpu.copy_smem_to_gmem(stage.at[i], cache_ref.at[r, s0 + i])
                plgpu.wait_smem_to_gmem(0)

            pl.run_scoped(scoped, plgpu.SMEM((P, D // c, c), cache.dtype), plgpu.Barrier(num_arrivals=P))

    out, _, _ = pl.run_state(stateful)((rows, path, sn))
    return out.reshape(B, H, T, D)


IMPLS = ("xla", "pallas")


def effective_impl(impl: str) -> str:
    """What `kv_commit(impl=impl)` runs on the default backend, in words (generation stats report it)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown kv_commit impl {impl!r}; use one of: {', '.join(IMPLS)}")
    backend = jax.default_backend()
    if impl == "xla":
        return "xla"
    if backend == "gpu":
        if not hopper_or_no_gpu():
            return "xla (the Mosaic GPU commit needs a Hopper GPU)"
        return "pallas (Mosaic GPU; xla for cache rows not a multiple of 128 bytes)"
    return "pallas (interpret)" if backend == "cpu" else "pallas"


def kv_commit(cache, path, start, n, *, impl="xla", interpret=None):
    """Engine entry point. cache: [B, H, T, D]; impl: "xla" | "pallas".

    With impl="pallas", interpret=None interprets the TPU kernel on CPU, compiles it on TPU, and runs the
    Mosaic GPU kernel on a Hopper GPU where it copies the rows (see the module docstring; `effective_impl` says
    which runs).
    """
    what = effective_impl(impl)
    if what.startswith("xla") or (what.startswith("pallas (Mosaic GPU") and not gpu_fits(cache)):
        return kv_commit_reference(cache, path, start, n)
    if what.startswith("pallas (Mosaic GPU"):
        return kv_commit_mosaic_gpu(cache, path, start, n)
    if interpret is None:
        interpret = what == "pallas (interpret)"
    return kv_commit_pallas(cache, path, start, n, interpret=interpret)


def latent_commit(cache, path, start, n, *, impl="xla", interpret=None):
    """`kv_commit` for an MLA latent cache [B, T, C]: viewed as one head, [B, 1, T, C]."""
    B, T, C = cache.shape
    out = kv_commit(cache.reshape(B, 1, T, C), path, start, n, impl=impl, interpret=interpret)
    return out.reshape(B, T, C)
