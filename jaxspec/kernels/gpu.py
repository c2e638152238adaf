"""The GPU path of the seam's attention ops: attention that reads only the slots in use.

A serving cache is sized for the longest answer (32k slots is common) while most steps use a few hundred: the
reference forms (`xla.py`) compute scores and a softmax over the whole buffer, so at 500 of 32k slots an AR step
reads the KV buffer 64 times over and materialises [.., 32768] float32 scores per layer. Here the buffer is read
in blocks of at most BLOCK slots, and only the blocks up to the used extent are read (a scan over the blocks
whose steps past the extent are a `cond` that skips them), merging the blocks with an online softmax (running
maximum, sum and weighted values in float32, as flash-decoding does); this forward's own keys (the 1 + budget
tree nodes, or a prefill chunk) are one more block under their own mask. Every product is a plain batched
matmul that XLA sends to cuBLAS, and no tensor spans the buffer but the boolean mask.

Same arguments and results as the references; tested against them on CPU (tests/test_kernels_gpu.py) and selected
by the "gpu" backend (`jaxspec.kernels`), which `jaxspec.load` picks on a GPU. A row that sees no slot at all
(only padding rows) averages the values it visited instead of the reference's whole buffer: both are garbage
nobody reads.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxspec.kernels.xla import NEG_INF
from jaxspec.sharding import on_one_device
from pallas_kernels import hopper_or_no_gpu
from pallas_kernels.decode_attention import flash_decode, flash_decode_reference
from pallas_kernels.kv_commit import GPU_INTERPRET

BLOCK = 512  # slots per block: [G * N, 512] scores per KV head and row stay in the GPU's caches
SMS = 132  # an H100's streaming multiprocessors: flash decoding splits a row's blocks until CTAs fill them
# GPU programs read a ranged cache_attention's committed prefix with the Mosaic GPU kernel unless
# JAXSPEC_FLASH_DECODE=0: it has not run on a GPU yet, and this keeps a way around it should its compile fail on
# some card or JAX version (bench/gpu_check.py turns it off by itself when its own check of the kernel fails).
FLASH_DECODE = os.environ.get("JAXSPEC_FLASH_DECODE", "1") != "0"
# Tests: the kernel under JAX's interpreter on this CPU too (a CPU program otherwise runs the blocked loop below).
INTERPRET = False


def block_size(T: int) -> int:
    """The largest power of two <= BLOCK that divides the buffer's T slots (T itself if none from 16 does): a block
    never straddles the buffer's end, where dynamic_slice would clamp it and count slots twice."""
    return next((b for b in (512, 256, 128, 64, 32, 16) if b <= BLOCK and T % b == 0), T)


def _group(q, KVH):
    """q [B, N, H, D] -> [B, KVH, G * N, D] (row g * N + n: query head kvh * G + g, token n)."""
    B, N, H, D = q.shape
    return q.reshape(B, N, KVH, H // KVH, D).transpose(0, 2, 3, 1, 4).reshape(B, KVH, H // KVH * N, D)


def _ungroup(o, N, H):
    B, KVH, _, D = o.shape
    return o.reshape(B, KVH, H // KVH, N, D).transpose(0, 3, 1, 2, 4).reshape(B, N, H, D)


def _update(carry, s, v):
    """One block into the online softmax. carry: (max [B, K, R], sum [B, K, R], acc [B, K, R, Dv]) float32;
    s [B, K, R, S] float32 scores (masked ones NEG_INF); v [B, K, S, Dv]."""
    mx, tot, acc = carry
    new = jnp.maximum(mx, s.max(-1))
    p = jnp.exp(s - new[..., None])
    fix = jnp.exp(mx - new)
    acc = acc * fix[..., None] + jnp.einsum("bkrs,bksd->bkrd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return new, tot * fix + p.sum(-1), acc


def _start(B, K, R, Dv):
    return (jnp.full((B, K, R), NEG_INF, jnp.float32), jnp.zeros((B, K, R), jnp.float32),
            jnp.zeros((B, K, R, Dv), jnp.float32))


def _scores(qg, k, mask, G, scale, softcap):
    """qg [B, K, G * N, D] . k [B, K, S, D] -> [B, K, G * N, S] float32, where mask [B, N, S] (else NEG_INF)."""
    s = jnp.einsum("bkrd,bksd->bkrs", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    B, N, S = mask.shape
    m = jnp.broadcast_to(mask[:, None, None], (B, 1, G, N, S)).reshape(B, 1, G * N, S)
    return jnp.where(m, s, NEG_INF)


def _fold(carry, n_blocks, total: int, step):
    """carry through step(carry, i) for blocks i < n_blocks (traced) of `total`: a scan over every block whose
    steps past n_blocks are a `cond` that reads nothing. A loop with a traced bound would do the same on a GPU
    but cannot be differentiated, and the drafter trains through `attention`."""
    def body(carry, i):
        return lax.cond(i < n_blocks, step, lambda c, _: c, carry, i), None

    return lax.scan(body, carry, jnp.arange(total))[0]


def _blocks(carry, n_blocks, bs, qg, k, v, mask, G, scale, softcap, valid=None):
    """Fold blocks 0 .. n_blocks - 1 (traced) of k, v [B, K, T, D] (mask [B, N, T]; valid(slots) [B, 1, S] further
    limits which slots count) into the online softmax."""
    def step(carry, i):
        at = i * bs
        kb = lax.dynamic_slice_in_dim(k, at, bs, axis=2)
        vb = lax.dynamic_slice_in_dim(v, at, bs, axis=2)
        mb = lax.dynamic_slice_in_dim(mask, at, bs, axis=2)
        if valid is not None:
            mb = mb & valid(at + jnp.arange(bs))
        return _update(carry, _scores(qg, kb, mb, G, scale, softcap), vb)

    return _fold(carry, n_blocks, k.shape[2] // bs, step)


def flash_fits(q, k, v) -> bool:
    """Whether the Mosaic GPU kernel takes this committed prefix: bf16 / f16 throughout, head dims multiples of 64
    up to 256, a buffer of whole 64-slot blocks, on one device or split the way `shard_specs` runs it per device,
    and a Hopper GPU if this process has a GPU."""
    D, T = k.shape[-1], k.shape[2]
    return (hopper_or_no_gpu() and q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == v.dtype == q.dtype
            and D % 64 == 0 and D <= 256 and T % 64 == 0 and (on_one_device(q, k, v) or shard_specs(q, k) is not None))


def shard_specs(q, k):
    """On a mesh, how the kernel's operands lie so that it runs on each device's own shards inside a shard_map (a
    custom call cannot be split by the partitioner, which would gather the whole cache onto every device): (mesh,
    specs of the grouped queries [B, K, G * N, D], of k and v [B, K, T, D] and of the per-row lo and hi [B]), or
    None where the query heads do not split along the cache's KV heads (K/V replicated over tp: 3 KV heads on 8).

    The specs are the cache's own (`jaxspec.sharding`): rows over dp, KV heads over tp, or over tp_kv where KV heads
    are fewer than tp, each device's query heads of a KV head then over tp_rep (grouped row g * N + n splits by g).
    Nothing moves but the queries' few rows, and only if the partitioner had them otherwise."""
    mesh = jax.typeof(k).sharding.mesh
    B, _, H, _ = q.shape
    K = k.shape[1]
    sizes = dict(mesh.shape)
    rows = "dp" if B % sizes.get("dp", 1) == 0 else None
    if "tp_kv" in sizes:
        if K % sizes["tp_kv"] or (H // K) % sizes["tp_rep"]:  # a layer with fewer KV heads than the layout's
            return None
        heads, group = "tp_kv", "tp_rep"
    elif K % sizes.get("tp", 1):
        return None
    else:
        heads, group = ("tp" if "tp" in sizes else None), None
    return mesh, P(rows, heads, group, None), P(rows, heads, None, None), P(rows)


def _flash_prefix(q, qg, k, v, lo, hi, scale, softcap, interpret):
    """The committed prefix [lo[b], hi[b]) through the kernel, as an online-softmax carry: its log-sum-exp is the
    running maximum and its normalised output the values, whose sum is then 1 (an empty row: lse EMPTY_LSE =
    NEG_INF and output 0, which the next block's larger maximum scales away).

    On a mesh, each device's shards (`shard_specs`). Under the interpreter (tests on CPU devices) each device runs
    the kernel's reference instead: the interpreter simulates one GPU memory for every device, and XLA:CPU runs
    the devices at once, so it cannot interpret the kernel on several."""
    if on_one_device(qg, k, v):
        return _flash_local(qg, k, v, lo, hi, scale, softcap, interpret)
    mesh, q_spec, kv_spec, row_spec = shard_specs(q, k)
    local = (functools.partial(_flash_local, scale=scale, softcap=softcap, interpret=None) if interpret is None else
             functools.partial(_reference_local, scale=scale, softcap=softcap))
    lse_spec = P(*q_spec[:3])
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, row_spec, row_spec),
                         out_specs=(lse_spec, lse_spec, q_spec), check_vma=False)(qg, k, v, lo, hi)


def _flash_local(qg, k, v, lo, hi, scale, softcap, interpret):
    """`flash_decode` of one device's qg [B, K, R, D] over its k, v [B, K, T, D] -> (lse, 1, o)."""
    B, K, R, D = qg.shape
    T = k.shape[2]
    bk = 128 if D <= 128 and T % 128 == 0 else 64  # the SMEM budget: D = 256 fits 64-slot blocks only
    tiles = -(-R // 64)
    splits = max(1, min(SMS // (B * K * tiles), T // bk, 16))  # flash decoding: fill the SMs with one row's blocks
    o, lse = flash_decode(qg, k, v, lo, hi, scale=scale, softcap=softcap, block_kv=bk, num_splits=splits,
                          interpret=interpret)
    return lse, jnp.ones_like(lse), o


def _reference_local(qg, k, v, lo, hi, scale, softcap):
    o, lse = flash_decode_reference(qg, k, v, lo, hi, scale=scale, softcap=softcap)
    return lse, jnp.ones_like(lse), o


def cache_attention(q, k_old, v_old, k_new, v_new, length, mask, scale: float, softcap: float | None = None,
                    ranged: bool = False):
    """xla.cache_attention reading only row b's committed slots < length[b] (blocks up to the batch's longest) and
    this forward's keys: q [B, N, H, D]; k_old, v_old [B, KVH, T, D]; k_new, v_new [B, N, KVH, D]; mask [B, N, M]
    over the written cache (M = T, or T + N for a ring; new key i at column clip(length[b], 0, M - N) + i) ->
    [B, N, H, D].

    ranged: the caller promises that every query sees the same committed slots, one range per row from the first
    set column to length[b] (a layer without a sliding window). A GPU program then reads them with the Mosaic GPU
    flash-decoding kernel (`pallas_kernels.decode_attention`, where `flash_fits`), each row's own slots only, and
    merges this forward's keys into its (output, log-sum-exp) as one more block."""
    B, N, H, D = q.shape
    KVH, T = k_old.shape[1], k_old.shape[2]
    G = H // KVH
    length = jnp.broadcast_to(jnp.asarray(length, jnp.int32), (B,))
    qg = _group(q, KVH)
    bs = block_size(T)
    used = jnp.clip(length, 0, T)

    def blocked(qg, k_old, v_old, lo, used):
        return _blocks(_start(B, KVH, G * N, D), (used.max() + bs - 1) // bs, bs, qg, k_old, v_old, mask, G, scale,
                       softcap, valid=lambda slots: (slots[None, :] < used[:, None])[:, None, :])

    if ranged and FLASH_DECODE and flash_fits(q, k_old, v_old):
        seen = mask[:, 0, :T] & (jnp.arange(T)[None, :] < used[:, None])  # [B, T]: row b's committed range
        lo = jnp.where(seen.any(1), jnp.argmax(seen, axis=1), used).astype(jnp.int32)
        kernel = lambda *a: _flash_prefix(q, *a, scale, softcap, None)  # noqa: E731
        here = (lambda *a: _flash_prefix(q, *a, scale, softcap, GPU_INTERPRET)) if INTERPRET else blocked
        carry = lax.platform_dependent(qg, k_old, v_old, lo, used, cuda=kernel, default=here)
    else:
        carry = blocked(qg, k_old, v_old, None, used)
    s0 = jnp.clip(length, 0, mask.shape[-1] - N)
    own = jnp.take_along_axis(mask, jnp.broadcast_to((s0[:, None] + jnp.arange(N))[:, None, :], (B, N, N)), axis=2)
    kn, vn = k_new.transpose(0, 2, 1, 3).astype(k_old.dtype), v_new.transpose(0, 2, 1, 3).astype(v_old.dtype)
    _, tot, acc = _update(carry, _scores(qg, kn, own, G, scale, softcap), vn)
    return _ungroup(acc / tot[..., None], N, H).astype(q.dtype)


def extent(mask) -> jax.Array:
    """The slots any query sees: one past the last column of mask [B, N, T] that any row has set (0 if none)."""
    seen = mask.any(axis=(0, 1))  # [T]
    T = seen.shape[0]
    return jnp.where(seen.any(), T - jnp.argmax(seen[::-1]), 0).astype(jnp.int32)


def attention(q, k, v, mask, scale: float, softcap: float | None = None):
    """xla.attention over the slots up to the mask's extent only: q [B, N, H, D]; k, v [B, KVH, T, D] (written
    already: a KV-shared layer reads its source layer's buffer); mask [B, N, T] -> [B, N, H, D]."""
    B, N, H, D = q.shape
    KVH, T = k.shape[1], k.shape[2]
    bs = block_size(T)
    _, tot, acc = _blocks(_start(B, KVH, H // KVH * N, D), (extent(mask) + bs - 1) // bs, bs, _group(q, KVH), k, v,
                          mask, H // KVH, scale, softcap)
    return _ungroup(acc / tot[..., None], N, H).astype(q.dtype)


def latent_attention(q, latent, mask, scale: float, value_dim: int):
    """xla.latent_attention over the slots up to the mask's extent only: q [B, N, H, C]; latent [B, T, C] (one key
    [c_kv | k_pe] and one value c_kv = latent[..., :value_dim] shared by every head); mask [B, N, T] ->
    [B, H, N, value_dim] in q's dtype."""
    B, N, H, C = q.shape
    T = latent.shape[1]
    bs = block_size(T)
    qh = q.transpose(0, 2, 1, 3).reshape(B, 1, H * N, C)  # every head is one query group of the one shared key
    kv = latent[:, None]  # [B, 1, T, C]
    mx, tot, acc = _start(B, 1, H * N, value_dim)

    def step(carry, i):
        at = i * bs
        kb = lax.dynamic_slice_in_dim(kv, at, bs, axis=2)
        mb = lax.dynamic_slice_in_dim(mask, at, bs, axis=2)
        return _update(carry, _scores(qh, kb, mb, H, scale, None), kb[..., :value_dim])

    _, tot, acc = _fold((mx, tot, acc), (extent(mask) + bs - 1) // bs, T // bs, step)
    return (acc / tot[..., None]).reshape(B, H, N, value_dim).astype(q.dtype)
