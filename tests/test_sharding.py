"""Sharding over 8 fake CPU devices (conftest.py asks XLA for 8): every family generates the same tokens
sharded (tp = 8, and dp x tp = 2 x 4) as on one device, with AR, DFlash and DDTree (one row and a batch); caches
stay sharded like their layers; the sharded loops lower for the `cuda` platform; a Qwen3.6-shaped target's
compiled loops at tp = 8 pay 2 all-reduces per layer and nothing that grows with the cache; bad meshes get clear
errors."""
from __future__ import annotations

import functools
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxspec
from compiles import compiles, engine_compiles
from jaxspec import engine
from jaxspec.cache import KVEntry, LatentEntry
from jaxspec.config import dense_config_from_dict
from jaxspec.decoder import Decoder, live_rows
from jaxspec.kernels import gpu, xla
from jaxspec.models.deepseek import deepseek_config_from_dict
from jaxspec.models.gemma4 import gemma4_config_from_dict
from jaxspec.models.qwen3_next import hybrid_config_from_dict
from jaxspec.sampling import SamplingParams
from jaxspec.sharding import Layout
from jaxspec.testing import oracle_drafter

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices: see conftest.py")

# Heads chosen so tp = 4 shards K/V by head and tp = 8 must replicate it (4 KV heads): both paths run.
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, head_dim=8, max_position_embeddings=512)
TARGETS = {
    "llama": lambda: dense_config_from_dict({**BASE, "model_type": "llama"}),
    "deepseek_v3": lambda: deepseek_config_from_dict(dict(
        BASE, model_type="deepseek_v3", moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=32,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2)),
    # a GDN layer, then a full-attention one; both MoE with a shared expert
    "qwen3_next": lambda: hybrid_config_from_dict(dict(
        BASE, model_type="qwen3_next", num_hidden_layers=2, full_attention_interval=2, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})),
    # full layers: 2 KV heads of 16 (k_eq_v), replicated at tp = 4 and 8; layer 3 reads layer 1's K/V; PLE; MoE
    "gemma4": lambda: gemma4_config_from_dict(dict(
        BASE, model_type="gemma4_text", num_hidden_layers=4, global_head_dim=16, num_global_key_value_heads=4,
        attention_k_eq_v=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=1, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16,
        final_logit_softcapping=30.0)),
}
MESHES = {"tp8": (8, 1), "dp2xtp4": (4, 2)}
PROMPT = [int(t) for t in np.random.RandomState(1).randint(0, 128, 11)]
NEW = 24


@functools.cache
def target(name: str):
    m = jaxspec.random_model(TARGETS[name](), seed=5)
    m.params = jax.tree.map(lambda x: x * 2.0, m.params)  # peaked logits: no near-ties for a reordered sum to flip
    return m


@functools.cache
def reference(name: str):
    """One-device greedy tokens: a single prompt, and a left-padded batch of two."""
    m = target(name)
    single = jaxspec.generate(m, input_ids=PROMPT, method="ar", max_new_tokens=NEW).token_ids
    batch = jaxspec.generate(m, input_ids=[PROMPT, PROMPT[3:]], method="ar", max_new_tokens=NEW).token_ids
    return single, batch


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", list(TARGETS))
def test_same_tokens_sharded(name, mesh):
    single, batch = reference(name)
    tp, dp = MESHES[mesh]
    m = target(name).on_mesh(jaxspec.make_mesh(tp=tp, dp=dp))
    assert jaxspec.generate(m, input_ids=[PROMPT, PROMPT[3:]], method="ar", max_new_tokens=NEW).token_ids == batch
    d = oracle_drafter(m, PROMPT + single, noise=0.3, block_size=5)
    r = jaxspec.generate(m, input_ids=PROMPT, drafter=d, method="ddtree", budget=8, max_new_tokens=NEW)
    assert r.token_ids == single and r.stats["acceptance_length"] > 2.0
    d = oracle_drafter(m, [PROMPT + batch[0], PROMPT[3:] + batch[1]], noise=0.3, block_size=5)  # rows split on dp
    r = jaxspec.generate(m, input_ids=[PROMPT, PROMPT[3:]], drafter=d, method="ddtree", budget=8, max_new_tokens=NEW)
    assert r.token_ids == batch
    if mesh != "tp8":
        return  # the DFlash drafter's layers shard by the same rules as dense targets: one mesh suffices
    d = jaxspec.init_drafter(m, num_layers=1, block_size=4)  # a real DFlash drafter, placed on the target's mesh
    assert jaxspec.generate(m, input_ids=PROMPT, drafter=d, method="dflash", max_new_tokens=NEW).token_ids == single


@pytest.mark.parametrize("name", list(TARGETS))
def test_params_and_caches_are_sharded(name):
    """Parameters lie on their shards; the caches a prefill returns are pinned to the same rules."""
    m = target(name).on_mesh(jaxspec.make_mesh(tp=4, dp=2))
    embed = m.params["embed_tokens"][...]
    assert embed.sharding.spec == P("tp", None) and embed.addressable_shards[0].data.shape == (32, 64)
    state = engine.ar_prefill(m.jit_def, m.params, jnp.zeros((2, 16), jnp.int32), jnp.zeros((2,), jnp.int32),
                              jax.random.key(0), jnp.int32(4), max_len=64, out_len=8, sampling=SamplingParams(),
                              eos=(-1,), layout=m.layout)
    want = m.layout.cache_shardings(state.cache)
    for leaf, sharding in zip(jax.tree.leaves(state.cache), jax.tree.leaves(want), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.shape, leaf.sharding, sharding)
    specs = {tuple(leaf.sharding.spec) for leaf in jax.tree.leaves(state.cache.layers)}
    assert any("tp" in s for s in specs) or name == "deepseek_v3"  # MLA latents: by batch, replicated over tp
    assert all(s[0] == "dp" for s in specs)  # every buffer is split by batch


def test_decode_loops_compile_once_on_dp():
    """A prefill's state is sharded as the decode loop returns it, so the loop compiles once for a whole run, not
    again on its second call (the small per-row fields were left to XLA, which split them by rows in the loop
    and not in the prefill). Refills and the chunks after them reuse the same program too."""
    m = target("qwen3_next").on_mesh(jaxspec.make_mesh(tp=2, dp=2))
    rows = [PROMPT, PROMPT[3:]]
    d = oracle_drafter(m, [p + [1] * 64 for p in rows], noise=0.3, block_size=5)
    with compiles() as compiled:
        for dec in (Decoder(m), Decoder(m, d, method="ddtree", budget=8)):
            run = dec.prefill(rows, 40)
            for stop in (6, 12, 18):
                dec.decode(run, stop)
            dec.refill(run, [1], [PROMPT[5:]], [8])
            dec.decode(run, 24)
    loops = {k: v for k, v in engine_compiles(compiled).items() if k.endswith("decode)")}
    assert loops == {"jit(ar_decode)": 1, "jit(spec_decode)": 1}, loops


def test_live_rows_alone_on_dp():
    """On dp = 2, rounds over 2 live rows of 4 run those rows alone (one per data-parallel group), and each
    gets the tokens, rounds and acceptance of the one-device decode of all 4; the idle rows are left as they
    were. One live row still runs 2 (a data-parallel group holds no fewer than one)."""
    rows = [PROMPT, PROMPT[:5], PROMPT[2:], PROMPT[:7]]
    names = ("out", "emitted", "rounds", "accepted_hist", "bonus")

    def decode(m, live):
        d = jaxspec.init_drafter(m, num_layers=1, block_size=4, seed=1)
        dec = Decoder(m, d, method="ddtree", budget=4)
        run = dec.prefill(rows, 16)
        dec.cancel(run, [1, 3])
        before = {k: np.asarray(getattr(run.state, k)) for k in names}
        with compiles() as compiled:
            dec.decode(run, 100, live=live)
        return before, {k: np.asarray(getattr(run.state, k)) for k in names}, compiled

    assert live_rows(1, 4, 2) == live_rows(2, 4, 2) == 2 and live_rows(3, 4, 2) == 4 and live_rows(1, 8, 3) == 8
    _, full, _ = decode(target("qwen3_next"), None)
    before, part, compiled = decode(target("qwen3_next").on_mesh(jaxspec.make_mesh(tp=2, dp=2)), [0, 2])
    assert compiled["jit(spec_decode_rows)"] == 1 and not compiled["jit(spec_decode)"], compiled
    for b in range(4):
        for k in names:
            np.testing.assert_array_equal(part[k][b], (full if b in (0, 2) else before)[k][b], err_msg=f"{b} {k}")


def test_layout_rules():
    mesh = jaxspec.make_mesh(tp=4, dp=2)
    lay = Layout.of("deepseek", mesh)
    assert lay.spec(("embed", "q_heads"), (64, 64)) == P(None, "tp")
    assert lay.spec(("batch", "kv_heads", "seq", "head_dim"), (2, 2, 16, 8)) == P("dp", None, None, None)  # 2 % 4
    assert lay.spec(("experts", "embed", "ffn"), (8, 64, 32)) == P("tp", None, None)  # tp used once per array
    assert lay.spec(("batch", "seq", "latent"), (2, 16, 24)) == P("dp", None, None)
    heads = Layout.of("dense", mesh, {"q_heads": 8, "kv_heads": 3})  # 3 KV heads of 8 dims: 24 columns
    assert heads.spec(("embed", "kv_heads"), (64, 24)) == P(None, None)  # 24 % 4 == 0, but a head is never cut
    assert heads.spec(("embed", "q_heads"), (64, 64)) == P(None, "tp")
    # 2 KV heads on tp = 4: tp viewed as tp_kv (2) x tp_rep (2) over the same devices in the same order; K/V split
    # over tp_kv only, so device i holds KV head i // 2, the one its query heads 2i, 2i + 1 read
    two = Layout.of("dense", mesh, {"q_heads": 8, "kv_heads": 2})
    assert two.view.shape == {"dp": 2, "tp_kv": 2, "tp_rep": 2} and two.mesh == mesh
    assert (two.view.devices.reshape(mesh.devices.shape) == mesh.devices).all()
    assert two.spec(("batch", "kv_heads", "seq", "head_dim"), (2, 2, 16, 8)) == P("dp", "tp_kv", None, None)
    assert two.spec(("embed", "q_heads"), (64, 64)) == P(None, ("tp_kv", "tp_rep"))
    assert two.shards(("embed", "kv_heads"), (64, 16)) == 2 and two.shards(("vocab", "embed"), (128, 64)) == 4
    with pytest.raises(ValueError, match="gdn_heads"):
        lay.spec(("gdn_heads",), (8,))
    with pytest.raises(ValueError, match="no sharding rules"):
        Layout.of("nope", mesh)
    with pytest.raises(ValueError, match="needs 16 devices"):
        jaxspec.make_mesh(tp=8, dp=2)
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        jaxspec.make_mesh(tp=0)


def test_drafter_on_other_devices_is_refused():
    m = target("llama")
    d = jaxspec.init_drafter(m, num_layers=1, block_size=4)  # one device
    sharded = m.on_mesh(jaxspec.make_mesh(tp=8))
    with pytest.raises(ValueError, match="different devices"):
        jaxspec.generate(sharded, input_ids=PROMPT, drafter=d, max_new_tokens=4)
    with pytest.raises(ValueError, match="runs on one device"):
        jaxspec.generate(sharded, input_ids=PROMPT, drafter=d, max_new_tokens=4, kv_impl="pallas")


@pytest.mark.parametrize("name", list(TARGETS))
def test_sharded_loops_lower_for_cuda(name):
    """Prefill, AR decode and the speculative loop of each family, sharded over 8 devices, lower for the GPU
    (jax.export on this CPU-only machine): nothing CPU-only hides in the GPU path."""
    m = target(name).on_mesh(jaxspec.make_mesh(tp=8))
    d = jaxspec.init_drafter(m, num_layers=1, block_size=4)
    export = lambda f, *a, **k: jax.export.export(f, platforms=("cuda",))(*a, **k)  # noqa: E731
    sp, eos = SamplingParams(0.7, 5, 0.9), (1,)
    toks, key, n = jnp.zeros((1, 16), jnp.int32), jax.random.key(0), jnp.int32(8)
    ar = export(engine.ar_prefill, m.jit_def, m.params, toks, jnp.zeros((1,), jnp.int32), key, n, max_len=64,
                out_len=8, sampling=sp, eos=eos, layout=m.layout)
    state = engine.ar_prefill(m.jit_def, m.params, toks, jnp.zeros((1,), jnp.int32), key, n, max_len=64,
                              out_len=8, sampling=sp, eos=eos, layout=m.layout)
    dec = export(engine.ar_decode, m.jit_def, m.params, state, n, sampling=sp, eos=eos, layout=m.layout)
    settings = engine.SpecSettings("ddtree", 8, 4, d.config.target_layer_ids, sp, eos, "xla", m.layout, d.layout)
    args = (m.jit_def, m.params, d.jit_def, d.params)
    spec_state = engine.spec_prefill(*args, toks, jnp.int32(11), key, n, max_len=64, out_len=16, settings=settings)
    spec = export(engine.spec_decode, *args, spec_state, n, settings=settings)
    for exp in (ar, dec, spec):
        assert exp.platforms == ("cuda",) and exp.nr_devices == 8
        assert "stablehlo" in exp.mlir_module()


def test_load_into_mesh(tiny_hf):
    """jaxspec.load(path, mesh=) streams every tensor into its shards: same logits as a one-device load."""
    _, path = tiny_hf("llama")
    one = jaxspec.load(path, tokenizer=False)
    sharded = jaxspec.load(path, mesh=jaxspec.make_mesh(tp=4, dp=2), tokenizer=False)
    attn = sharded.params["layers"][0]["self_attn"]  # 2 KV heads on tp = 4: K/V split 2 ways (test_layout_rules)
    q, k = attn["q_proj"]["kernel"][...], attn["k_proj"]["kernel"][...]
    assert q.sharding.spec == P(None, ("tp_kv", "tp_rep")) and len(q.addressable_shards) == 8
    assert k.sharding.spec == P(None, "tp_kv") and k.addressable_shards[0].data.shape == (64, 16)
    ids = np.array([PROMPT, PROMPT[::-1]])
    np.testing.assert_allclose(sharded.logits(ids), one.logits(ids), rtol=1e-5, atol=1e-5)


# Qwen3.6-27B's head counts at tiny widths: 24 query heads over 4 KV heads (fewer than tp = 8), GDN 16 key and
# 48 value heads (its q, k and v split by their own heads), one full-attention layer in four.
QWEN36 = dict(model_type="qwen3_5_text", vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=24,
              num_key_value_heads=4, head_dim=8, linear_num_key_heads=16, linear_num_value_heads=48,
              linear_key_head_dim=8, linear_value_head_dim=8, full_attention_interval=4, max_position_embeddings=1024,
              rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
COLLECTIVE = re.compile(r"= (\([^)]*\)|\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter"
                        r"|collective-broadcast)(?:-start)?\(")


def tp8_loops(m, max_len: int, lower) -> dict:
    """lower(fn, *args, **kwargs) of the AR decode loop and the speculative (DDTree, budget 8) loop of a target on a
    tp = 8 mesh with `max_len` cache slots (an oracle drafter: no layers, so every op is the target's, its verify's
    and its commit's), as {"ar": ..., "verify": ...}."""
    sp, eos, key, n, toks = SamplingParams(), (-1,), jax.random.key(0), jnp.int32(8), jnp.zeros((1, 16), jnp.int32)
    state = engine.ar_prefill(m.jit_def, m.params, toks, jnp.zeros((1,), jnp.int32), key, n, max_len=max_len,
                              out_len=8, sampling=sp, eos=eos, layout=m.layout)
    ar = lower(engine.ar_decode, m.jit_def, m.params, state, n, sampling=sp, eos=eos, layout=m.layout)
    d = oracle_drafter(m, list(range(32)), block_size=5)
    settings = engine.SpecSettings("ddtree", 8, 4, d.config.target_layer_ids, sp, eos, "xla", m.layout, d.layout)
    args = (m.jit_def, m.params, d.jit_def, d.params)
    state = engine.spec_prefill(*args, toks, jnp.int32(11), key, n, max_len=max_len, out_len=16, settings=settings)
    return {"ar": ar, "verify": lower(engine.spec_decode, *args, state, n, settings=settings)}


def collectives(layers: int, max_len: int, **kw) -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    """(op, operand shapes) of every collective in the compiled `tp8_loops` of a Qwen3.6-shaped target of `layers`
    layers. kw: config overrides, and `dtype` / `kernels` for `random_model`."""
    opts = {k: kw.pop(k) for k in ("dtype", "kernels") if k in kw}
    m = jaxspec.random_model(hybrid_config_from_dict({**QWEN36, "num_hidden_layers": layers, **kw}), **opts)
    compiled = tp8_loops(m.on_mesh(jaxspec.make_mesh(tp=8)), max_len,
                         lambda f, *a, **k: f.lower(*a, **k).compile().as_text())
    return {name: [(op, tuple(re.findall(r"[a-z]+[0-9]*\[[0-9,]*\]", shape))) for shape, op in COLLECTIVE.findall(text)]
            for name, text in compiled.items()}


def test_tp_pays_two_all_reduces_per_layer():
    """[gpu-path] target: at tp = 8 a layer costs the 2 all-reduces Megatron-style tp needs (its attention or GDN
    output projection, its MLP's down projection) and nothing else. From 4 layers with 128 slots to 8 layers with
    512, the AR decode loop and the speculative loop each gain exactly 8 all-reduces and no other collective,
    contain no collective-permute (a GDN q | k | v split across shards: 11 per GDN layer before) and no collective
    with an operand the smaller program lacks (KV heads replicated over tp: whole K and V buffers gathered in
    verify before); the rest is a constant few (embedding rows, the sampled token's max and index)."""
    small, big = collectives(4, 128), collectives(8, 512)
    for prog in ("ar", "verify"):
        a, b = (Counter(op for op, _ in c[prog]) for c in (small, big))
        assert b["all-reduce"] - a["all-reduce"] == 2 * 4 and a["all-reduce"] <= 2 * 4 + 3, (prog, a, b)
        assert {op: k for op, k in b.items() if op != "all-reduce"} == \
            {op: k for op, k in a.items() if op != "all-reduce"}, (prog, a, b)
        assert not b["collective-permute"], (prog, b)
        shapes = [{s for _, ss in c[prog] for s in ss} for c in (small, big)]
        assert shapes[1] <= shapes[0], (prog, shapes[1] - shapes[0])


def test_qwen36_shaped_same_tokens_at_tp8():
    """The layout the collective counts rest on is exact: the Qwen3.6-shaped target (Qwen3.5's split q, k, v GDN
    projections; 4 KV heads on 8 devices) generates the same tokens at tp = 8 as on one device, AR and DDTree."""
    m = jaxspec.random_model(hybrid_config_from_dict({**QWEN36, "num_hidden_layers": 4}), seed=5)
    m.params = jax.tree.map(lambda x: x * 2.0, m.params)  # peaked logits, as `target`
    want = jaxspec.generate(m, input_ids=PROMPT, method="ar", max_new_tokens=NEW).token_ids
    sharded = m.on_mesh(jaxspec.make_mesh(tp=8))
    assert jaxspec.generate(sharded, input_ids=PROMPT, method="ar", max_new_tokens=NEW).token_ids == want
    d = oracle_drafter(sharded, PROMPT + want, noise=0.3, block_size=5)
    r = jaxspec.generate(sharded, input_ids=PROMPT, drafter=d, method="ddtree", budget=8, max_new_tokens=NEW)
    assert r.token_ids == want and r.stats["acceptance_length"] > 2.0


@pytest.fixture
def kernel_per_device(monkeypatch):
    """The GPU path's flash-decoding kernel in CPU programs too, one call per device on a mesh (its reference per
    device under the interpreter: gpu._flash_prefix), the calls' shapes recorded."""
    seen = []
    spy = gpu.flash_decode_reference
    monkeypatch.setattr(gpu, "INTERPRET", True)
    monkeypatch.setattr(gpu, "flash_decode_reference", lambda q, k, *a, **kw: seen.append((q.shape, k.shape)) or
                        spy(q, k, *a, **kw))
    return seen


@pytest.mark.parametrize("tp,dp,KVH,rows,group", [(8, 1, 4, 2, 3), (4, 2, 4, 1, 6), (8, 1, 2, None, None)])
def test_flash_decoding_kernel_per_device(kernel_per_device, tp, dp, KVH, rows, group):
    """On a mesh the GPU path's committed prefix runs once per device over that device's shards (a custom call the
    partitioner cannot split, inside a shard_map with the cache's own specs). Qwen3.6's 24 query heads over 4 KV
    heads, a tree verify over a cache laid out by the layout's rules (tp = 8: KV heads over tp_kv, each device's 3
    query heads of its KV head over tp_rep; dp 2 x tp 4: rows over dp, 6 query heads per device): the reference's
    output, and each call saw one KV head and its device's rows. A layer with fewer KV heads than the layout's (2 of
    4 on tp_kv = 4: its cache replicated) keeps the blocked loop.

    Attention alone, not a whole sharded generate: XLA:CPU's in-process collectives now and then deadlock on the GPU
    path's decode programs over 8 fake devices (a rendezvous that 5 of 8 devices reach, with the blocked loop too)."""
    mesh = jaxspec.make_mesh(tp=tp, dp=dp)
    layout = Layout.of("dense", mesh, {"q_heads": 24, "kv_heads": 4})
    B, N, H, T, D = 2, 9, 24, 256, 64
    length, mask = __import__("test_kernels_gpu").case(B, N, T, [200, 64], [0, 3], tree=True)
    ks = jax.random.split(jax.random.key(3), 5)
    q = jax.random.normal(ks[0], (B, N, H, D), jnp.float16)
    k_old, v_old = (jax.random.normal(x, (B, KVH, T, D), jnp.float16) for x in ks[1:3])
    k_new, v_new = (jax.random.normal(x, (B, N, KVH, D), jnp.float16) for x in ks[3:5])
    put = lambda x, axes: jax.device_put(x, layout.sharding(axes, x.shape))  # noqa: E731
    new = ("batch", "seq", "kv_heads", "head_dim")
    args = (put(q, ("batch", "seq", "q_heads", "head_dim")), put(k_old, KVEntry.AXES["k"]),
            put(v_old, KVEntry.AXES["v"]), put(k_new, new), put(v_new, new), length, mask)
    assert args[1].sharding.spec[1] == (None if KVH == 2 else "tp_kv" if tp == 8 else "tp")
    got = jax.jit(lambda *a: gpu.cache_attention(*a, 0.125, None, ranged=True))(*args)
    want = xla.cache_attention(*(x.astype(jnp.float32) for x in (q, k_old, v_old, k_new, v_new)), length, mask, 0.125)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2, rtol=0)
    assert set(kernel_per_device) == ({((rows, 1, group * N, D), (rows, 1, T, D))} if rows else set())


@pytest.mark.parametrize("tp,dp,rows,heads", [(8, 1, 2, 2), (4, 2, 1, 4)])
def test_latent_kernel_per_device(kernel_per_device, tp, dp, rows, heads):
    """MLA's committed latents on a mesh: the kernel (its v=None form) once per device, over the device's rows and
    query heads and the whole latent buffer of its rows (one key shared by every head, replicated over tp), merged
    with the tree's latents: the reference's output."""
    mesh = jaxspec.make_mesh(tp=tp, dp=dp)
    layout = Layout.of("deepseek", mesh)
    B, N, H, T, C, r = 2, 9, 16, 256, 192, 128
    length, mask = __import__("test_kernels_gpu").case(B, N, T, [200, 64], [0, 3], tree=True)
    ks = jax.random.split(jax.random.key(5), 2)
    q = jax.random.normal(ks[0], (B, N, H, C), jnp.float16)
    latent = jax.random.normal(ks[1], (B, T, C), jnp.float16)
    args = (jax.device_put(q, layout.sharding(("batch", "seq", "q_heads", "latent"), q.shape)),
            jax.device_put(latent, layout.sharding(LatentEntry.AXES["latent"], latent.shape)), mask)
    got = jax.jit(lambda q, latent, mask: gpu.latent_attention(q, latent, mask, 0.1, r, length))(*args)
    want = xla.latent_attention(q.astype(jnp.float32), latent.astype(jnp.float32), mask, 0.1, r)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2, rtol=0)
    assert set(kernel_per_device) == {((rows, 1, heads * N, C), (rows, 1, T, C))}


def test_sharded_gpu_path_lowers_mla_and_experts_per_device():
    """The `cuda` lowering of a tp = 8 AR step and DDTree loop of a DeepSeek-V3-shaped target (its 128 heads and
    576-wide latents, narrower elsewhere; bf16): each device reads its rows' latents with the flash-decoding kernel for
    its 16 query heads, and a verify's 72 (token, expert) pairs run the grouped-matmul kernel on each device's 2
    experts (an AR step's 8 pairs gather theirs)."""
    cfg = deepseek_config_from_dict(dict(
        BASE, model_type="deepseek_v3", hidden_size=1024, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=16, num_experts_per_tok=8, n_group=8, topk_group=4))
    m = jaxspec.random_model(cfg, dtype=jnp.bfloat16, kernels="gpu").on_mesh(jaxspec.make_mesh(tp=8))
    texts = tp8_loops(m, 256, lambda f, *a, **k: jax.export.export(f, platforms=("cuda",))(*a, **k).mlir_module())
    for name, rows, grouped in (("ar", 16, 0), ("verify", 144, 3)):  # 16 heads per device, 1 or 9 tokens
        text = texts[name]
        assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1 + grouped, name
        assert "chlo.ragged_dot" not in text
        operands = re.findall(r"func.func private @flash_decode\w*\(%arg0: (tensor<\S+>) [^,]*, %arg1: (tensor<\S+>)",
                              text)
        assert operands == [(f"tensor<1x1x{rows}x576xbf16>", "tensor<1x1x256x576xbf16>")], operands


def test_flash_decoding_kernel_per_device_moves_no_cache(kernel_per_device):
    """The kernel's shard_map takes the cache as it lies: the compiled tp = 8 loops (AR and DDTree) have the same
    collectives with the kernel per device as with the blocked loop the partitioner splits itself, none with an
    operand as long as the cache (specs that disagreed with the cache's sharding would gather it first)."""
    kw = dict(head_dim=64, dtype=jnp.float16, kernels="gpu")
    with_kernel = collectives(4, 256, **kw)
    assert kernel_per_device
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu, "FLASH_DECODE", False)
        blocked = collectives(4, 256, **kw)
    for prog in ("ar", "verify"):
        assert Counter(op for op, _ in with_kernel[prog]) == Counter(op for op, _ in blocked[prog]), prog
        assert not [c for c in with_kernel[prog] if any(",256," in s for s in c[1])], with_kernel[prog]


def test_sharded_gpu_path_lowers_the_kernel_per_device():
    """The `cuda` lowering of a tp = 8 AR step and DDTree loop on the GPU path (bf16, Qwen3.6's heads, head_dim 256)
    holds the flash-decoding kernel once per attention layer, over one device's KV head and query rows."""
    cfg = hybrid_config_from_dict({**QWEN36, "num_hidden_layers": 4, "head_dim": 256})
    m = jaxspec.random_model(cfg, dtype=jnp.bfloat16, kernels="gpu").on_mesh(jaxspec.make_mesh(tp=8))
    texts = tp8_loops(m, 256, lambda f, *a, **k: jax.export.export(f, platforms=("cuda",))(*a, **k).mlir_module())
    for text, rows in ((texts["ar"], 3), (texts["verify"], 27)):  # 3 query heads per device, 1 or 9 tokens
        assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
        operands = re.findall(r"func.func private @flash_decode\w*\(%arg0: (tensor<\S+>) [^,]*, %arg1: (tensor<\S+>)",
                              text)
        assert operands == [(f"tensor<1x1x{rows}x256xbf16>", "tensor<1x1x256x256xbf16>")], operands
