"""Flash decoding over the committed slots of a KV cache: a Mosaic GPU (Hopper) kernel and its reference.

During speculative decoding each batch row b has its committed prefix in cache slots lo[b] <= j < hi[b] of a
buffer sized for the longest request (T slots), while the tree nodes being verified sit elsewhere. Attention of
the R query rows that share a KV head (GQA group x tree nodes) over that prefix is computed here as a pair
(o, lse): the normalised output and the log-sum-exp of the visible scores. The caller merges it exactly with
the attention over the tree block by log-sum-exp:

    lse = logaddexp(lse1, lse2);  o = exp(lse1 - lse) * o1 + exp(lse2 - lse) * o2

A row with no visible slot (hi <= lo) gets o = 0 and lse = EMPTY_LSE, a finite large negative number, so the
merge needs no special case and never produces NaN.

`flash_decode` is the kernel. One CTA (a single warpgroup) per (batch row, KV head, 64-query tile, split, value
chunk; one chunk unless v=None, below) loops over the KV blocks that overlap [lo, hi) only, a loop whose trip count
is read from lo/hi at run time: a 32k-slot buffer holding 500 tokens reads about 500 slots. With num_splits > 1 the
row's blocks are shared out among that many CTAs (flash decoding: B x K CTAs alone would leave most of a GPU's SMs
idle) and their partial (o, lse) are merged afterwards by `merge_partials`. K/V blocks arrive by TMA into a double
buffer (block j+1 is fetched while block j is used); q k^T and p v are two wgmma's from shared memory (p is staged
there in the input dtype) into f32 accumulators, with an online softmax in registers between them; partial edge
blocks are masked. Slots of an edge block outside [lo, hi) are read and must be finite (a stale or zeroed cache slot
is): a masked probability 0 times an infinite or NaN value would still be NaN. Not tuned: no warp specialisation,
each wgmma is awaited at once. p v accumulates into the running output (a 64 x 256 f32 accumulator takes 128
registers per thread; a second one beside it would pass the 255 a thread has).

With v=None the values are the first value_dim columns of k: MLA's absorbed attention (DeepSeek-V3, Kimi K2) is MQA
over one latent row per slot, [c_kv | k_pe] (D = 576), whose first 512 columns (c_kv) are also the value. The kernel
reads them from k's buffer (passing v = latent[..., :512] would make XLA copy the whole cache before the call). A
wgmma's N is at most 256 and a 64 x 512 f32 accumulator alone would take 256 registers per thread, so the value
columns are split into chunks of at most 256, one CTA each (grid axis "c"): every chunk's CTA computes the scores
over the whole key (redundantly, and in the same order, so the same lse) and p v for its own chunk. A K block lands
in SMEM as column pieces, each a whole ref: the value chunks, then the tail past them (MLA's 64 rope columns), with
q staged alike. q k^T is one wgmma per piece into one accumulator, the CTA's chunk is p v's B operand as it is, and
there is no V buffer: at D = 576 with 64-slot blocks the kernel lowers to 231,448 bytes of SMEM (q, two K blocks, p
and the lowering's 2 KiB reduction scratch) of the 232,448 a CTA may have.

`flash_decode_reference` is the same contract in plain jnp (float32 math over the whole buffer with a mask).

How it was checked, on CPU only (tests/test_decode_attention.py): under JAX's Mosaic GPU interpreter
(`GPU_INTERPRET`: simulated TMA copies, barriers, SMEM initialised to NaN, wgmma as a matmul) against the
reference (v=None with MLA's D = 576, value_dim = 512 included), and lowered with
`jax.export(..., platforms=("cuda",))` to one Mosaic GPU custom call. Three things differ under the interpreter,
because it has no rule for them: `plgpu.layout_cast` (a register layout hint for the GPU lowering only; skipped), a
transposed wgmma operand (`plgpu.transpose_ref` of each K piece; the interpreter stages k^T into more SMEM buffers
with a register transpose instead) and `pl.run_state` (p v into the running accumulator; the interpreter adds a
fresh one's result instead). So those forms of the real kernel are checked by the lowering only (shapes and
transforms, not values). The interpreter also completes each TMA copy at once, so it would not notice a missing
barrier wait (it does count arrivals: a barrier expecting fewer copies than arrive on it fails). Never run on a
real GPU here.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import MOSAIC_GPU_PARAMS

EMPTY_LSE = -1e30  # lse of a row with no visible slot: finite, so a log-sum-exp merge gives the other block
BLOCK_Q = 64  # query rows per CTA: one warpgroup's wgmma M
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def flash_decode_reference(q, k, v, lo, hi, *, scale, softcap=None, value_dim=None):
    """Attention of q over slots lo[b] <= j < hi[b] of k/v, float32 math. Same contract as `flash_decode`.

    q: [B, K, R, D]; k: [B, K, T, D]; v: [B, K, T, Dv], or None for v = k[..., :value_dim] (all of k when
    value_dim is None); lo, hi: [B] int. Returns o [B, K, R, Dv] f32 and lse [B, K, R] f32 (natural log); an empty
    range gives o = 0, lse = EMPTY_LSE.
    """
    T = k.shape[2]
    if v is None:
        v = k[..., :value_dim]
    s = jnp.einsum("bkrd,bktd->bkrt", q.astype(jnp.float32), k.astype(jnp.float32)) * scale  # [B, K, R, T]
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    t = jnp.arange(T)
    visible = (t >= jnp.asarray(lo)[:, None]) & (t < jnp.asarray(hi)[:, None])  # [B, T]
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # empty rows: every score is -inf
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1)  # [B, K, R]
    o = jnp.einsum("bkrt,bktd->bkrd", p, v.astype(jnp.float32)) / jnp.where(l > 0, l, 1.0)[..., None]
    lse = jnp.where(l > 0, m[..., 0] + jnp.log(jnp.where(l > 0, l, 1.0)), EMPTY_LSE)
    return o, lse


def merge_partials(o, lse):
    """Exact attention over the union of disjoint slot sets from the partial results over each set.

    o: [S, ..., Dv] f32, lse: [S, ...] f32 (S partials, e.g. the committed prefix and the tree block, or the
    splits of one range). Returns o [..., Dv], lse [...]; partials with lse = EMPTY_LSE weigh nothing, and a
    result with no visible slot at all keeps o = 0 and lse = EMPTY_LSE (in f32, EMPTY_LSE + log(S) rounds back
    to EMPTY_LSE).
    """
    m = lse.max(axis=0)  # [...]
    w = jnp.exp(lse - m)  # [S, ...]: 1 for the largest partial, so den >= 1
    den = w.sum(axis=0)
    return (w[..., None] * o).sum(axis=0) / den[..., None], m + jnp.log(den)


def _kernel(lohi_ref, q_ref, k_ref, *refs, block_kv, num_splits, chunk, scale, softcap, interpreted):
    """One CTA: batch row b, KV head h, query tile t, split s of the row's blocks, value chunk c. Refs are GMEM:
    lohi [B, 2] int32, q [B, K, Rp, D], k [B, K, T, D], then refs = (v [B, K, T, Dv], o, lse) with a separate v or
    (o, lse) when the values are k[..., :Dv]; o [S, B, K, Rp, Dv] f32, lse [S, B, K, Rp] f32. The CTA writes
    o[..., c*chunk : (c+1)*chunk] and, when c = 0, lse (every chunk's CTA computes the same scores)."""
    v_ref, o_ref, lse_ref = refs if len(refs) == 3 else (None, *refs)
    bk = block_kv
    D, Dv = k_ref.shape[-1], o_ref.shape[-1]
    dtype = q_ref.dtype
    b, h, t, sp, c = (lax.axis_index(name) for name in ("b", "h", "t", "s", "c"))
    lo, hi = lohi_ref[b, 0], lohi_ref[b, 1]
    first = lo // bk
    n = jnp.where(hi > lo, (hi + bk - 1) // bk - first, 0)  # blocks first .. first+n-1 overlap [lo, hi)
    per = (n + num_splits - 1) // num_splits
    first = first + sp * per  # this split's blocks: first .. last-1 (none when first >= last)
    last = jnp.minimum(first + per, lo // bk + n)
    rows = pl.ds(t * BLOCK_Q, BLOCK_Q)
    # The key columns sit in SMEM as pieces, each a whole ref (a wgmma operand): `pieces` of width `piece` (columns
    # i*piece .. i*piece+piece), then a tail of width `tail`; q is staged the same way, and q k^T is one wgmma per
    # piece into one accumulator (the contraction over D in the same order in every CTA). With a separate v the one
    # piece is the whole key; with the values in k the pieces are the value chunks, so this CTA's values are the
    # whole ref k_main.at[slot, c] (p v's B operand) and the tail holds the columns past them (MLA: 64 rope columns).
    shared = v_ref is None
    piece, pieces = (chunk, Dv // chunk) if shared else (D, 1)
    tail = D - pieces * piece
    widths = [piece] * pieces + ([tail] if tail else [])

    def cast(x, layout):
        """Pin a register layout for the GPU lowering (loop carries must match the body's layouts); the
        interpreter has no rule for layout_cast and needs none."""
        return x if interpreted else plgpu.layout_cast(x, layout)

    swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # wgmma operands: 128-byte swizzle

    def fetch(src, main, rest, barrier):
        """TMA copies of src's columns into the pieces main [pieces, *, piece] and rest [*, tail] (None without a
        tail), all arriving on barrier (one arrival each: `len(widths)` per phase). Returns the pieces' refs."""
        parts = [main.at[i] for i in range(pieces)] + ([rest] if tail else [])
        for part, start, width in zip(parts, range(0, D, piece), widths):
            plgpu.copy_gmem_to_smem(src.at[:, pl.ds(start, width)], part, barrier)
        return parts

    def with_q(q_main, q_tail, q_bar):
        q_parts = fetch(q_ref.at[b, h, rows], q_main, q_tail, q_bar.at[0])  # [64, piece] ... [64, tail]

        def loop(k_main, k_tail, v_smem, p_smem, k_bar, v_bar, kt_smem):
            # k_main [2, pieces, bk, piece], k_tail [2, bk, tail] or None, v_smem [2, bk, Dv] (None when shared),
            # p_smem [64, bk]; kt_smem: the interpreter's k^T of each piece, [width, bk], None on the GPU
            def fetch_block(j, slot):  # KV block j -> buffer slot
                blk = pl.ds(j * bk, bk)
                fetch(k_ref.at[b, h, blk], k_main.at[slot], k_tail.at[slot] if tail else None, k_bar.at[slot])
                if not shared:
                    plgpu.copy_gmem_to_smem(v_ref.at[b, h, blk], v_smem.at[slot], v_bar.at[slot])

            @pl.when(first < last)
            def _():
                fetch_block(first, 0)

            plgpu.barrier_wait(q_bar.at[0])  # after the first K/V block's copy is issued: the two loads overlap

            def step(j, carry):
                acc, m, l = carry  # [64, chunk] f32, [64] and [64] f32 (m in log2 units)
                slot = lax.rem(j - first, 2)

                @pl.when(j + 1 < last)
                def _():
                    fetch_block(j + 1, 1 - slot)  # its previous user, block j-1, is finished

                plgpu.barrier_wait(k_bar.at[slot])
                k_parts = [k_main.at[slot, i] for i in range(pieces)] + ([k_tail.at[slot]] if tail else [])
                if interpreted:
                    for part, kt in zip(k_parts, kt_smem):
                        kt[...] = part[...].T
                    plgpu.commit_smem()
                    kt_parts = kt_smem
                else:
                    kt_parts = [plgpu.transpose_ref(part, (1, 0)) for part in k_parts]  # [width, bk] each

                def qk(acc_ref):
                    for q_part, kt in zip(q_parts, kt_parts):
                        plgpu.wgmma(acc_ref, q_part, kt)
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, bk), jnp.float32))  # [64, bk]
                if softcap is None:
                    s = s * (scale * _LOG2E)
                else:
                    s = jnp.tanh(s * (scale / softcap)) * (softcap * _LOG2E)
                col = cast(lax.broadcasted_iota(jnp.int32, (BLOCK_Q, bk), 1), plgpu.Layout.WGMMA) + j * bk
                s = jnp.where((col >= lo) & (col < hi), s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                p_smem[...] = p.astype(dtype)
                plgpu.commit_smem()  # generic-proxy writes must be visible to the wgmma
                if shared:
                    values = k_main.at[slot, c]  # [bk, chunk]: this CTA's value columns, arrived with the key
                else:
                    plgpu.barrier_wait(v_bar.at[slot])
                    values = v_smem.at[slot]  # [bk, Dv]

                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                if interpreted:  # the interpreter has no rule for run_state: a fresh accumulator, then a sum

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p_smem, values)
                        return acc_ref[...]

                    acc = acc + pl.run_scoped(pv, plgpu.ACC((BLOCK_Q, chunk), jnp.float32))
                else:  # into the running accumulator: one 64 x chunk f32 array live, not two (chunk = 256: 128
                    # registers per thread instead of 256, past the 255 a thread has)

                    def pv_into(acc_ref):
                        plgpu.wgmma(acc_ref, p_smem, values)

                    acc = pl.run_state(pv_into)(plgpu.ACC.init(acc))
                return acc, m_new, l

            acc = cast(jnp.zeros((BLOCK_Q, chunk), jnp.float32), plgpu.Layout.WGMMA)
            # m starts finite: m - m_new is then never -inf - (-inf), even for a block with no visible slot
            m = cast(jnp.full((BLOCK_Q,), EMPTY_LSE, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l = cast(jnp.zeros((BLOCK_Q,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            return lax.fori_loop(first, last, step, (acc, m, l))

        acc, m, l = pl.run_scoped(
            loop,
            plgpu.SMEM((2, pieces, bk, piece), dtype, transforms=swz),
            plgpu.SMEM((2, bk, tail), dtype, transforms=swz) if tail else None,
            None if shared else plgpu.SMEM((2, bk, Dv), dtype, transforms=swz),
            plgpu.SMEM((BLOCK_Q, bk), dtype, transforms=swz),
            plgpu.Barrier(num_arrivals=len(widths), num_barriers=2),
            None if shared else plgpu.Barrier(num_barriers=2),
            [plgpu.SMEM((width, bk), dtype, transforms=swz) for width in widths] if interpreted else None,
        )
        seen = l > 0
        l_safe = jnp.where(seen, l, 1.0)
        o = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        lse = jnp.where(seen, m * _LN2 + jnp.log(l_safe), EMPTY_LSE)

        def store(o_smem, lse_smem):  # reuses the loop's SMEM
            o_smem[...] = o
            lse_smem[...] = lse
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[sp, b, h, rows, pl.ds(c * chunk, chunk)])

            @pl.when(c == 0)  # the other chunks' CTAs hold the same lse
            def _():
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[sp, b, h, rows])

            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(store, plgpu.SMEM((BLOCK_Q, chunk), jnp.float32), plgpu.SMEM((BLOCK_Q,), jnp.float32))

    pl.run_scoped(
        with_q,
        plgpu.SMEM((pieces, BLOCK_Q, piece), dtype, transforms=swz),
        plgpu.SMEM((BLOCK_Q, tail), dtype, transforms=swz) if tail else None,
        plgpu.Barrier(num_arrivals=len(widths), num_barriers=1),
    )


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "block_kv", "num_splits", "value_dim", "interpret"))
def flash_decode(q, k, v, lo, hi, *, scale, softcap=None, block_kv=64, num_splits=1, value_dim=None, interpret=None):
    """Attention of q over cache slots lo[b] <= j < hi[b], reading only the KV blocks that overlap them.

    q: [B, K, R, D] bf16/f16 (K KV heads, R query rows per KV head, any R >= 1: padded to a multiple of 64);
    k: [B, K, T, D] (same dtype; T a multiple of block_kv; D a multiple of 64); lo, hi: [B] int32 (clipped to
    [0, T]). The values are either v: [B, K, T, Dv] (same dtype, Dv a multiple of 64 up to 256), or, with v=None,
    the first value_dim columns of k (MLA's latent: Dv = value_dim, a multiple of 64 up to D; default D), read from
    k's buffer in place, in chunks of the widest of 256, 192, 128, 64 columns that divides Dv, a CTA each.
    scale, softcap: Python floats (softcap: s = c * tanh(s / c)).
    block_kv: KV slots per block (a multiple of 64 up to 256); the GPU lowering refuses a kernel over 227 KiB
    of SMEM, (64 D + 2 block_kv (D + Dv) + 64 block_kv) * 2 bytes with a separate v and
    (64 D + 2 block_kv D + 64 block_kv) * 2 with v=None, plus 2 KiB the lowering reserves: D = Dv = 256, or v=None
    with D = 576, need block_kv = 64.
    num_splits: CTAs sharing one row's blocks (flash decoding: with few rows and heads, one CTA per (b, k)
    would leave most SMs idle); their partial results are merged by `merge_partials` outside the kernel.
    interpret: None (compile for GPU) or `GPU_INTERPRET` (JAX's Mosaic GPU interpreter, on CPU).

    Returns o [B, K, R, Dv] f32 and lse [B, K, R] f32, as `flash_decode_reference`.
    """
    B, K, R, D = q.shape
    T = k.shape[2]
    dtype = q.dtype
    if k.shape != (B, K, T, D) or (v is not None and v.shape[:3] != (B, K, T)):
        raise ValueError(f"q {q.shape}, k {k.shape}, v {None if v is None else v.shape} do not agree on [B, K, T, D]")
    if dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != dtype or (v is not None and v.dtype != dtype):
        raise ValueError(f"q, k, v must all be bfloat16 or all float16, got {q.dtype}, {k.dtype}, "
                         f"{None if v is None else v.dtype}")
    if v is None:
        Dv = D if value_dim is None else value_dim
        if D % 64 or Dv % 64 or not 64 <= Dv <= D:
            raise ValueError(f"with v=None, D and value_dim must be multiples of 64 with 64 <= value_dim <= D, got "
                             f"D={D}, value_dim={value_dim}")
        # value chunks of at most 256 columns (a wgmma's N, and 128 f32 accumulator registers per thread), one CTA
        # each: the widest of 256, 192, 128, 64 that divides Dv (512: two chunks of 256)
        chunk = next(c for c in (256, 192, 128, 64) if Dv % c == 0)
    else:
        Dv = chunk = v.shape[3]
        if value_dim is not None:
            raise ValueError(f"value_dim={value_dim} selects k's columns as the values; it needs v=None")
        if D % 64 or Dv % 64 or Dv > 256:
            raise ValueError(f"head dims must be multiples of 64 with Dv <= 256 (a wgmma's N), got D={D}, Dv={Dv}")
    if block_kv % 64 or not 64 <= block_kv <= 256 or T % block_kv:
        raise ValueError(f"block_kv must be 64..256 in steps of 64 and divide T={T}, got {block_kv}")
    nt = pl.cdiv(R, BLOCK_Q)
    Rp = nt * BLOCK_Q
    q = jnp.pad(q, ((0, 0), (0, 0), (0, Rp - R), (0, 0)))  # [B, K, Rp, D]
    lohi = jnp.stack([jnp.clip(lo, 0, T), jnp.clip(hi, 0, T)], axis=1).astype(jnp.int32)  # [B, 2]
    kernel = functools.partial(_kernel, block_kv=block_kv, num_splits=num_splits, chunk=chunk, scale=float(scale),
                               softcap=None if softcap is None else float(softcap), interpreted=interpret is not None)
    o, lse = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((num_splits, B, K, Rp, Dv), jnp.float32),
                  jax.ShapeDtypeStruct((num_splits, B, K, Rp), jnp.float32)),
        grid=(B, K, nt, num_splits, Dv // chunk),  # the value chunks innermost: their CTAs read the same K blocks
        grid_names=("b", "h", "t", "s", "c"),
        compiler_params=MOSAIC_GPU_PARAMS,
        interpret=interpret,
    )(lohi, q, k, *([] if v is None else [v]))
    o, lse = o[:, :, :, :R], lse[:, :, :, :R]
    return (o[0], lse[0]) if num_splits == 1 else merge_partials(o, lse)
