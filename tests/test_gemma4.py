"""Gemma 4 text targets against transformers, and through the speculative engine.

Three tiny variants cover every switch of `Gemma4TextConfig` that a released checkpoint uses, each after one
released shape (reference/architectures.md §4.2):
  * "31b": sliding + full layers with their own geometry (full: global_head_dim 32, one KV head,
    attention_k_eq_v: no v_proj), default and proportional RoPE, final logit soft-capping;
  * "e2b": per-layer inputs (PLE), KV sharing (the last 2 of 6 layers reuse layers 2 and 3's K/V and own no
    cache entry) with double-wide MLPs on them, separate v_proj on full layers;
  * "moe": the MoE branch beside the dense MLP (4 experts, top 2, fused gate_up), with k_eq_v and an untied head.
Every HF weight is randomised, norms, router scales and the per-layer `layer_scalar` buffers included. The
window (4) is shorter than every sequence (13), so the sliding layers really slide.
"""
from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import jaxspec
import jaxspec.model as jm
from conftest import randomize_
from jaxspec.config import ConfigError
from jaxspec.models.gemma4 import gemma4_config_from_dict, rope_inv_freq
from jaxspec.sampling import SamplingParams
from jaxspec.segment import Segment
from jaxspec.testing import oracle_drafter
from jaxspec.tree import build_tree, tree_segment
from test_cache import AXES
from test_dense import forward, hf_logits
from test_sampling import chi2_pvalue, exact_levels

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, max_position_embeddings=512,
            hidden_size_per_layer_input=0)
VARIANTS = {
    "31b": dict(attention_k_eq_v=True, num_global_key_value_heads=1, final_logit_softcapping=30.0),
    "e2b": dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, num_kv_shared_layers=2,
                use_double_wide_mlp=True, final_logit_softcapping=30.0),
    "moe": dict(attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True, num_experts=4,
                top_k_experts=2, moe_intermediate_size=16, tie_word_embeddings=False),
}
B, T, RTOL = 2, 13, 5e-4  # RTOL: max |error| / max |logit|


def build_hf(variant: str, seed: int = 0, **overrides):
    cfg = transformers.AutoConfig.for_model("gemma4_text", **{**BASE, **VARIANTS[variant], **overrides})
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    hf = randomize_(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # a buffer, not a parameter: randomize_ does not reach it
        for name, buf in hf.named_buffers():
            if name.endswith("layer_scalar"):
                buf.copy_(0.5 + torch.rand(buf.shape, generator=g))
    return hf.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """variant -> (hf model, path, jaxspec Model, ids [B, T], HF logits [B, T, V])."""
    made = {}

    def make(variant):
        if variant not in made:
            hf = build_hf(variant)
            path = tmp_path_factory.mktemp(f"gemma4_{variant}")
            hf.save_pretrained(path)
            ids = np.random.default_rng(0).integers(0, 128, (B, T))
            made[variant] = (hf, path, jm.load(path, tokenizer=False), ids, hf_logits(hf, ids))
        return made[variant]

    return make


def assert_close(got, ref, err_msg=""):
    scale = np.abs(ref).max()
    assert 1.0 < scale < 40.0  # logits at a scale where the tolerance means something
    err = np.abs(np.asarray(got) - ref).max()
    assert err <= RTOL * scale, f"{err_msg} max error {err:.2e} = {err / scale:.1e} of max |logit| {scale:.2f}"


def test_rope_tables_match_transformers():
    """Each layer type's inv_freq equals transformers' (proportional: a quarter of the pairs rotate, exponents
    over the whole head_dim, divided by `factor`), at bases where a wrong exponent shows."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 5e4},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 2e6,
                               "factor": 2.0}}
    hf_cfg = transformers.AutoConfig.for_model("gemma4_text", **{**BASE, "rope_parameters": rope})
    hf = Gemma4TextRotaryEmbedding(hf_cfg)
    c = gemma4_config_from_dict({**BASE, "model_type": "gemma4_text", "rope_parameters": rope})
    for layer_type, r, D in (("sliding_attention", c.rope_sliding, 16), ("full_attention", c.rope_full, 32)):
        want = getattr(hf, f"{layer_type}_inv_freq").numpy()
        np.testing.assert_allclose(rope_inv_freq(D, r), want, rtol=1e-6, atol=0)
    assert (rope_inv_freq(32, c.rope_full) > 0).sum() == 4


@pytest.mark.parametrize("change,words", [
    (dict(num_kv_shared_layers=6), "no layer that computes"),
    (dict(use_bidirectional_attention="all"), "non-causal"),
    (dict(hidden_activation="silu"), "hidden_activation"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
                           "full_attention": {"rope_type": "default", "rope_theta": 1e6}}), "rope_type .linear."),
    (dict(enable_moe_block=True), "enable_moe_block needs"),
])
def test_bad_configs(change, words):
    with pytest.raises(ConfigError, match=words):
        gemma4_config_from_dict({**BASE, "model_type": "gemma4_text", **change})
    with pytest.raises(ConfigError, match="text_config"):
        gemma4_config_from_dict({"model_type": "gemma4"})


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tiny, variant):
    hf, _, model, ids, ref = tiny(variant)
    c = model.config
    if variant == "e2b":  # the switches really are on: two KV-shared layers own no cache entry
        assert c.kv_source == (0, 1, 2, 3, 3, 2) and len(model.module.init_cache(1, 8).layers) == 4
    if variant in ("31b", "moe"):
        assert c.head_dims == (16, 16, 32) * 2 and c.kv_heads == (2, 2, 1) * 2 and c.attention_k_eq_v
    assert_close(model.logits(ids), ref)


@pytest.mark.parametrize("variant", ["31b", "e2b"])
def test_cached_decode(tiny, variant):
    """Prefill 5 tokens, decode the other 8 one at a time (past the window): every step equals transformers'
    full forward; a second prefill chunk on top of the first equals it too. (The two variants whose caches
    differ: k_eq_v full layers, and KV-shared layers that own no entry.)"""
    _, _, model, ids, ref = tiny(variant)
    m, P = model.module, 5
    pos = np.broadcast_to(np.arange(T), (B, T))
    logits, _, cache = forward(model, ids[:, :P], pos[:, :P], m.init_cache(B, T))
    assert_close(logits, ref[:, :P])
    cache = cache.advance(P)
    chunk = forward(model, ids[:, P:], pos[:, P:], cache)[0]
    assert_close(chunk, ref[:, P:], "second chunk:")
    for t in range(P, T):
        logits, _, cache = forward(model, ids[:, t:t + 1], pos[:, t:t + 1], cache)
        cache = cache.advance(1)
        assert_close(logits[:, 0], ref[:, t], f"decode step {t}:")


def test_left_padding(tiny):
    """Row 0 left-padded by 3 garbage slots (hidden by cache.start) gives the unpadded row's logits, through the
    KV-shared layers and the per-layer inputs too, in prefill and the decode step after it."""
    hf, _, model, ids, _ = tiny("e2b")
    pad, n = 3, T - 3
    tokens = np.stack([np.r_[[7, 7, 7], ids[0, :n]], ids[1]])
    start = np.array([pad, 0])
    pos = np.maximum(np.arange(T)[None] - start[:, None], 0)
    logits, _, cache = forward(model, tokens, pos, model.module.init_cache(B, T + 1).with_start(start))
    nxt = np.array([[11], [12]])
    step = forward(model, nxt, pos[:, -1:] + 1, cache.advance(T))[0]
    ref0 = hf_logits(hf, np.r_[ids[0, :n], nxt[0]][None])[0]
    ref1 = hf_logits(hf, np.r_[ids[1], nxt[1]][None])[0]
    assert_close(logits[0, pad:], ref0[:n])
    assert_close(logits[1], ref1[:T])
    assert_close(step[:, 0], np.stack([ref0[n], ref1[T]]))


def test_multimodal_checkpoint_layout(tiny, tmp_path):
    """A checkpoint as released: a `gemma4` config with the text model in text_config, text weights under
    model.language_model., vision and audio towers beside them, and k/v projections still written for the
    KV-shared layers; the target ignores those and gives the same logits."""
    from safetensors.numpy import load_file, save_file

    _, src, model, ids, ref = tiny("e2b")
    tensors = {"model.language_model." + k[len("model."):]: v for k, v in load_file(src / "model.safetensors").items()}
    assert not any(".layers.4.self_attn.k_proj" in k for k in tensors)  # transformers writes none ...
    tensors |= {"model.language_model.layers.4.self_attn.k_proj.weight": np.zeros((32, 64), np.float32),
                "model.language_model.layers.5.self_attn.v_proj.weight": np.zeros((32, 64), np.float32),
                "model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight": np.zeros((4, 4), np.float32),
                "model.audio_tower.layers.0.norm.weight": np.zeros(4, np.float32),
                "model.embed_vision.embedding_projection.weight": np.zeros((4, 4), np.float32)}
    dst = tmp_path / "vlm"
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    text = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": text, "vision_config": {},
                                                 "audio_config": {}, "eos_token_id": [1, 106]}))
    vlm = jm.load(dst, tokenizer=False)
    assert vlm.config.model_type == "gemma4" and vlm.config.eos_token_ids == (1, 106)
    np.testing.assert_array_equal(vlm.logits(ids), model.logits(ids))


def write_gemma4_gguf(hf, path):
    """Write a HF Gemma 4 the way llama.cpp's converter (Gemma4Model) does, in float32: names from gguf's own
    tensor map, the router's scale and per-expert scale as `.scale` tensors, per-layer arrays for the KV heads
    and MLP widths, and proportional RoPE as a `rope_freqs` tensor (1 = rotated pair, 1e30 = not)."""
    import gguf

    c, sd = hf.config, {k: v.numpy() for k, v in hf.state_dict().items()}
    L, swa = c.num_hidden_layers, [t == "sliding_attention" for t in c.layer_types]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, L)
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_vocab_size(c.vocab_size)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(L)
    shared = L - c.num_kv_shared_layers
    w.add_feed_forward_length([c.intermediate_size * (2 if c.use_double_wide_mlp and i >= shared else 1)
                               for i in range(L)])
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.per_layer_config[i].num_key_value_heads for i in range(L)])
    D, D_swa = c.per_layer_config[swa.index(False)].head_dim, c.per_layer_config[swa.index(True)].head_dim
    w.add_key_length(D)
    w.add_key_length_swa(D_swa)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_sliding_window(c.sliding_window)
    w.add_sliding_window_pattern(swa)
    w.add_shared_kv_layers(c.num_kv_shared_layers)
    w.add_embedding_length_per_layer_input(c.hidden_size_per_layer_input)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
    if c.final_logit_softcapping:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if c.enable_moe_block:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.top_k_experts)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    n_rot = int(D * c.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * n_rot + [1e30] * (D // 2 - n_rot), np.float32))
    for name, t in sd.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.router\.(scale|per_expert_scale)", name)
        if m:
            part = "ffn_gate_inp" if m[2] == "scale" else "ffn_down_exps"
            w.add_tensor(f"blk.{m[1]}.{part}.scale", np.ascontiguousarray(t))
            continue
        base, suffix = (name[: -len(".weight")], ".weight") if name.endswith(".weight") else (name, ".weight")
        w.add_tensor(names.get_name(base) + suffix, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_matches_transformers(tmp_path):
    """A GGUF of a model with every switch on (PLE, shared KV with double-wide MLPs, k_eq_v, MoE, soft-capping,
    untied head) as llama.cpp writes it loads to transformers' logits."""
    hf = build_hf("e2b", seed=2, **VARIANTS["moe"])
    write_gemma4_gguf(hf, tmp_path / "tiny.gguf")
    model = jm.load(tmp_path / "tiny.gguf", tokenizer=False)
    c = model.config
    assert c.kv_source == (0, 1, 2, 3, 3, 2) and c.attention_k_eq_v and c.use_double_wide_mlp and c.num_experts == 4
    assert c.rope_full.partial_rotary_factor == 0.25 and c.vocab_size_per_layer_input == 128
    ids = np.random.default_rng(0).integers(0, 128, (B, T))
    assert_close(model.logits(ids), hf_logits(hf, ids))


# ------------------------------------------------------------------------------------- engine

ENGINE = dict(BASE, model_type="gemma4_text", num_hidden_layers=4, max_position_embeddings=1024, eos_token_id=None,
              bos_token_id=None, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
              **{**VARIANTS["e2b"], **VARIANTS["moe"]})  # every switch: PLE, shared KV, k_eq_v, MoE, softcap
PROMPT = [int(t) for t in np.random.RandomState(0).randint(0, 128, 13)]
NEW = 96


@pytest.fixture(scope="module")
def target():
    """Layers 2 and 3 read layers 0 and 1's K/V. Weights scaled up so logits are peaked and greedy ties rare."""
    cfg = gemma4_config_from_dict(ENGINE)
    assert cfg.kv_source == (0, 1, 0, 1) and cfg.enable_moe_block and cfg.hidden_size_per_layer_input
    m = jaxspec.random_model(cfg, seed=0)
    m.params = jax.tree.map(lambda x: x * 2.0, m.params)
    return m


@pytest.fixture(scope="module")
def ar_ref(target):
    return jaxspec.generate(target, input_ids=PROMPT, method="ar", max_new_tokens=NEW).token_ids


def path_of(tokens, parents, i):
    out = [int(tokens[i])]
    while i:
        i = int(parents[i])
        out.append(int(tokens[i]))
    return out[::-1]


def test_logical_axes(target):
    """Every parameter of the every-switch target (PLE tables on the `per_layer` axis, router, fused experts, the
    scalar `layer_scalar` with no axis) names one known logical axis per dimension."""
    for path, var in nnx.to_flat_state(target.params):
        axes = var.get_metadata().get("out_sharding")
        assert axes is not None and len(axes) == var.ndim and set(axes) <= AXES, (path, axes, var.shape)


def test_tree_oracle_budget_64(target):
    """A DDTree of 64 nodes (wide, then deep past the window) verified in one forward: every node's logits
    equal a causal forward over prefix + path(node). The verify runs the ragged expert path (130 pairs), the
    causal references the gathered one for short rows, so the two expert paths agree too."""
    rng = np.random.RandomState(40)
    D, V = 15, 128
    draft = 0.5 * rng.randn(D, V).astype(np.float32)
    draft[0, rng.choice(V, 3, replace=False)] += 4.0
    draft[np.arange(1, D), rng.randint(0, V, D - 1)] += 6.0
    tree = build_tree(jnp.asarray(draft), 64)
    tokens = tree.tokens.at[0].set(PROMPT[-1])
    prefix = PROMPT[:-1]
    L = len(prefix)

    @jax.jit
    def verify(params, tokens):
        m = nnx.merge(target.graphdef, params)
        _, _, cache = m(jnp.asarray([prefix]), Segment.causal(jnp.arange(L)[None]), m.init_cache(1, 128))
        return m(tokens[None], tree_segment(tree, L), cache.advance(L))[0]

    logits = verify(target.params, tokens)
    toks, parents, depths, valid = (np.asarray(a) for a in (tokens, tree.parents, tree.depths, tree.valid))
    assert depths.max() >= 9 and (depths == 1).sum() >= 2  # deeper than the window (8), and branching
    rows = [prefix + path_of(toks, parents, i) for i in np.flatnonzero(valid)]
    width = max(map(len, rows))
    want = target.logits([r + [0] * (width - len(r)) for r in rows])[np.arange(len(rows)), [len(r) - 1 for r in rows]]
    np.testing.assert_allclose(np.asarray(logits[0, valid]), want, atol=RTOL * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 64)])
def test_lossless_greedy_oracle(target, ar_ref, method, budget):
    d = oracle_drafter(target, PROMPT + ar_ref, noise=0.3, max_rank=3)
    res = jaxspec.generate(target, input_ids=PROMPT, drafter=d, method=method, budget=budget, max_new_tokens=NEW)
    assert res.token_ids == ar_ref
    assert res.stats["acceptance_length"] > 1.5


def test_lossless_greedy_random_drafter(target, ar_ref):
    """`init_drafter` fits a Gemma 4 target (the sliding layers' heads, the full layers' RoPE base); DDTree
    with its random proposals stays lossless. (A DDTree at budget 64 with a random drafter: test_load_zlab_drafter.)"""
    d = jaxspec.init_drafter(target, num_layers=1, block_size=8, seed=3)
    c = d.config
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rope.theta) == (4, 2, 16, 1e6)
    res = jaxspec.generate(target, input_ids=PROMPT, drafter=d, method="ddtree", budget=64, max_new_tokens=32)
    assert res.token_ids == ar_ref[:32]


def test_lossless_sampling(target):
    """DDTree sampling on the shared-KV + MoE target: the first 3 committed tokens follow the target's exact
    filtered distribution (chi-square over 400 fixed seeds, p > 1e-3), with draft nodes accepted often."""
    model = target
    sp = SamplingParams(temperature=0.6, top_k=12, top_p=0.95)
    greedy = jaxspec.generate(model, input_ids=PROMPT, max_new_tokens=8).token_ids
    d = oracle_drafter(model, PROMPT + greedy, noise=0.5, max_rank=2, block_size=4)
    samples, accepted = [], 0
    for seed in range(400):
        r = jaxspec.generate(model, input_ids=PROMPT, drafter=d, method="ddtree", budget=8, max_new_tokens=3,
                             temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, seed=seed)
        samples.append(r.token_ids)
        accepted += r.stats["accepted_length_histogram"][0] == 0
    assert accepted > 100, accepted
    for i, (_, w, cond) in enumerate(exact_levels(model, sp, 3, PROMPT)):
        probs = w @ cond
        assert chi2_pvalue(np.array([t[i] for t in samples]), probs) > 1e-3, f"token {i + 1}"


def test_load_zlab_drafter(tmp_path, target, ar_ref):
    """A drafter checkpoint in z-lab's layout with the fields of the released gemma-4-31B-it-DFlash config
    (5 layers, 4 sliding + 1 full with their window, heads x head_dim wider than hidden, 2 x hidden MLP, 6 taps,
    block 16, mask token 4, the target's soft-cap repeated), scaled down: it loads, maps every tensor, and
    its random proposals in a budget-64 DDTree stay lossless."""
    from safetensors.numpy import save_file

    H, nH, nKV, hd, I, n = 64, 8, 2, 16, 128, 5
    taps = [0, 1, 1, 2, 2, 3]  # the released [1, 12, 23, 35, 46, 57] of 60, on 4 layers
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H, "intermediate_size": I,
           "num_hidden_layers": n, "num_attention_heads": nH, "num_key_value_heads": nKV, "head_dim": hd,
           "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 1024, "vocab_size": 128,
           "attention_bias": False, "tie_word_embeddings": False, "sliding_window": 8, "use_sliding_window": True,
           "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "final_logit_softcapping": 30.0,
           "block_size": 16, "num_target_layers": 4, "dflash_config": {"mask_token_id": 4, "target_layer_ids": taps}}
    rng = np.random.RandomState(0)
    shapes = {"fc.weight": (H, len(taps) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(n):
        shapes |= {f"layers.{i}.{k}": s for k, s in {
            "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
            "self_attn.q_proj.weight": (nH * hd, H), "self_attn.k_proj.weight": (nKV * hd, H),
            "self_attn.v_proj.weight": (nKV * hd, H), "self_attn.o_proj.weight": (H, nH * hd),
            "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,), "mlp.gate_proj.weight": (I, H),
            "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}.items()}
    tensors = {k: (1.0 + 0.1 * rng.randn(*s) if "norm" in k else 0.1 * rng.randn(*s)).astype(np.float32)
               for k, s in shapes.items()}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    d = jaxspec.load_drafter(tmp_path, target)
    c = d.config
    assert (c.block_size, c.mask_token_id, c.target_layer_ids, c.sliding_window) == (16, 4, tuple(taps), 8)
    assert c.is_sliding == (True,) * 4 + (False,)
    np.testing.assert_array_equal(np.asarray(d.module.layers[4].self_attn.o_proj.weight()),
                                  tensors["layers.4.self_attn.o_proj.weight"].T)
    res = jaxspec.generate(target, input_ids=PROMPT, drafter=d, method="ddtree", budget=64, max_new_tokens=32)
    assert res.token_ids == ar_ref[:32]
