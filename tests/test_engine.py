"""Speculative engine: tree oracle, lossless greedy, stops, drafter I/O, bad inputs (sampling: test_sampling.py)."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import decoder, engine
from jaxspec.checkpoint import WeightsError
from jaxspec.config import ConfigError, dense_config_from_dict
from jaxspec.kernels import cpu, plain
from jaxspec.segment import Segment
from jaxspec.testing import oracle_drafter
from jaxspec.tree import build_tree, tree_segment
from test_lookup import lookup_reference

TINY = {
    "llama": dict(model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                  rope_theta=5e5),
    "qwen3": dict(model_type="qwen3", head_dim=16, tie_word_embeddings=True),
    "gemma3": dict(model_type="gemma3_text", num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16,
                   sliding_window=8, sliding_window_pattern=3,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
}
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=None, bos_token_id=None)


def tiny_target(family, seed=0, **config):
    """A random target with peaked logits (weights scaled up) so greedy ties are vanishingly rare; `config`
    overrides config.json fields."""
    cfg = dense_config_from_dict({**BASE, **TINY[family], **config})
    m = jaxspec.random_model(cfg, seed=seed)
    m.params = jax.tree.map(lambda x: x * 2.5, m.params)
    return m


@pytest.fixture(scope="module", params=list(TINY))
def target(request):
    return tiny_target(request.param)


PROMPT = [int(t) for t in np.random.RandomState(0).randint(0, 128, 13)]


@pytest.fixture(scope="module")
def ar_ref(target):
    return jaxspec.generate(target, input_ids=PROMPT, method="ar", max_new_tokens=200).token_ids


def path_of(tree_tokens, parents, i):
    out = []
    while True:
        out.append(int(tree_tokens[i]))
        if i == 0:
            return out[::-1]
        i = int(parents[i])


@pytest.mark.parametrize("budget", [8, 40])
def test_tree_oracle(target, budget):
    """Every node's verify logits equal a plain causal forward over prefix + path(node)."""
    rng = np.random.RandomState(budget)
    D, V = 15, target.config.vocab_size
    draft = 0.5 * rng.randn(D, V).astype(np.float32)
    draft[0, rng.choice(V, 3, replace=False)] += 4.0  # three likely first tokens: a wide tree
    draft[np.arange(1, D), rng.randint(0, V, D - 1)] += 6.0  # then one likely token per depth: deep branches
    tree = build_tree(jnp.asarray(draft), budget)
    tokens = tree.tokens.at[0].set(PROMPT[-1])
    prefix = PROMPT[:-1]
    m = target.module
    L = len(prefix)
    _, _, cache = m(jnp.asarray([prefix]), Segment.causal(jnp.arange(L)[None]), m.init_cache(1, 128))
    logits, _, _ = m(tokens[None], tree_segment(tree, L), cache.advance(L))
    assert int(tree.depths.max()) >= 3 and int((tree.depths == 1).sum()) >= 2  # deep and branching
    toks, parents, depths = np.asarray(tokens), np.asarray(tree.parents), np.asarray(tree.depths)
    valid = np.asarray(tree.valid)
    for depth in np.unique(depths[valid]):  # one batched causal forward per depth
        nodes = np.flatnonzero(valid & (depths == depth))
        want = target.logits([prefix + path_of(toks, parents, i) for i in nodes])[:, -1]
        np.testing.assert_allclose(np.asarray(logits[0, nodes]), want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("method,budget,lookup", [("dflash", None, False), ("ddtree", 1, False), ("ddtree", 4, False),
                                                  ("ddtree", 16, False), ("ddtree", 64, False), ("dflash", None, True),
                                                  ("ddtree", 4, True), ("ddtree", 32, True)])
def test_lossless_greedy_oracle(target, ar_ref, method, budget, lookup):
    d = oracle_drafter(target, PROMPT + ar_ref, noise=0.3, max_rank=3)
    res = jaxspec.generate(target, input_ids=PROMPT, drafter=d, method=method, budget=budget, max_new_tokens=200,
                           lookup=lookup)
    assert res.token_ids == ar_ref
    assert res.stats["acceptance_length"] > 1.5  # the oracle really is accepted
    if budget is not None and budget >= 16:  # wide trees catch demoted tokens: better than the chain
        chain = jaxspec.generate(target, input_ids=PROMPT, drafter=d, method="dflash", max_new_tokens=200,
                                 lookup=lookup)
        assert res.stats["acceptance_length"] > chain.stats["acceptance_length"]


@pytest.mark.parametrize("budget", [1, 4])
def test_small_budget_reaches_its_depth(target, ar_ref, budget):
    """A small budget drafts only `budget` rows (SpecSettings.draft_depth); an exact oracle's tree is then one
    chain of `budget` nodes, and every round but the last accepts all of it."""
    d = oracle_drafter(target, PROMPT + ar_ref, noise=0.0)
    res = jaxspec.generate(target, input_ids=PROMPT, drafter=d, method="ddtree", budget=budget, max_new_tokens=61)
    assert res.token_ids == ar_ref[:61]
    hist = res.stats["accepted_length_histogram"]
    assert hist[budget] >= sum(hist) - 1 and not any(hist[budget + 1:])


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 16)])
def test_lossless_greedy_random_drafter(target, ar_ref, method, budget):
    d = jaxspec.init_drafter(target, num_layers=1, block_size=8, seed=3)
    res = jaxspec.generate(target, input_ids=PROMPT, drafter=d, method=method, budget=budget, max_new_tokens=64)
    assert res.token_ids == ar_ref[:64]


def test_lookup_in_the_loop(target, ar_ref):
    """Prompt lookup inside the decode loop: with a random drafter, whose few-percent guesses a lookup chain
    outscores, every round accepts at least as far as the chain the lookup reference copies from the context
    agrees with the output, to the drafter's block depth (deeper chain nodes compete with the drafter's: see
    test_lookup_copies_past_the_block)."""
    d = jaxspec.init_drafter(target, num_layers=1, block_size=8, seed=3)
    chunks = []
    res = jaxspec.generate(target, input_ids=PROMPT, drafter=d, method="ddtree", budget=32, lookup=True,
                           max_new_tokens=100, on_tokens=lambda t: chunks.append(len(t)), chunk_tokens=1)
    out = res.token_ids
    assert out == ar_ref[:100]
    p, chained = chunks[0], 0
    for c in chunks[1:]:  # c = 1 + the round's accepted drafts (the last round may be cut at max_new_tokens)
        want, _ = lookup_reference(PROMPT + out[:p], 7)
        agree = 0 if want is None else next((i for i, (a, b) in enumerate(zip(want, out[p:])) if a != b),
                                            min(7, len(out) - p))
        assert c >= min(agree + 1, len(out) - p)
        chained, p = chained + agree, p + c
    assert chained > 0


def test_lookup_copies_past_the_block():
    """A lookup chain is not cut at the drafter's block: where the output repeats (this Gemma 3 target settles
    on one token at a time), rounds verify and commit copies of up to the budget's 32 tokens through the real
    attention caches, sliding windows included, and the output stays AR's, at far more tokens per round than
    without lookup. (Where an output does not repeat, as the other tiny targets' here, there is nothing to copy.)"""
    m = tiny_target("gemma3")
    ar = jaxspec.generate(m, input_ids=PROMPT, method="ar", max_new_tokens=120).token_ids
    d = jaxspec.init_drafter(m, num_layers=1, block_size=8, seed=3)
    res = jaxspec.generate(m, input_ids=PROMPT, drafter=d, method="ddtree", budget=32, lookup=True,
                           max_new_tokens=120)
    assert res.token_ids == ar
    hist = res.stats["accepted_length_histogram"]
    deepest = max(k for k, n in enumerate(hist) if n)
    assert len(hist) == 33 and sum(hist[8:]) >= 3 and deepest >= 16, hist  # rounds that accepted past the block
    plain = jaxspec.generate(m, input_ids=PROMPT, drafter=d, method="ddtree", budget=32, lookup=False,
                             max_new_tokens=120)
    assert res.stats["acceptance_length"] > 2 * plain.stats["acceptance_length"]


def test_tiled_kernels_in_the_loop():
    """Float kernels in the CPU kernel's column tiles (how jaxspec.load keeps them on one CPU device): a tiled
    target decodes what the plain one does, and DDTree with a tiled drafter and with an oracle stays lossless."""
    plain = tiny_target("gemma3")
    ref = jaxspec.generate(plain, input_ids=PROMPT, method="ar", max_new_tokens=40).token_ids
    tiled = dataclasses.replace(plain, params=cpu.to_layout(plain.params))
    assert isinstance(tiled.module.layers[0].mlp.up_proj.kernel[...], cpu.Tiles)
    want = plain.logits([PROMPT + ref])  # greedy tokens alone would not see a small error in every product
    np.testing.assert_allclose(tiled.logits([PROMPT + ref]), want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert jaxspec.generate(tiled, input_ids=PROMPT, method="ar", max_new_tokens=40).token_ids == ref
    random = jaxspec.init_drafter(tiled, num_layers=1, block_size=8)
    random = dataclasses.replace(random, params=cpu.to_layout(random.params))
    assert isinstance(random.module.layers[0].mlp.up_proj.kernel[...], cpu.Tiles)
    for d in (random, oracle_drafter(tiled, PROMPT + ref, noise=0.3)):
        res = jaxspec.generate(tiled, input_ids=PROMPT, drafter=d, method="ddtree", budget=8, max_new_tokens=40)
        assert res.token_ids == ref
    assert res.stats["acceptance_length"] > 2


def test_stops_mid_round(target, ar_ref):
    d = oracle_drafter(target, PROMPT + ar_ref)  # noise 0: every round accepts the whole block
    res = jaxspec.generate(target, input_ids=PROMPT, drafter=d, method="ddtree", budget=16, max_new_tokens=37,
                           lookup=False)  # (a lookup chain may reach a 16th node, past the block)
    assert res.token_ids == ar_ref[:37]
    assert res.stats["rounds"] < 37 // 4
    # 36 tokens after the prefill's: whole blocks of 16 (k = 15 accepted + bonus) and a last round cut to 4;
    # acceptance length counts what was emitted, not the cut round's 16
    assert res.stats["accepted_length_histogram"][15] == res.stats["rounds"] == 3
    assert res.stats["acceptance_length"] == 36 / 3


def test_streaming_chunks(target, ar_ref):
    """on_tokens receives the output in order, a chunk at a time; a chunk of 0 tokens is refused (it never ends)."""
    d = oracle_drafter(target, PROMPT + ar_ref, noise=0.3)
    for drafter in (None, d):
        got = []
        res = jaxspec.generate(target, input_ids=PROMPT, drafter=drafter, max_new_tokens=40, on_tokens=got.append,
                               chunk_tokens=8)
        assert sum(got, []) == res.token_ids == ar_ref[:40] and len(got) > 2
        for bad in (0, -1, 2.5):
            with pytest.raises(ValueError, match="chunk_tokens"):
                jaxspec.generate(target, input_ids=PROMPT, drafter=drafter, on_tokens=got.append, chunk_tokens=bad)


def test_decode_calls_do_not_rehash_the_graphdef(monkeypatch):
    """jit hashes its static arguments on every call; the engine's steps get graphdefs hashed once per handle
    (Model.jit_def), so a streamed generation's chunk calls never walk a module tree again."""
    target = tiny_target("llama")
    ids = jaxspec.generate(target, input_ids=PROMPT, method="ar", max_new_tokens=40).token_ids
    d = oracle_drafter(target, PROMPT + ids, noise=0.3)
    for drafter in (None, d):  # compile first: tracing may hash
        jaxspec.generate(target, input_ids=PROMPT, drafter=drafter, max_new_tokens=40, on_tokens=lambda t: None,
                         chunk_tokens=4, budget=None if drafter is None else 4)
    hashed = []
    for g in {type(target.graphdef), type(d.graphdef)}:
        monkeypatch.setattr(g, "__hash__", lambda self, h=g.__hash__: hashed.append(1) or h(self))
    for drafter in (None, d):
        chunks = []
        jaxspec.generate(target, input_ids=PROMPT, drafter=drafter, max_new_tokens=40, on_tokens=chunks.append,
                         chunk_tokens=4, budget=None if drafter is None else 4)
        assert len(chunks) > 3
    assert not hashed

def test_batched_ar_grows_the_cache_by_windows(target, ar_ref, monkeypatch):
    """A left-padded batch decoded over three cache windows gives each row what a full-length cache gives it
    alone (and row 0 the AR reference)."""
    other = PROMPT[5:]
    grown, real_reslot = [], engine.ar_reslot
    monkeypatch.setattr(engine, "ar_reslot",
                        lambda s, shift, **kw: grown.append(kw["max_len"]) or real_reslot(s, shift, **kw))
    res = jaxspec.generate(target, input_ids=[PROMPT, other], method="ar", max_new_tokens=150)
    assert grown == [192, 256]  # prompt slots 64: windows of 128, 192 and 256 slots
    monkeypatch.setattr(decoder, "ar_window", lambda model, batch, max_len: max_len)
    alone = jaxspec.generate(target, input_ids=other, method="ar", max_new_tokens=150).token_ids
    assert res.token_ids == [ar_ref[:150], alone]


def test_context_needs_no_slack_for_the_tree():
    """A prompt + max_new_tokens that fills the context exactly runs with a wide tree: the verify scratch lives
    in jaxspec's own buffer, not in the model's context."""
    m = tiny_target("qwen3")
    ctx = m.config.max_position_embeddings
    prompt = [int(t) for t in np.random.RandomState(1).randint(0, 128, ctx - 24)]
    want = jaxspec.generate(m, input_ids=prompt, max_new_tokens=24).token_ids
    d = oracle_drafter(m, prompt + want, block_size=8)
    res = jaxspec.generate(m, input_ids=prompt, drafter=d, budget=64, max_new_tokens=24)
    assert res.token_ids == want
    with pytest.raises(ValueError, match=f"context of {ctx}"):
        jaxspec.generate(m, input_ids=prompt, drafter=d, budget=64, max_new_tokens=25)


def test_eos_inside_accepted_path(target, ar_ref):
    # pick an EOS that first appears mid-way through the greedy output
    pos = next(i for i in range(40, 200) if ar_ref[i] not in ar_ref[:i])
    m = dataclasses.replace(target, config=target.config.replace(eos_token_ids=(ar_ref[pos],)))
    want = jaxspec.generate(m, input_ids=PROMPT, method="ar", max_new_tokens=200).token_ids
    assert want == ar_ref[: pos + 1]
    d = oracle_drafter(target, PROMPT + ar_ref)
    res = jaxspec.generate(m, input_ids=PROMPT, drafter=d, method="ddtree", budget=8, max_new_tokens=200)
    assert res.token_ids == want
    assert res.stats["acceptance_length"] > 4  # so the EOS was reached inside an accepted path


def test_drafter_save_load_roundtrip(tmp_path):
    m = tiny_target("qwen3")
    d = jaxspec.init_drafter(m, num_layers=2, block_size=8, seed=1)
    d.save(tmp_path / "drafter")
    d2 = jaxspec.load_drafter(tmp_path / "drafter", m)
    assert d2.config == d.config
    assert isinstance(d2.module.layers[0].mlp.up_proj.kernel[...], cpu.Tiles)  # loaded on a CPU: in the kernel's tiles
    for a, b in zip(jax.tree.leaves(d.params), jax.tree.leaves(plain(d2.params))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    r1 = jaxspec.generate(m, input_ids=PROMPT, drafter=d, max_new_tokens=24)
    r2 = jaxspec.generate(m, input_ids=PROMPT, drafter=d2, max_new_tokens=24)
    assert r1.token_ids == r2.token_ids
    assert r1.stats["accepted_length_histogram"] == r2.stats["accepted_length_histogram"]
    # saved in bfloat16: loaded float32, its kernels tiled in bfloat16, drafting what float32 tiles of it draft
    d.save(tmp_path / "bf16", dtype="bfloat16")
    d3 = jaxspec.load_drafter(tmp_path / "bf16", m)
    assert d3.module.layers[0].mlp.up_proj.kernel[...].tiles.dtype == jnp.bfloat16
    assert d3.module.fc.kernel.dtype == jnp.float32  # the drafter computes in float32 (its cache, its outputs)
    d4 = dataclasses.replace(d3, params=cpu.to_layout(plain(d3.params), compact=False))
    assert d4.module.layers[0].mlp.up_proj.kernel[...].tiles.dtype == jnp.float32
    r3 = jaxspec.generate(m, input_ids=PROMPT, drafter=d3, max_new_tokens=24)
    r4 = jaxspec.generate(m, input_ids=PROMPT, drafter=d4, max_new_tokens=24)
    assert r3.token_ids == r1.token_ids
    assert r3.stats["accepted_length_histogram"] == r4.stats["accepted_length_histogram"]


def test_draft_vocab(tmp_path, target, ar_ref):
    """A drafter restricted to a draft vocabulary proposes only those ids, stays lossless, and round-trips."""
    vocab = tuple(range(0, 128, 3))
    d = jaxspec.init_drafter(target, num_layers=1, block_size=8, seed=3, draft_vocab=vocab)
    mod = d.module
    cache = mod.append_context(mod.init_cache(1, 32), jax.random.normal(jax.random.key(0), (1, 5, 64 * len(
        d.config.target_layer_ids))), 5)
    logits = np.asarray(mod.draft_logits(target.module, cache, jnp.asarray([PROMPT[0]]), jnp.asarray([5])))[0]  # [7, K]
    assert logits.shape == (7, len(vocab)) and np.isfinite(logits).all()
    tree = build_tree(jnp.asarray(logits), 16, vocab)
    assert set(np.asarray(tree.tokens)[np.asarray(tree.valid)][1:]) <= set(vocab)  # proposes only its vocabulary
    for depth in (1, 3):  # DDTree's small budgets draft only their rows, which are the same rows
        cut = mod.draft_logits(target.module, cache, jnp.asarray([PROMPT[0]]), jnp.asarray([5]), depth)[0]
        np.testing.assert_allclose(np.asarray(cut), logits[:depth], rtol=1e-6, atol=1e-6)
    for method, budget in (("dflash", None), ("ddtree", 16)):
        res = jaxspec.generate(target, input_ids=PROMPT, drafter=d, method=method, budget=budget, max_new_tokens=64)
        assert res.token_ids == ar_ref[:64]
    d.save(tmp_path / "d")
    assert json.loads((tmp_path / "d" / "config.json").read_text())["draft_vocab_size"] == len(vocab)
    assert jaxspec.load_drafter(tmp_path / "d", target).config == d.config


def test_load_zlab_layout(tmp_path):
    """A checkpoint written with z-lab's config keys and unprefixed tensor names loads, transposed right."""
    from safetensors.numpy import save_file

    m = tiny_target("llama")
    H, nH, nKV, hd, I = 64, 4, 2, 16, 96
    cfg = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "hidden_size": H, "intermediate_size": I, "num_hidden_layers": 1,
        "num_attention_heads": nH, "num_key_value_heads": nKV, "head_dim": hd, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "max_position_embeddings": 1024, "vocab_size": 128, "attention_bias": False,
        "tie_word_embeddings": False, "layer_types": ["full_attention"], "block_size": 16, "num_target_layers": 2,
        "dflash_config": {"mask_token_id": 127, "target_layer_ids": [0, 1]},
    }
    rng = np.random.RandomState(0)
    shapes = {"fc.weight": (H, 2 * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
              "layers.0.input_layernorm.weight": (H,), "layers.0.post_attention_layernorm.weight": (H,),
              "layers.0.self_attn.q_proj.weight": (nH * hd, H), "layers.0.self_attn.k_proj.weight": (nKV * hd, H),
              "layers.0.self_attn.v_proj.weight": (nKV * hd, H), "layers.0.self_attn.o_proj.weight": (H, nH * hd),
              "layers.0.self_attn.q_norm.weight": (hd,), "layers.0.self_attn.k_norm.weight": (hd,),
              "layers.0.mlp.gate_proj.weight": (I, H), "layers.0.mlp.up_proj.weight": (I, H),
              "layers.0.mlp.down_proj.weight": (H, I)}
    tensors = {k: rng.randn(*s).astype(np.float32) for k, s in shapes.items()}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    d = jaxspec.load_drafter(tmp_path, m)
    assert d.config.block_size == 16 and d.config.target_layer_ids == (0, 1) and d.config.mask_token_id == 127
    mod = d.module
    np.testing.assert_array_equal(np.asarray(mod.fc.weight()), tensors["fc.weight"].T)
    attn = mod.layers[0].self_attn
    np.testing.assert_array_equal(np.asarray(attn.o_proj.weight()), tensors["layers.0.self_attn.o_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(attn.k_norm.weight[...]), tensors["layers.0.self_attn.k_norm.weight"])
    res = jaxspec.generate(m, input_ids=PROMPT, drafter=d, max_new_tokens=20)
    assert res.token_ids == jaxspec.generate(m, input_ids=PROMPT, max_new_tokens=20).token_ids


def test_bad_inputs(tmp_path):
    m = tiny_target("qwen3")
    d = jaxspec.init_drafter(m, block_size=8)
    other = tiny_target("llama")  # same sizes; vary one field at a time below
    wide = jaxspec.random_model(other.config.replace(hidden_size=96))
    with pytest.raises(ConfigError, match="hidden_size"):
        jaxspec.generate(wide, input_ids=PROMPT, drafter=d)
    with pytest.raises(ConfigError, match="vocab_size"):
        jaxspec.generate(jaxspec.random_model(m.config.replace(vocab_size=256)), input_ids=PROMPT, drafter=d)
    d.save(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 5]
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="target_layer_ids"):
        jaxspec.load_drafter(tmp_path / "d", m)
    for b in (0, -3, 1025, 2.5):
        with pytest.raises(ValueError, match="budget"):
            jaxspec.generate(m, input_ids=PROMPT, drafter=d, method="ddtree", budget=b)
    with pytest.raises(ValueError, match="needs a drafter"):
        jaxspec.generate(m, input_ids=PROMPT, method="ddtree")
    with pytest.raises(ValueError, match="lookup must be True or False"):
        jaxspec.generate(m, input_ids=PROMPT, drafter=d, lookup=4)
    with pytest.raises(ValueError, match=r"empty prompt \(row 1 of the batch\)"):
        jaxspec.generate(m, input_ids=[PROMPT, []], drafter=d)
    with pytest.raises(ValueError, match="context"):
        jaxspec.generate(m, input_ids=PROMPT * 80, drafter=d, max_new_tokens=64)
    with pytest.raises(FileNotFoundError, match="config.json"):
        jaxspec.load_drafter(tmp_path / "nope", m)
    cfg["dflash_config"]["target_layer_ids"] = [0, 1]
    cfg["draft_vocab_size"] = 16  # promised, but the weights carry no draft_vocab tensor
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="draft_vocab"):
        jaxspec.load_drafter(tmp_path / "d", m)
    with pytest.raises(ConfigError, match="draft_vocab"):
        jaxspec.init_drafter(m, draft_vocab=[3, 500])


def test_pallas_commit_in_the_loop(target, ar_ref):
    """The engine with the Pallas KV-commit kernel (interpret mode on CPU) is lossless too."""
    d = oracle_drafter(target, PROMPT + ar_ref, noise=0.3)
    res = jaxspec.generate(target, input_ids=PROMPT, drafter=d, method="ddtree", budget=16, max_new_tokens=64,
                           kv_impl="pallas")
    assert res.token_ids == ar_ref[:64] and res.stats["acceptance_length"] > 2
    assert res.stats["kv_commit"] == "pallas (interpret)"  # what really ran is reported
    assert jaxspec.generate(target, input_ids=PROMPT, drafter=d, max_new_tokens=8).stats["kv_commit"] == "xla"
    with pytest.raises(ValueError, match="kv_commit impl"):
        jaxspec.generate(target, input_ids=PROMPT, drafter=d, kv_impl="cuda")
