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
import math
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

try:  # JAX's grouped matmul for Hopper (Mosaic GPU); absent from a JAX that no longer ships it
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
except ImportError:  # pragma: no cover
    ragged_dot_mgpu = None

BLOCK = 512  # slots per block: [G * N, 512] scores per KV head and row stay in the GPU's caches
SMS = 132  # an H100's streaming multiprocessors: flash decoding splits a row's blocks until CTAs fill them
# GPU programs read a ranged cache_attention's committed prefix with the Mosaic GPU kernel unless
# JAXSPEC_FLASH_DECODE=0: it has not run on a GPU yet, and this keeps a way around it should its compile fail on
# some card or JAX version (bench/gpu_check.py turns it off by itself when its own check of the kernel fails).
FLASH_DECODE = os.environ.get("JAXSPEC_FLASH_DECODE", "1") != "0"
# GPU programs run MoE's grouped products with JAX's Hopper grouped matmul unless JAXSPEC_GROUPED_MATMUL=0 (the
# same way around a kernel that has not run on a GPU here; bench/gpu_check.py turns it off should its check fail).
GROUPED_MATMUL = os.environ.get("JAXSPEC_GROUPED_MATMUL", "1") != "0"
# Tests: the kernels under JAX's interpreter on this CPU too (a CPU program otherwise runs the XLA forms below).
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


def _blocks(carry, n_blocks, bs, qg, k, v, mask, G, scale, softcap, valid=None, value_dim=None):
    """Fold blocks 0 .. n_blocks - 1 (traced) of k, v [B, K, T, D] (mask [B, N, T]; valid(slots) [B, 1, S] further
    limits which slots count) into the online softmax. v None: the values are k's first value_dim columns (MLA's
    latents), cut from each block as it is read rather than from the whole buffer."""
    def step(carry, i):
        at = i * bs
        kb = lax.dynamic_slice_in_dim(k, at, bs, axis=2)
        vb = kb[..., :value_dim] if v is None else lax.dynamic_slice_in_dim(v, at, bs, axis=2)
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


def _flash_prefix(qg, k, v, lo, hi, specs, scale, softcap, interpret, value_dim=None):
    """The committed prefix [lo[b], hi[b]) through the kernel, as an online-softmax carry: its log-sum-exp is the
    running maximum and its normalised output the values, whose sum is then 1 (an empty row: lse EMPTY_LSE =
    NEG_INF and output 0, which the next block's larger maximum scales away). v None: the values are
    k[..., :value_dim] (MLA's latents).

    specs: None on one device, else (mesh, specs of qg, of k and v, of lo and hi) for a shard_map that runs the
    kernel on each device's shards (`shard_specs`, `latent_shard_specs`). Under the interpreter (tests on CPU
    devices) each device runs the kernel's reference instead: the interpreter simulates one GPU memory for every
    device, and XLA:CPU runs the devices at once, so it cannot interpret the kernel on several."""
    kw = dict(scale=scale, softcap=softcap, value_dim=value_dim)
    if specs is None:
        return _flash_local(qg, k, v, lo, hi, interpret=interpret, **kw)
    mesh, q_spec, kv_spec, row_spec = specs
    local = (functools.partial(_flash_local, interpret=None, **kw) if interpret is None else
             functools.partial(_reference_local, **kw))
    lse_spec = P(*q_spec[:3])
    if v is None:  # a shard_map takes no None operand
        local = functools.partial(lambda f, qg, k, lo, hi: f(qg, k, None, lo, hi), local)
        return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, row_spec, row_spec),
                             out_specs=(lse_spec, lse_spec, q_spec), check_vma=False)(qg, k, lo, hi)
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, row_spec, row_spec),
                         out_specs=(lse_spec, lse_spec, q_spec), check_vma=False)(qg, k, v, lo, hi)


def _flash_local(qg, k, v, lo, hi, scale, softcap, interpret, value_dim=None):
    """`flash_decode` of one device's qg [B, K, R, D] over its k, v [B, K, T, D] (v None: k[..., :value_dim])
    -> (lse, 1, o)."""
    B, K, R, D = qg.shape
    T = k.shape[2]
    Dv = value_dim or (D if v is None else v.shape[-1])
    bk = 128 if D <= 128 and T % 128 == 0 else 64  # the SMEM budget: D = 256 (and MLA's 576) fit 64-slot blocks only
    chunks = Dv // next(c for c in (256, 192, 128, 64) if Dv % c == 0) if v is None else 1  # flash_decode's rule
    ctas = B * K * -(-R // 64) * chunks  # (row, head, query tile, value chunk)
    splits = max(1, min(SMS // ctas, T // bk, 16))  # flash decoding: fill the SMs with one row's blocks
    o, lse = flash_decode(qg, k, v, lo, hi, scale=scale, softcap=softcap, block_kv=bk, num_splits=splits,
                          value_dim=value_dim, interpret=interpret)
    return lse, jnp.ones_like(lse), o


def _reference_local(qg, k, v, lo, hi, scale, softcap, value_dim=None):
    o, lse = flash_decode_reference(qg, k, v, lo, hi, scale=scale, softcap=softcap, value_dim=value_dim)
    return lse, jnp.ones_like(lse), o


def _committed_range(mask, used):
    """Row b's committed range [lo[b], used[b]) from mask [B, N, M]: query 0's first set column below used (every
    query of a ranged forward sees the same committed slots), used itself where it sees none."""
    T = mask.shape[-1]
    seen = mask[:, 0, :T] & (jnp.arange(T)[None, :] < used[:, None])  # [B, T]
    return jnp.where(seen.any(1), jnp.argmax(seen, axis=1), used).astype(jnp.int32)


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
        lo = _committed_range(mask[..., :T], used)
        specs = None if on_one_device(q, k_old, v_old) else shard_specs(q, k_old)
        kernel = lambda *a: _flash_prefix(*a, specs, scale, softcap, None)  # noqa: E731
        here = (lambda *a: _flash_prefix(*a, specs, scale, softcap, GPU_INTERPRET)) if INTERPRET else blocked
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


def latent_fits(q, latent, value_dim: int) -> bool:
    """Whether the flash-decoding kernel's v=None form takes MLA's latents: bf16 / f16 throughout, a latent width
    that is whole 64-column pieces up to 576 (DeepSeek-V3's; wider passes a CTA's shared memory), a buffer of whole
    64-slot blocks, on one device or split the way `latent_shard_specs` runs it, on Hopper or a host without a GPU."""
    C, T = latent.shape[-1], latent.shape[1]
    return (hopper_or_no_gpu() and q.dtype in (jnp.bfloat16, jnp.float16) and latent.dtype == q.dtype
            and C % 64 == 0 and C <= 576 and value_dim % 64 == 0 and T % 64 == 0
            and (on_one_device(q, latent) or latent_shard_specs(q, latent) is not None))


def latent_shard_specs(q, latent):
    """`shard_specs` for MLA's latents: (mesh, specs of the grouped queries [B, 1, H * N, C], of the latents
    [B, 1, T, C] and of lo and hi [B]): rows over dp, query heads over tp (row h * N + n splits by h), the latents
    (one shared key, replicated over tp) whole on every device of a row; None where tp does not divide the heads."""
    mesh = jax.typeof(latent).sharding.mesh
    B, _, H, _ = q.shape
    sizes = dict(mesh.shape)
    rows = "dp" if B % sizes.get("dp", 1) == 0 else None
    names = tuple(a for a in ("tp", "tp_kv", "tp_rep") if a in sizes)
    n = math.prod(sizes[a] for a in names)
    if H % n:
        return None
    heads = None if n == 1 else names[0] if len(names) == 1 else names
    return mesh, P(rows, None, heads, None), P(rows, None, None, None), P(rows)


def latent_attention(q, latent, mask, scale: float, value_dim: int, length=None):
    """xla.latent_attention over the slots up to the mask's extent only: q [B, N, H, C]; latent [B, T, C] (one key
    [c_kv | k_pe] and one value c_kv = latent[..., :value_dim] shared by every head); mask [B, N, T] ->
    [B, H, N, value_dim] in q's dtype.

    length [B]: each row's committed length, from a caller whose queries all see the same committed slots (MLA has
    no sliding window) and whose own N latents are written at slots length[b] ... A GPU program then reads the
    committed prefix with the flash-decoding kernel (`pallas_kernels.decode_attention`, its v=None form: no copy of
    the values) where `latent_fits`, and merges the N new latents into its log-sum-exp as one more block."""
    B, N, H, C = q.shape
    T = latent.shape[1]
    bs = block_size(T)
    qh = q.transpose(0, 2, 1, 3).reshape(B, 1, H * N, C)  # every head is one query group of the one shared key
    kv = latent[:, None]  # [B, 1, T, C]
    start = _start(B, 1, H * N, value_dim)
    if length is None or not (FLASH_DECODE and latent_fits(q, latent, value_dim)):
        _, tot, acc = _blocks(start, (extent(mask) + bs - 1) // bs, bs, qh, kv, None, mask, H, scale, None,
                              value_dim=value_dim)
        return (acc / tot[..., None]).reshape(B, H, N, value_dim).astype(q.dtype)
    length = jnp.broadcast_to(jnp.asarray(length, jnp.int32), (B,))
    used = jnp.clip(length, 0, T)
    lo = _committed_range(mask, used)
    specs = None if on_one_device(q, latent) else latent_shard_specs(q, latent)

    def blocked(qh, kv, lo, used):  # the committed slots only: the new latents are merged below
        return _blocks(start, (used.max() + bs - 1) // bs, bs, qh, kv, None, mask, H, scale, None,
                       valid=lambda slots: (slots[None, :] < used[:, None])[:, None, :], value_dim=value_dim)

    def kernel(qh, kv, lo, used, interpret=None):
        return _flash_prefix(qh, kv, None, lo, used, specs, scale, None, interpret, value_dim)

    here = functools.partial(kernel, interpret=GPU_INTERPRET) if INTERPRET else blocked
    carry = lax.platform_dependent(qh, kv, lo, used, cuda=kernel, default=here)
    # [B, N]: where LatentEntry.write put the new latents (its update clamps the start as here; the engine keeps
    # length + N within the buffer, so they never overwrite committed slots)
    slots = jnp.clip(length, 0, T - N)[:, None] + jnp.arange(N)
    new = jnp.take_along_axis(latent, slots[..., None], axis=1)[:, None]  # [B, 1, N, C]
    own = jnp.take_along_axis(mask, jnp.broadcast_to(slots[:, None, :], (B, N, N)), axis=2)
    _, tot, acc = _update(carry, _scores(qh, new, own, H, scale, None), new[..., :value_dim])
    return (acc / tot[..., None]).reshape(B, H, N, value_dim).astype(q.dtype)


def expanded_latent_attention(q, latent, mask, w_kvb, scale: float, nope_dim: int):
    """xla.expanded_latent_attention over the slots up to the mask's extent only, each block of latents expanded
    as it is read: q [B, N, H, dn + dr]; latent [B, T, r + dr]; mask [B, N, T]; w_kvb [r, H * (dn + dv)] ->
    [B, N, H, dv]. The reference expands every slot of the buffer and writes [B, H, N, T] float32 scores: a
    1024-token prefill chunk of DeepSeek-V3 over a 32k buffer is 17 GB of scores per layer. Here a prefill chunk
    expands the slots in use once and holds [B, H, N, BLOCK] scores."""
    B, N, H, _ = q.shape
    T, r = latent.shape[1], w_kvb.shape[0]
    dv = w_kvb.shape[1] // H - nope_dim
    bs = block_size(T)
    qh = q.transpose(0, 2, 1, 3)  # [B, H, N, dn + dr]: every head its own group of N queries

    def step(carry, i):
        lb = lax.dynamic_slice_in_dim(latent, i * bs, bs, axis=1)  # [B, S, r + dr]
        kv = (lb[..., :r] @ w_kvb).reshape(B, bs, H, nope_dim + dv).transpose(0, 2, 1, 3)  # [B, H, S, dn + dv]
        k_pe = jnp.broadcast_to(lb[:, None, :, r:], (B, H, bs, lb.shape[-1] - r))
        k = jnp.concatenate([kv[..., :nope_dim], k_pe], -1)
        mb = lax.dynamic_slice_in_dim(mask, i * bs, bs, axis=2)
        return _update(carry, _scores(qh, k, mb, 1, scale, None), kv[..., nope_dim:])

    _, tot, acc = _fold(_start(B, H, N, dv), (extent(mask) + bs - 1) // bs, T // bs, step)
    return (acc / tot[..., None]).transpose(0, 2, 1, 3).astype(q.dtype)


# ragged_dot_mgpu's tiles: 64 rows (one warpgroup's wgmma M), 128 outputs, 64 inputs, 4 steps in flight
RAGGED_TILES = dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)


def ragged_fits(x, w) -> bool:
    """Whether JAX's Hopper grouped matmul takes x [M, K] @ w [G, K, N]: bf16 / f16 alike, K and N whole tiles,
    on one device (a shard_map gives it each device's experts: models/moe.py), on Hopper or a host without a GPU."""
    t = RAGGED_TILES
    return (GROUPED_MATMUL and ragged_dot_mgpu is not None and hopper_or_no_gpu()
            and x.dtype in (jnp.bfloat16, jnp.float16)
            and w.dtype == x.dtype and x.shape[1] % t["block_k"] == 0 and w.shape[2] % t["block_n"] == 0
            and on_one_device(x, w))


def _ragged_kernel(x, w, sizes):
    """ragged_dot_mgpu over rows padded to whole 64-row tiles (TMA reads whole tiles; the interpreter refuses a
    read past the array). Every row past the groups' sum, padding included, joins the last group, so none is left
    unwritten; the padding is cut off again. lax.ragged_dot gives zeros for rows past the sum, this the last
    group's product: callers that have such rows mask them (models/moe.py)."""
    M = x.shape[0]
    pad = -M % RAGGED_TILES["block_m"]
    xp = jnp.pad(x, ((0, pad), (0, 0)))
    sizes = sizes.at[-1].add(pad + M - sizes.sum())
    return ragged_dot_mgpu.ragged_dot(xp, w, group_sizes=sizes, **RAGGED_TILES)[:M]


def ragged_dot(x, w, sizes):
    """lax.ragged_dot(x [M, K], w [G, K, N], sizes [G]) -> [M, N] in x's dtype, on a GPU through JAX's Hopper
    grouped matmul (`ragged_dot_mgpu`). XLA's GPU compiler rewrites a ragged_dot into a dense product over every
    group unless an experimental cuDNN path is switched on: for a 1024-token prefill chunk of DeepSeek-V3 that is
    256 experts' worth of work and temporaries where 8 are used. A CPU program keeps lax.ragged_dot; the tests
    run the kernel under JAX's interpreter (`INTERPRET` with `jaxspec.testing.interpreted_grouped_matmul`)."""
    if not ragged_fits(x, w):
        return lax.ragged_dot(x, w, sizes)
    return lax.platform_dependent(x, w, sizes, cuda=_ragged_kernel,
                                  default=_ragged_kernel if INTERPRET else lax.ragged_dot)
