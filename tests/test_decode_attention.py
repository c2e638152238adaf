"""Flash decoding over a KV cache's committed slots: the Mosaic GPU kernel under JAX's Mosaic GPU interpreter vs
the reference (with a separate v, and with v=None: values from k's first columns, MLA's latent), the reference vs a
naive masked softmax, reads confined to the used blocks, the CUDA lowering, and the log-sum-exp merge with a second
block.

lo/hi are traced, so one compile per shape serves every range; shapes are tiny because the interpreter runs each
CTA's TMA copies, barriers and wgmma's as host callbacks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import (
    EMPTY_LSE,
    flash_decode,
    flash_decode_reference,
    merge_partials,
)
from pallas_kernels.kv_commit import GPU_INTERPRET

needs_interpreter = pytest.mark.skipif(GPU_INTERPRET is None, reason="this JAX has no Mosaic GPU interpreter")

T = 256  # four blocks of 64
SCALE = 0.125
# (lo, hi) per row, two rows per call: a full buffer, mid-block to mid-block, a single slot, an empty range
# mid-block, exactly one aligned block, a first block cut short, the very last slot, and hi < lo (empty).
RANGES = [((0, T), (70, 200)), ((13, 14), (100, 100)), ((64, 128), (3, 64)), ((255, 256), (9, 5))]


def random_qkv(seed, B=2, K=2, R=6, D=64, Dv=None, dtype=jnp.bfloat16, T=T):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, K, R, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, K, T, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, K, T, Dv or D)), dtype)
    return q, k, v


def lohi(pairs):
    lo, hi = zip(*pairs)
    return jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)


def interpreted(**kw):
    return jax.jit(lambda q, k, v, lo, hi: flash_decode(q, k, v, lo, hi, scale=SCALE, interpret=GPU_INTERPRET, **kw))


def assert_matches(o, lse, want_o, want_lse, lo, hi):
    """bf16 probabilities times bf16 values with f32 accumulation: |o| ~ 1, so 5e-3 absolute; lse comes from f32
    sums of exact bf16 products, so it is far tighter. An empty row must be exactly o = 0, lse = EMPTY_LSE."""
    o, lse, want_o, want_lse = map(np.asarray, (o, lse, want_o, want_lse))
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    for b in range(o.shape[0]):
        if hi[b] <= lo[b]:
            np.testing.assert_array_equal(o[b], 0.0)
            np.testing.assert_array_equal(lse[b], np.float32(EMPTY_LSE))
        else:
            np.testing.assert_allclose(o[b], want_o[b], atol=5e-3, rtol=1e-2)
            np.testing.assert_allclose(lse[b], want_lse[b], atol=2e-4, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("softcap", [None, 2.0])  # a cap of 2 bends scores of std 1: a dropped tanh shows
@pytest.mark.parametrize("R", [6, 70])  # one padded query tile; two tiles, the second mostly padding
def test_kernel_matches_reference(R, softcap):
    q, k, v = random_qkv(R, R=R)
    kernel = interpreted(softcap=softcap)
    for pairs in RANGES:
        lo, hi = lohi(pairs)
        want = flash_decode_reference(q, k, v, lo, hi, scale=SCALE, softcap=softcap)
        assert_matches(*kernel(q, k, v, lo, hi), *want, np.asarray(lo), np.asarray(hi))


@needs_interpreter
@pytest.mark.parametrize("dtype,D,Dv,block_kv,num_splits", [
    (jnp.float16, 64, 64, 64, 1),
    (jnp.bfloat16, 128, 64, 128, 1),  # values narrower than keys, two blocks of 128
    (jnp.bfloat16, 64, 64, 64, 3),  # three CTAs per row: uneven shares, empty ones for short ranges
])
def test_kernel_variants_match_reference(dtype, D, Dv, block_kv, num_splits):
    q, k, v = random_qkv(D + num_splits, R=5, D=D, Dv=Dv, dtype=dtype)
    kernel = interpreted(block_kv=block_kv, num_splits=num_splits)
    for pairs in RANGES[:3]:
        lo, hi = lohi(pairs)
        want = flash_decode_reference(q, k, v, lo, hi, scale=SCALE)
        o, lse = kernel(q, k, v, lo, hi)
        assert o.shape == (2, 2, 5, Dv) and lse.shape == (2, 2, 5)
        assert_matches(o, lse, *want, np.asarray(lo), np.asarray(hi))


@needs_interpreter
@pytest.mark.parametrize("D,Dv,R,num_splits", [
    (576, 512, 70, 1),  # MLA's latent: two value chunks of 256 and the 64 rope columns; two query tiles
    (576, 512, 5, 3),  # the same split three ways
    (192, 128, 6, 2),  # one value chunk and a 64-wide tail
    (128, None, 6, 1),  # value_dim left out: the values are all of k, one chunk and no tail
])
def test_latent_kernel_matches_reference(D, Dv, R, num_splits):
    """v=None: the values are k[..., :Dv], read from k's buffer. The kernel is checked against the reference given
    that slice as a separate v (the form the tests above check), which the reference's v=None form must equal."""
    q, k, _ = random_qkv(D + R, K=1, R=R, D=D)
    kernel = interpreted(value_dim=Dv, num_splits=num_splits)
    for pairs in RANGES[:3]:
        lo, hi = lohi(pairs)
        want = flash_decode_reference(q, k, k[..., :Dv], lo, hi, scale=SCALE)
        for got, expected in zip(flash_decode_reference(q, k, None, lo, hi, scale=SCALE, value_dim=Dv), want):
            np.testing.assert_array_equal(got, expected)
        o, lse = kernel(q, k, None, lo, hi)
        assert o.shape == (2, 1, R, Dv or D) and lse.shape == (2, 1, R)
        assert_matches(o, lse, *want, np.asarray(lo), np.asarray(hi))


def naive(q, k, v, mask, scale, softcap=None):
    """Masked softmax over every slot of the buffer: mask [B, T'] of visible slots."""
    s = jnp.einsum("bkrd,bktd->bkrt", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    return jnp.einsum("bkrt,bktd->bkrd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32)), jax.nn.logsumexp(s, -1)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_reference_matches_naive_softmax(softcap):
    q, k, v = random_qkv(1, B=4, R=3)
    lo, hi = jnp.array([0, 70, 13, 100], jnp.int32), jnp.array([T, 200, 14, 100], jnp.int32)  # the last is empty
    o, lse = flash_decode_reference(q, k, v, lo, hi, scale=SCALE, softcap=softcap)
    t = jnp.arange(T)
    want_o, want_lse = naive(q, k, v, (t >= lo[:, None]) & (t < hi[:, None]), SCALE, softcap)
    np.testing.assert_allclose(o[:3], want_o[:3], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lse[:3], want_lse[:3], atol=1e-5, rtol=1e-6)
    np.testing.assert_array_equal(o[3], 0.0)
    np.testing.assert_array_equal(lse[3], np.float32(EMPTY_LSE))


@needs_interpreter
@pytest.mark.parametrize("num_splits,D,value_dim", [(1, 64, None), (3, 64, None), (2, 576, 512)])
def test_kernel_reads_only_the_blocks_in_range(num_splits, D, value_dim):
    """K and V are NaN in every block that does not overlap [lo, hi): a kernel that read one would return NaN even
    with masking, since a masked score's probability 0 times a NaN value is NaN (tried: looping over all blocks
    fails here, with a separate v and with v=None). Partial edge blocks keep finite values outside the range, as a
    cache's stale slots do. With value_dim (v=None, MLA's latent) the values are K's own first columns."""
    bk, Tn = 64, 512
    q, k, v = random_qkv(3, B=3, K=1 if value_dim else 2, R=6, D=D, T=Tn)
    if value_dim:
        v = k[..., :value_dim]
    lo, hi = jnp.array([70, 300, 200], jnp.int32), jnp.array([200, 301, 200], jnp.int32)  # blocks 1-3, 4, none
    t = np.arange(Tn)
    first, last = np.asarray(lo) // bk * bk, np.where(hi > lo, -(-np.asarray(hi) // bk) * bk, 0)
    used = jnp.asarray((t >= first[:, None]) & (t < last[:, None]))[:, None, :, None]  # [B, 1, T, 1]
    o, lse = interpreted(block_kv=bk, num_splits=num_splits, value_dim=value_dim)(
        q, jnp.where(used, k, jnp.nan), None if value_dim else jnp.where(used, v, jnp.nan), lo, hi)
    assert_matches(o, lse, *flash_decode_reference(q, k, v, lo, hi, scale=SCALE), np.asarray(lo), np.asarray(hi))


@pytest.mark.parametrize("B,K,R,D,Dv,block_kv,softcap,num_splits,latent", [
    (2, 8, 16, 128, 128, 128, 50.0, 1, False),  # GQA group x tree nodes = 16 rows per KV head
    (1, 2, 70, 64, 64, 64, None, 1, False),  # two query tiles
    (2, 1, 8, 256, 256, 64, None, 4, False),  # the largest head dim the SMEM holds, split four ways
    (1, 1, 4, 192, 128, 64, None, 1, False),  # values narrower than keys
    (2, 1, 128, 576, 512, 64, None, 1, True),  # MLA: v=None, values k[..., :512] in two chunks; 1,000 bytes spare
    (1, 1, 16, 576, 512, 64, None, 8, True),  # ... split eight ways
    (1, 1, 4, 192, 128, 64, 30.0, 1, True),  # one value chunk and a 64-wide tail
])
def test_kernel_lowers_to_mosaic_gpu(B, K, R, D, Dv, block_kv, softcap, num_splits, latent):
    """On this CPU-only machine the GPU kernel is checked by lowering it for CUDA: the whole Pallas -> Mosaic GPU
    lowering runs (wgmma operand shapes and transforms, register layouts, the dynamic loop, the SMEM budget) and
    yields one Mosaic GPU custom call, no Triton. latent: v=None, the values are k's first Dv columns."""
    Tn = 1024
    args = (jax.ShapeDtypeStruct((B, K, R, D), jnp.bfloat16), jax.ShapeDtypeStruct((B, K, Tn, D), jnp.bfloat16),
            None if latent else jax.ShapeDtypeStruct((B, K, Tn, Dv), jnp.bfloat16),
            jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))
    fn = jax.jit(lambda q, k, v, lo, hi: flash_decode(q, k, v, lo, hi, scale=D ** -0.5, softcap=softcap,
                                                      block_kv=block_kv, num_splits=num_splits,
                                                      value_dim=Dv if latent else None))
    text = jax.export.export(fn, platforms=("cuda",))(*args).mlir_module()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and "@mosaic_gpu" in calls[0] and "triton" not in text


@pytest.mark.parametrize("D,Dv,block_kv,latent", [
    (256, 256, 128, False),  # 256 lowers with block_kv = 64 (above)
    (640, 512, 64, True),  # the next key width past MLA's 576, which lowers (above)
    (576, 512, 128, True),
])
def test_lowering_refuses_more_smem_than_a_cta_has(D, Dv, block_kv, latent):
    """The docstring's budget: the lowering, not a check of ours, refuses a kernel whose SMEM passes 227 KiB."""
    q, k, v = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((1, 1, 8, D), (1, 1, 512, D), (1, 1, 512, Dv)))
    fn = jax.jit(lambda q, k, v, lo, hi: flash_decode(q, k, v, lo, hi, scale=1.0, block_kv=block_kv,
                                                      value_dim=Dv if latent else None))
    with pytest.raises(ValueError, match="shared memory"):
        jax.export.export(fn, platforms=("cuda",))(q, k, None if latent else v,
                                                    *[jax.ShapeDtypeStruct((1,), jnp.int32)] * 2)


@pytest.mark.parametrize("dtype,D,Dv,block_kv,match", [
    (jnp.float32, 64, 64, 64, "bfloat16 or all float16"),
    (jnp.bfloat16, 32, 32, 64, "multiples of 64"),
    (jnp.bfloat16, 64, 512, 64, "Dv <= 256"),
    (jnp.bfloat16, 64, 64, 96, "block_kv"),
])
def test_kernel_refuses_shapes_it_cannot_run(dtype, D, Dv, block_kv, match):
    q, k, v = (jnp.zeros(s, dtype) for s in ((1, 1, 4, D), (1, 1, 192, D), (1, 1, 192, Dv)))
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda *a: flash_decode(*a, scale=1.0, block_kv=block_kv), q, k, v,
                       jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32))


@pytest.mark.parametrize("D,value_dim,with_v,match", [
    (576, 500, False, "multiples of 64"),
    (576, 640, False, "value_dim <= D"),  # more value columns than the key has
    (576, 0, False, "64 <= value_dim"),
    (96, 64, False, "multiples of 64"),  # the key width too
    (192, 128, True, "needs v=None"),  # value_dim picks k's columns; a separate v would be ignored
])
def test_kernel_refuses_bad_value_dim(D, value_dim, with_v, match):
    q, k = jnp.zeros((1, 1, 4, D), jnp.bfloat16), jnp.zeros((1, 1, 192, D), jnp.bfloat16)
    v = jnp.zeros((1, 1, 192, 128), jnp.bfloat16) if with_v else None
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda q, k, v, lo, hi: flash_decode(q, k, v, lo, hi, scale=1.0, value_dim=value_dim), q, k, v,
                       jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32))


@needs_interpreter
def test_merge_with_tree_block_equals_attention_over_both():
    """The committed prefix (kernel) and the tree nodes (a separate block of N slots, all visible) merged by
    log-sum-exp = one softmax over [cache | tree]; a row with an empty prefix gets the tree block alone."""
    N = 5
    q, k, v = random_qkv(4, R=6)
    _, k2, v2 = random_qkv(5, R=6, T=N)
    lo, hi = jnp.array([3, 90], jnp.int32), jnp.array([150, 90], jnp.int32)
    o1, lse1 = interpreted()(q, k, v, lo, hi)
    o2, lse2 = flash_decode_reference(q, k2, v2, jnp.zeros(2, jnp.int32), jnp.full(2, N, jnp.int32), scale=SCALE)
    o, lse = merge_partials(jnp.stack([o1, o2]), jnp.stack([lse1, lse2]))
    t = jnp.arange(T + N)
    mask = ((t >= lo[:, None]) & (t < hi[:, None])) | (t >= T)
    want_o, want_lse = naive(q, jnp.concatenate([k, k2], 2), jnp.concatenate([v, v2], 2), mask, SCALE)
    np.testing.assert_allclose(o, want_o, atol=5e-3, rtol=1e-2)
    np.testing.assert_allclose(lse, want_lse, atol=2e-4, rtol=1e-5)
    np.testing.assert_allclose(o[1], o2[1], atol=1e-6)  # empty prefix: weight exactly 0


def test_merge_of_nothing_stays_empty():
    o, lse = merge_partials(jnp.zeros((3, 2, 4, 8)), jnp.full((3, 2, 4), EMPTY_LSE))
    np.testing.assert_array_equal(o, 0.0)
    np.testing.assert_array_equal(lse, np.float32(EMPTY_LSE))
