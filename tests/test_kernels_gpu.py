"""The GPU path's attention (jaxspec/kernels/gpu.py): blocked loops over the used slots against the references,
the engine exact with it selected, and a `cuda` lowering of a Qwen3.6-shaped target whose attention holds no
float32 tensor as long as its 32k-slot buffer."""
from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxspec
from jaxspec import kernels, testing
from jaxspec.config import dense_config_from_dict
from jaxspec.kernels import gpu, xla
from jaxspec.models.attention import cache_mask, ring_mask, sliding
from jaxspec.models.deepseek import DeepseekLM, deepseek_config_from_dict
from jaxspec.models.moe import _own_experts, experts_ragged
from jaxspec.models.qwen3_next import HybridLM, hybrid_config_from_dict
from jaxspec.segment import Segment
from jaxspec.sharding import make_mesh
from jaxspec.testing import interpreted_grouped_matmul, oracle_drafter
from jaxspec.tree import ancestor_mask, build_tree
from pallas_kernels.kv_commit import GPU_INTERPRET

# A tiny dense target whose head_dim (64) the flash-decoding kernel takes (the shared tiny configs use 16)
TINY_64 = dict(model_type="qwen3", vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
               rope_parameters={"rope_type": "default", "rope_theta": 1e6})

RNG = np.random.default_rng(0)


def case(B, N, T, lengths, starts, tree=False, window=None):
    """A realistic mask from cache_mask: rows of different committed lengths and left padding, N new tokens that
    see each other causally or along a random tree, optionally a sliding window; positions follow each row."""
    length, start = jnp.asarray(lengths, jnp.int32), jnp.asarray(starts, jnp.int32)
    if tree:
        parents = np.r_[0, [RNG.integers(0, i) for i in range(1, N)]]
        depth = np.zeros(N, int)
        for i in range(1, N):
            depth[i] = depth[parents[i]] + 1
        t = build_tree(jnp.zeros((1, 4)), 1)  # only for its dataclass
        t = dataclasses.replace(t, parents=jnp.asarray(parents, jnp.int32), depths=jnp.asarray(depth, jnp.int32))
        visible = jnp.broadcast_to(ancestor_mask(t), (B, N, N))
        offsets = jnp.asarray(depth, jnp.int32)
    else:
        visible = jnp.broadcast_to(jnp.tril(jnp.ones((N, N), bool)), (B, N, N))
        offsets = jnp.arange(N, dtype=jnp.int32)
    positions = (length - start)[:, None] + offsets[None]
    mask, key_pos = cache_mask(positions, length, start, visible, T)
    if window:
        mask = sliding(mask, positions, key_pos, window)
    return length, mask


@pytest.mark.parametrize("T,N,lengths,starts,tree,window,softcap", [
    (96, 1, [40, 7], [0, 3], False, None, None),  # AR steps, blocks of 32
    (1024, 9, [700, 5], [0, 0], True, None, None),  # a tree verify, rows far apart, blocks of 512
    (1024, 9, [513, 512], [10, 0], True, 8, 30.0),  # a sliding window and soft-capping; a block edge
    (80, 16, [0, 0], [0, 0], False, None, None),  # a prefill chunk into an empty cache (blocks of 16)
    (100, 3, [97, 50], [0, 20], False, None, None),  # T with no power-of-two divisor >= 16: one block of T
])
def test_cache_attention_matches_reference(T, N, lengths, starts, tree, window, softcap):
    B, H, KVH, D = 2, 8, 2, 16
    length, mask = case(B, N, T, lengths, starts, tree, window)
    ks = jax.random.split(jax.random.key(T + N), 5)
    q = jax.random.normal(ks[0], (B, N, H, D))
    k_old, v_old = (jax.random.normal(k, (B, KVH, T, D)) for k in ks[1:3])
    k_new, v_new = (jax.random.normal(k, (B, N, KVH, D)) for k in ks[3:5])
    want = xla.cache_attention(q, k_old, v_old, k_new, v_new, length, mask, 0.3, softcap)
    got = jax.jit(gpu.cache_attention, static_argnums=(7, 8))(q, k_old, v_old, k_new, v_new, length, mask, 0.3, softcap)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


@pytest.mark.parametrize("R,N,lengths,starts,tree", [
    (64, 1, [200, 30], [0, 5], False),  # AR steps: one ring wrapped, one not yet full
    (64, 9, [64, 70], [3, 0], True),  # a tree verify as the ring fills and just after it wrapped
    (32, 80, [0, 40], [0, 0], False),  # a prefill chunk longer than the ring
])
def test_cache_attention_over_a_ring_matches_reference(R, N, lengths, starts, tree):
    """A sliding layer's ring (mask [B, N, R + N] from ring_mask, length clipped to R) on the GPU path against
    the reference form."""
    B, H, KVH, D = 2, 8, 2, 16
    length, _ = case(B, N, 256, lengths, starts, tree)
    visible = jnp.broadcast_to(jnp.tril(jnp.ones((N, N), bool)), (B, N, N))
    positions = (length - jnp.asarray(starts, jnp.int32))[:, None] + jnp.arange(N)[None]
    mask = ring_mask(positions, length, jnp.asarray(starts, jnp.int32), visible, R, R)
    used = jnp.minimum(length, R)
    ks = jax.random.split(jax.random.key(R + N), 5)
    q = jax.random.normal(ks[0], (B, N, H, D))
    k_old, v_old = (jax.random.normal(k, (B, KVH, R, D)) for k in ks[1:3])
    k_new, v_new = (jax.random.normal(k, (B, N, KVH, D)) for k in ks[3:5])
    want = xla.cache_attention(q, k_old, v_old, k_new, v_new, used, mask, 0.3)
    got = jax.jit(gpu.cache_attention, static_argnums=(7,))(q, k_old, v_old, k_new, v_new, used, mask, 0.3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


def test_attention_and_latent_attention_match_reference():
    B, N, T, H, KVH, D = 2, 5, 512, 4, 2, 32
    length, mask = case(B, N, T, [300, 44], [0, 4], tree=True)
    ks = jax.random.split(jax.random.key(1), 4)
    q, k, v = jax.random.normal(ks[0], (B, N, H, D)), *(jax.random.normal(x, (B, KVH, T, D)) for x in ks[1:3])
    np.testing.assert_allclose(np.asarray(gpu.attention(q, k, v, mask, 0.2, 20.0)),
                               np.asarray(xla.attention(q, k, v, mask, 0.2, 20.0)), atol=2e-5, rtol=0)
    latent = jax.random.normal(ks[3], (B, T, 24))
    ql = jax.random.normal(ks[0], (B, N, H, 24))
    np.testing.assert_allclose(np.asarray(gpu.latent_attention(ql, latent, mask, 0.2, 16)),
                               np.asarray(xla.latent_attention(ql, latent, mask, 0.2, 16)), atol=2e-5, rtol=0)
    assert int(gpu.extent(mask)) == 300 + N


@pytest.mark.parametrize("N,lengths,starts,tree", [
    (5, [300, 44], [0, 4], True),  # a tree verify in the expanded form
    (40, [0, 20], [0, 3], False),  # prefill chunks: into an empty row, and after a committed, left-padded one
])
def test_expanded_latent_attention_matches_reference(N, lengths, starts, tree):
    """MLA's expanded form block by block (each block's latents up-projected as it is read) against HF's form over
    the whole buffer."""
    B, T, H, dn, dr, r, dv = 2, 512, 4, 8, 8, 16, 12
    length, mask = case(B, N, T, lengths, starts, tree=tree)
    ks = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(ks[0], (B, N, H, dn + dr))
    latent = jax.random.normal(ks[1], (B, T, r + dr))
    w_kvb = jax.random.normal(ks[2], (r, H * (dn + dv))) * 0.3
    got = jax.jit(gpu.expanded_latent_attention, static_argnums=(4, 5))(q, latent, mask, w_kvb, 0.2, dn)
    want = xla.expanded_latent_attention(q, latent, mask, w_kvb, 0.2, dn)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    assert int(gpu.extent(jnp.zeros((1, 1, 64), bool))) == 0


@pytest.fixture
def interpreted_kernel(monkeypatch):
    """The GPU path's ranged cache attention through the Mosaic GPU kernel under JAX's interpreter (on a CPU the
    program otherwise runs the blocked loop, and only a GPU program the kernel)."""
    if GPU_INTERPRET is None:
        pytest.skip("this JAX has no Mosaic GPU interpreter")
    monkeypatch.setattr(gpu, "INTERPRET", True)


@pytest.mark.parametrize("N,lengths,starts,tree", [
    (1, [130, 7], [0, 3], False),  # AR steps: rows far apart, left padding, an edge mid-block
    (9, [200, 64], [0, 0], True),  # a tree verify
    (16, [0, 0], [0, 0], False),  # a prefill chunk into an empty cache: no committed slot at all
])
def test_flash_decoding_kernel_in_cache_attention(interpreted_kernel, N, lengths, starts, tree):
    """A ranged cache_attention on bf16 runs the committed prefix through the kernel and merges this forward's keys
    into its log-sum-exp: the reference's output within bf16's rounding of the probabilities."""
    B, T, H, KVH, D = 2, 256, 4, 2, 64
    length, mask = case(B, N, T, lengths, starts, tree=tree)
    ks = jax.random.split(jax.random.key(3), 5)
    q = jax.random.normal(ks[0], (B, N, H, D), jnp.bfloat16)
    k_old, v_old = (jax.random.normal(x, (B, KVH, T, D), jnp.bfloat16) for x in ks[1:3])
    k_new, v_new = (jax.random.normal(x, (B, N, KVH, D), jnp.bfloat16) for x in ks[3:5])
    args = (q, k_old, v_old, k_new, v_new, length, mask, 0.125, None)
    seen = []
    spy = gpu.flash_decode
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu, "flash_decode", lambda *a, **kw: seen.append(kw["interpret"]) or spy(*a, **kw))
        got = gpu.cache_attention(*args, ranged=True)
    assert seen == [GPU_INTERPRET]
    want = xla.cache_attention(*(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in args[:5]),
                               *args[5:])
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2, rtol=0)


@pytest.mark.parametrize("interpret", [True, False])  # the kernel; the blocked loop a CPU program runs instead
@pytest.mark.parametrize("N,lengths,starts,tree", [
    (1, [130, 7], [0, 3], False),  # AR steps: rows far apart, left padding, an edge mid-block
    (9, [200, 64], [0, 0], True),  # a tree verify
    (16, [0, 0], [0, 0], False),  # a prefill chunk into an empty cache
])
def test_flash_decoding_kernel_in_latent_attention(monkeypatch, interpret, N, lengths, starts, tree):
    """MLA's absorbed attention given the committed lengths: the committed latents through the kernel's v=None form
    (values read from the latent buffer itself, a 128-wide c_kv plus a 64-wide rope tail here), this forward's N
    latents, written after them, merged as one more block: the reference's output within bf16's rounding."""
    if interpret and GPU_INTERPRET is None:
        pytest.skip("this JAX has no Mosaic GPU interpreter")
    monkeypatch.setattr(gpu, "INTERPRET", interpret)
    B, T, H, C, r = 2, 256, 4, 192, 128
    length, mask = case(B, N, T, lengths, starts, tree=tree)
    ks = jax.random.split(jax.random.key(4), 2)
    q = jax.random.normal(ks[0], (B, N, H, C), jnp.bfloat16)
    latent = jax.random.normal(ks[1], (B, T, C), jnp.bfloat16)
    seen, spy = [], gpu.flash_decode
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu, "flash_decode", lambda *a, **kw: seen.append(kw["value_dim"]) or spy(*a, **kw))
        got = gpu.latent_attention(q, latent, mask, 0.1, r, length)
    assert seen == ([r] if interpret else [])
    want = xla.latent_attention(q.astype(jnp.float32), latent.astype(jnp.float32), mask, 0.1, r)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2, rtol=0)


def test_flash_decoding_kernel_only_on_hopper(monkeypatch):
    """The kernel is written for Hopper (TMA, wgmma): a process with another GPU reads the prefix with the blocked
    loop (an A100 or a B200 would fail to compile the kernel); a host without a GPU keeps it, to lower for CUDA."""
    q, k = jnp.zeros((1, 1, 8, 128), jnp.bfloat16), jnp.zeros((1, 1, 256, 128), jnp.bfloat16)
    assert gpu.flash_fits(q, k, k)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for capability, fits in (("9.0", True), ("8.0", False), ("10.0", False), ("gfx90a", False)):
        monkeypatch.setattr(jax, "devices", lambda c=capability: [SimpleNamespace(compute_capability=c)])
        assert gpu.flash_fits(q, k, k) == fits, capability


# (config, weight scale, value widths the kernel is called with: None for a KV cache's separate values)
KERNEL_TARGETS = {
    "dense": (lambda: dense_config_from_dict({**__import__("test_engine").BASE, **TINY_64}), 2.5, {None}),
    # MLA whose latents the kernel takes: a 128-wide c_kv and a 64-wide rope tail (the prefill expands)
    "mla": (lambda: deepseek_config_from_dict({**__import__("test_deepseek").DEEPSEEK, "model_type": "deepseek_v3",
                                               "kv_lora_rank": 128, "qk_rope_head_dim": 64}), 2.0, {128}),
}


@pytest.mark.parametrize("family", list(KERNEL_TARGETS))
def test_engine_exact_through_the_flash_decoding_kernel(interpreted_kernel, family):
    """Greedy AR and DDTree (a batch of two, the oracle drafter) with every attention layer's committed prefix read by
    the interpreted kernel (a KV cache's in the prefill, the AR steps and the verifies alike; MLA's latents in the
    AR steps and verifies), equal AR on the reference forms. float16, which the kernel takes: in bfloat16 the
    verify's and the AR step's products of different row counts round apart often enough to flip a greedy token on
    either path."""
    config, scale, widths = KERNEL_TARGETS[family]
    ref = jaxspec.random_model(config(), seed=1, dtype=jnp.float16, kernels="xla")
    ref.params = jax.tree.map(lambda x: x * scale, ref.params)
    m = dataclasses.replace(ref, kernels="gpu")
    prompts = [list(range(3, 16)), list(range(40, 47))]
    want = [jaxspec.generate(ref, input_ids=p, method="ar", max_new_tokens=16).token_ids for p in prompts]
    calls, spy = [], gpu.flash_decode
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu, "flash_decode", lambda *a, **kw: calls.append(kw.get("value_dim")) or spy(*a, **kw))
        assert jaxspec.generate(m, input_ids=prompts, method="ar", max_new_tokens=16).token_ids == want
        d = oracle_drafter(m, [p + w for p, w in zip(prompts, want)], noise=0.3)
        res = jaxspec.generate(m, input_ids=prompts, drafter=d, method="ddtree", budget=6, max_new_tokens=16)
    assert res.token_ids == want and res.stats.acceptance_length > 1.5
    assert calls and set(calls) == widths  # traced through the kernel


@pytest.fixture
def interpreted_ragged():
    """The GPU path's grouped product through JAX's Hopper kernel (`ragged_dot_mgpu`) under the Mosaic GPU
    interpreter."""
    if GPU_INTERPRET is None or gpu.ragged_dot_mgpu is None:
        pytest.skip("this JAX has no Mosaic GPU interpreter or no ragged_dot_mgpu")
    with interpreted_grouped_matmul():
        yield


def test_ragged_dot_kernel_matches_reference(interpreted_ragged):
    """Groups of every kind (empty, inside one 64-row tile, across tiles) and a row count that is no whole tile,
    against lax.ragged_dot in float32."""
    sizes = jnp.asarray([0, 37, 3, 0, 70, 40], jnp.int32)  # 150 rows
    ks = jax.random.split(jax.random.key(5), 2)
    x = jax.random.normal(ks[0], (150, 128), jnp.bfloat16)
    w = jax.random.normal(ks[1], (6, 128, 256), jnp.bfloat16)
    seen, spy = [], gpu._ragged_kernel
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu, "_ragged_kernel", lambda *a: seen.append(1) or spy(*a))
        got = jax.jit(gpu.ragged_dot)(x, w, sizes)
    want = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
    assert seen and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=0.07 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("piece", [None, 64])  # the own pairs at once, or in pieces of 64 rows (about 64 own here)
def test_experts_of_one_device_mask_other_devices_pairs(interpreted_ragged, piece):
    """Under expert parallelism a device runs the pairs of its own experts (3 to 5 of 6 here) through the kernel;
    the pairs of other experts sort after them, and the kernel runs them through the last group: they must add
    nothing. Against each token's sum over its own experts' pairs, computed densely in float32."""
    T, k, E, H, I, first = 64, 2, 6, 128, 128, 3
    ks = jax.random.split(jax.random.key(6), 5)
    x = jax.random.normal(ks[0], (T, H), jnp.bfloat16)
    w = jax.random.uniform(ks[1], (T, k))
    idx = jax.random.randint(ks[2], (T, k), 0, E)
    gate, up = (jax.random.normal(key, (3, H, I), jnp.bfloat16) * 0.2 for key in ks[3:5])
    down = jnp.swapaxes(gate, 1, 2)
    seen, spy = [], gpu._ragged_kernel
    with pytest.MonkeyPatch.context() as mp, kernels.use("gpu"):
        mp.setattr(gpu, "_ragged_kernel", lambda *a: seen.append(1) or spy(*a))
        got = _own_experts(x, w, idx, first, gate, up, down, jax.nn.silu, piece=piece)
    assert seen  # through the kernel
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    e = jnp.clip(idx - first, 0, 2)
    h = jax.nn.silu(jnp.einsum("th,tkhi->tki", f32(x), f32(gate)[e])) * jnp.einsum("th,tkhi->tki", f32(x), f32(up)[e])
    y = jnp.einsum("tki,tkih->tkh", h, f32(down)[e]) * jnp.where((idx >= first), w, 0)[..., None]
    want = y.sum(1)
    assert float(jnp.abs(want).max()) > 0
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=0.03 * float(jnp.abs(want).max()))


def test_expert_parallel_lowering_runs_each_devices_experts():
    """Experts split over tp = 8 (a prefill's grouped products): the cuda lowering runs JAX's grouped-matmul kernel
    on each device's own experts (three products, no ragged_dot left for XLA's GPU compiler to turn into a product
    over every expert) in a loop over pieces of the device's pairs, and the CPU program sums the devices with one
    all-reduce of [T, H], tokens not pairs."""
    mesh = make_mesh(tp=8)
    E, H, I, T, k = 16, 256, 128, 128, 4
    sh = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    args = [jax.ShapeDtypeStruct((T, H), jnp.bfloat16, sharding=sh()),
            jax.ShapeDtypeStruct((T, k), jnp.float32, sharding=sh()),
            jax.ShapeDtypeStruct((T, k), jnp.int32, sharding=sh()),
            *(jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sh("tp")) for shape in ((E, H, I), (E, H, I),
                                                                                          (E, I, H)))]

    def run(backend):
        def f(*a):
            with kernels.use(backend):
                return experts_ragged(*a)
        return jax.jit(f)

    text = jax.export.export(run("gpu"), platforms=("cuda",))(*args).mlir_module()
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 3 and "chlo.ragged_dot" not in text
    assert "stablehlo.while" in text  # a device's own pairs in pieces of 128 rows, not all 512 pairs at once
    hlo = run("xla").lower(*args).compile().as_text()
    # one all-reduce of the tokens (XLA:CPU may widen a bf16 all-reduce to f32)
    assert re.findall(r"= \w+(\[[0-9,]+\])\S* all-reduce(?:-start)?\(", hlo) == [f"[{T},{H}]"]
    assert not re.findall(r"all-gather|all-to-all|collective-permute", hlo)


def with_gpu_path(model):
    return dataclasses.replace(model, params=model.plain_params(), kernels="gpu")


FAMILIES = {
    "llama": lambda: __import__("test_engine").tiny_target("llama"),
    "gemma3": lambda: __import__("test_engine").tiny_target("gemma3"),  # sliding window
    "qwen3_5": lambda: __import__("test_engine_gdn").hybrid_target(),
    "deepseek_v3": lambda: __import__("test_batched_spec").deepseek_target(),  # MLA latents
    # prefills (64 wide) expand in both; here the verifies (13 nodes) too, while the AR steps stay absorbed
    "deepseek_v3_expanded": lambda: __import__("test_batched_spec").deepseek_target(absorb_max_tokens=8),
    "gemma4": lambda: __import__("test_batched_spec").gemma4_target(),  # KV-shared layers: kernels.attention
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_exact_on_the_gpu_path(family):
    """Greedy DDTree on a batch of two prompts with the GPU path selected equals AR on the default backend."""
    ref = FAMILIES[family]()
    m = with_gpu_path(ref)
    prompts = [list(range(3, 16)), list(range(40, 47))]
    want = [jaxspec.generate(ref, input_ids=p, method="ar", max_new_tokens=24).token_ids for p in prompts]
    assert jaxspec.generate(m, input_ids=prompts, method="ar", max_new_tokens=24).token_ids == want
    d = oracle_drafter(m, [p + w for p, w in zip(prompts, want)], noise=0.3)
    res = jaxspec.generate(m, input_ids=prompts, drafter=d, method="ddtree", budget=12, max_new_tokens=24)
    assert res.token_ids == want and res.stats.acceptance_length > 2.0
    if family == "llama":  # a DFlash drafter's own attention over its context on the GPU path too
        d = jaxspec.init_drafter(m, num_layers=1, block_size=8, seed=2)
        assert d.kernels == "gpu"
        assert jaxspec.generate(m, input_ids=prompts, drafter=d, method="dflash", max_new_tokens=24).token_ids == want


QWEN36 = dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
              num_hidden_layers=4, num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
              linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, full_attention_interval=4,
              max_position_embeddings=262144,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
# DeepSeek-V3's widths (2 of its 61 layers, one dense and one MoE with fewer experts: the attention is what counts)
DEEPSEEK_V3 = {**testing.DEEPSEEK_V3, "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 16}
SLOTS = 32768


def shaped_module(family: str):
    """An abstract bf16 target of a real model's widths: "qwen3_6" (Qwen3.6-27B: 4 of its 64 layers, 3 GDN and one
    attention) or "deepseek_v3" (MLA latents)."""
    if family == "qwen3_6":
        cfg = hybrid_config_from_dict(QWEN36)
        return nnx.eval_shape(lambda: HybridLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    cfg = deepseek_config_from_dict(DEEPSEEK_V3)
    return nnx.eval_shape(lambda: DeepseekLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))


def cuda_forward_text(backend: str, N: int, family: str = "qwen3_6") -> str:
    """StableHLO of one forward of N tokens (1: an AR step, 65: a budget-64 verify, 1024: a prefill chunk) over a
    32k-slot cache holding 500 tokens, lowered for cuda on this host with the weights abstract."""
    module = shaped_module(family)
    graphdef, params = nnx.split(module)

    def forward(params, tokens, positions, cache):
        with kernels.use(backend):
            seg = Segment.causal(positions)
            return nnx.merge(graphdef, params)(tokens, seg, cache)[0]

    cache = jax.eval_shape(lambda: module.init_cache(1, SLOTS))
    cache = dataclasses.replace(cache, length=jax.ShapeDtypeStruct((1,), jnp.int32))
    args = (params, jax.ShapeDtypeStruct((1, N), jnp.int32), jax.ShapeDtypeStruct((1, N), jnp.int32), cache)
    return jax.export.export(jax.jit(forward), platforms=("cuda",))(*args).mlir_module()


def f32_spanning(text: str) -> list[str]:
    return sorted(set(re.findall(rf"tensor<[0-9x]*x{SLOTS}(?:x[0-9]+)*xf32>", text)))


@pytest.mark.parametrize("N", [1, 65, 1024])
def test_cuda_lowering_reads_no_float32_as_long_as_the_buffer(N):
    """The target of [gpu-path]: on the GPU path no float32 tensor spans the buffer (scores, softmax) in an AR
    step, a verify or a prefill chunk; the references' lowering has them (so the check can fail), and the CPU
    backend's program for cuda is the GPU path's."""
    ref, fast, cpu = (cuda_forward_text(b, N) for b in ("xla", "gpu", "cpu"))
    assert f32_spanning(ref) and "@mosaic_gpu" not in ref  # the whole-buffer reference: [.., 32768] f32 scores
    assert not f32_spanning(fast), f32_spanning(fast)
    assert not f32_spanning(cpu)  # platform_dependent's other branch
    for text in (fast, cpu):  # the attention layer's committed prefix through the flash-decoding kernel
        assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
    if N == 1:  # JAXSPEC_FLASH_DECODE=0: the blocked loop, still reading only the used slots
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gpu, "FLASH_DECODE", False)
            off = cuda_forward_text("gpu", N)
        assert "@mosaic_gpu" not in off and not f32_spanning(off)


@pytest.mark.parametrize("N", [1, 65, 1024])  # absorbed (AR step, verify) and expanded (prefill chunk)
def test_cuda_lowering_of_deepseek_v3(N):
    """The same for MLA's latent cache in both of its forms: the reference's expanded form writes
    [1, 128, 1024, 32768] float32 scores per layer for a prefill chunk (17 GB), the GPU path none that long. The
    absorbed form (an AR step, a verify) reads each layer's committed latents with the flash-decoding kernel. And
    the MoE layer's grouped products (a verify's and a prefill's pairs; an AR step gathers its 8 experts) run
    JAX's grouped-matmul kernel: a ragged_dot left to XLA's GPU compiler becomes a product over every expert."""
    ref, fast, cpu = (cuda_forward_text(b, N, "deepseek_v3") for b in ("xla", "gpu", "cpu"))
    assert f32_spanning(ref)
    assert not f32_spanning(fast), f32_spanning(fast)
    assert not f32_spanning(cpu), f32_spanning(cpu)
    grouped = N * 8 > 64  # more (token, expert) pairs than moe.GATHER_MAX_PAIRS
    absorbed = N <= 170  # mla.absorb_threshold for DeepSeek-V3's widths
    assert ("chlo.ragged_dot" in ref) == grouped and "@mosaic_gpu" not in ref
    for text in (fast, cpu):
        assert "chlo.ragged_dot" not in text
        # the two MLA layers call one jitted flash_decode, so its custom call is written once
        assert len(re.findall(r"custom_call @mosaic_gpu", text)) == absorbed + 3 * grouped
