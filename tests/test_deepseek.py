"""The MLA + MoE family (DeepSeek-V3, a Kimi-K2-shaped model) against transformers, and its own invariants:
both attention forms, the router's expert sets, both expert computations, cached decode, tree oracle, configs.

Every HF weight is randomised, the router's correction bias too (HF initialises it to zero, which would hide
a bias applied to the weights instead of to the selection only).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jaxspec.model as jm
from conftest import randomize_
from jaxspec.config import ConfigError
from jaxspec.models.deepseek import deepseek_config_from_dict
from jaxspec.models.mla import attend_absorbed, attend_expanded
from jaxspec.models.moe import experts_gather, experts_ragged, route
from jaxspec.segment import Segment

B, T, ATOL = 2, 13, 1e-4
DEEPSEEK = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                rope_interleave=True, max_position_embeddings=256,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "mscale": 1.0, "mscale_all_dim": 1.0})
# Kimi K2's shape: no expert groups, routed scale 2.827, YaRN with beta_fast == beta_slow (HF's 0.001 ramp guard),
# rope theta 50000, and a q_proj without q LoRA to cover the small-variant path
KIMI = {**DEEPSEEK, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827, "q_lora_rank": None,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
                            "original_max_position_embeddings": 32, "beta_fast": 1.0, "beta_slow": 1.0,
                            "mscale": 1.0, "mscale_all_dim": 1.0}}
TINY = {"deepseek_v3": DEEPSEEK, "kimi": KIMI}


def build_hf(kind: str):
    import transformers

    cfg = transformers.AutoConfig.for_model("deepseek_v3", **TINY[kind])
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    hf = randomize_(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.3)  # scores are in (0, 1): this reorders them
    return hf.eval()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def tiny_paths():
    """kind -> the save_pretrained directory `tiny` loaded from."""
    return {}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_paths):
    """kind -> (hf model, jaxspec Model loaded from its save_pretrained dir, ids [B, T], HF logits)."""
    made = {}

    def make(kind):
        if kind not in made:
            hf = build_hf(kind)
            path = tmp_path_factory.mktemp(f"tiny_{kind}")
            hf.save_pretrained(path)
            if kind == "kimi":  # Kimi's own model_type, which transformers does not know
                cfg = path / "config.json"
                cfg.write_text(cfg.read_text().replace('"deepseek_v3"', '"kimi_k2"'))
            ids = np.random.default_rng(0).integers(0, 128, (B, T))
            tiny_paths[kind] = path
            made[kind] = (hf, jm.load(path, tokenizer=False), ids, hf_logits(hf, ids))
        return made[kind]

    return make


def with_form(model, absorbed: bool):
    """The same weights with every forward in one attention form (absorb_max_tokens 0 or all)."""
    cfg = model.config.replace(absorb_max_tokens=10**6 if absorbed else 0)
    return model.with_config(cfg)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(graphdef, params, tokens, segment, cache):
    return nnx.merge(graphdef, params)(tokens, segment, cache)


def forward(model, tokens, segment, cache):
    return _forward(model.graphdef, model.params, jnp.asarray(tokens, jnp.int32), segment, cache)


@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("kind", list(TINY))
def test_logits_match_transformers(tiny, kind, absorbed):
    _, model, ids, ref = tiny(kind)
    assert model.config.model_type == ("kimi_k2" if kind == "kimi" else "deepseek_v3")
    assert 1.0 < np.abs(ref).max() < 20.0
    np.testing.assert_allclose(with_form(model, absorbed).logits(ids), ref, rtol=0, atol=ATOL)


def test_absorbed_equals_expanded():
    """The two forms on random inputs over a cache with committed slots, new slots and hidden slots."""
    rng = np.random.default_rng(0)
    cfg = deepseek_config_from_dict({**DEEPSEEK, "model_type": "deepseek_v3"})
    from jaxspec.models.deepseek import mla_spec

    spec = mla_spec(cfg)
    r, dr, nH = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.num_heads
    Bq, N, Tk = 2, 5, 11
    q_nope = jnp.asarray(rng.standard_normal((Bq, N, nH, spec.qk_nope_head_dim)), jnp.float32)
    q_pe = jnp.asarray(rng.standard_normal((Bq, N, nH, dr)), jnp.float32)
    latent = jnp.asarray(rng.standard_normal((Bq, Tk, r + dr)), jnp.float32)
    w_kvb = jnp.asarray(rng.standard_normal((r, nH * (spec.qk_nope_head_dim + spec.v_head_dim))) * 0.3, jnp.float32)
    mask = jnp.asarray(rng.random((Bq, N, Tk)) < 0.6).at[..., 0].set(True)
    a = attend_absorbed(q_nope, q_pe, latent, mask, w_kvb, spec)
    e = attend_expanded(q_nope, q_pe, latent, mask, w_kvb, spec)
    assert a.shape == (Bq, N, nH, spec.v_head_dim)
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", list(TINY))
def test_router_picks_transformers_experts(tiny, kind):
    """Per token, the same expert *set* as HF's router (torch.topk(sorted=False) has no order) and the same weight
    per expert; the biased scores must differ from the unbiased ones in which experts they pick."""
    hf, model, _, _ = tiny(kind)
    x = torch.randn(40, hf.config.hidden_size, generator=torch.Generator().manual_seed(2))
    gate = hf.model.layers[1].mlp.gate
    with torch.no_grad():
        _, w_ref, idx_ref = gate(x)
    p = model.params["layers"][1]["mlp"]["gate"]
    c = model.config
    kw = dict(top_k=c.num_experts_per_tok, n_group=c.n_group, topk_group=c.topk_group,
              norm_topk_prob=c.norm_topk_prob, scaling=c.routed_scaling_factor)
    w, idx = route(jnp.asarray(x.numpy()), p["weight"][...], p["e_score_correction_bias"][...], **kw)
    got = [dict(zip(i.tolist(), v.tolist())) for i, v in zip(np.asarray(idx), np.asarray(w))]
    want = [dict(zip(i.tolist(), v.tolist())) for i, v in zip(idx_ref.numpy(), w_ref.numpy())]
    for t, (g, r) in enumerate(zip(got, want)):
        assert set(g) == set(r), f"token {t}: experts {sorted(g)} vs {sorted(r)}"
        np.testing.assert_allclose([g[e] for e in r], list(r.values()), rtol=1e-5, atol=1e-6)
    _, unbiased = route(jnp.asarray(x.numpy()), p["weight"][...], jnp.zeros_like(p["e_score_correction_bias"][...]),
                        **kw)
    assert any(set(a.tolist()) != set(b.tolist()) for a, b in zip(np.asarray(unbiased), np.asarray(idx)))


def test_expert_paths_agree():
    rng = np.random.default_rng(4)
    E, H, I, Tn, k = 8, 16, 12, 9, 3
    x = jnp.asarray(rng.standard_normal((Tn, H)), jnp.float32)
    gate, up = (jnp.asarray(rng.standard_normal((E, H, I)) * 0.3, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((E, I, H)) * 0.3, jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(Tn)]), jnp.int32)
    w = jnp.asarray(rng.random((Tn, k)), jnp.float32)
    want = sum(w[:, j, None] * jnp.einsum("ti,tih->th", jax.nn.silu(jnp.einsum("th,thi->ti", x, gate[idx[:, j]]))
                                          * jnp.einsum("th,thi->ti", x, up[idx[:, j]]), down[idx[:, j]])
               for j in range(k))
    for run in (experts_gather, experts_ragged):
        np.testing.assert_allclose(np.asarray(run(x, w, idx, gate, up, down)), np.asarray(want), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", list(TINY))
def test_cached_decode(tiny, kind):
    """Prefill 5 tokens in the expanded form, decode the other 8 one at a time in the absorbed form (the default
    choice by N, with absorb_max_tokens 4): every step equals HF's full forward."""
    _, model, ids, ref = tiny(kind)
    cfg = model.config.replace(absorb_max_tokens=4)
    m = model.with_config(cfg)
    P = 5
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits, _, cache = forward(m, ids[:, :P], Segment.causal(pos[:, :P]), m.module.init_cache(B, T))
    np.testing.assert_allclose(logits, ref[:, :P], rtol=0, atol=ATOL)
    cache = cache.advance(P)
    for t in range(P, T):
        logits, _, cache = forward(m, ids[:, t:t + 1], Segment.causal(pos[:, t:t + 1]), cache)
        cache = cache.advance(1)
        np.testing.assert_allclose(logits[:, 0], ref[:, t], rtol=0, atol=ATOL, err_msg=f"decode step {t}")


def test_left_padding_and_bfloat16(tiny, tiny_paths):
    """Row 0 left-padded by 3 garbage slots (cache.start hides them) gives the logits of its unpadded tokens, in
    prefill and the decode step after it; a bfloat16 load stays close to float32 (router kept in float32)."""
    hf, model, ids, ref = tiny("deepseek_v3")
    pad, n = 3, T - 3
    tokens = np.stack([np.r_[[7, 7, 7], ids[0, :n]], ids[1]])
    start = np.array([pad, 0])
    pos = jnp.asarray(np.maximum(np.arange(T)[None] - start[:, None], 0), jnp.int32)
    cache = model.module.init_cache(B, T + 1).with_start(jnp.asarray(start))
    logits, _, cache = forward(model, tokens, Segment.causal(pos), cache)
    nxt = np.array([[11], [12]])
    step, _, _ = forward(model, nxt, Segment.causal(pos[:, -1:] + 1), cache.advance(T))
    ref0 = hf_logits(hf, np.r_[ids[0, :n], nxt[0]][None])[0]
    ref1 = hf_logits(hf, np.r_[ids[1], nxt[1]][None])[0]
    np.testing.assert_allclose(logits[0, pad:], ref0[:n], rtol=0, atol=ATOL)
    np.testing.assert_allclose(logits[1], ref1[:T], rtol=0, atol=ATOL)
    np.testing.assert_allclose(step[:, 0], np.stack([ref0[n], ref1[T]]), rtol=0, atol=ATOL)

    bf16 = jm.load(tiny_paths["deepseek_v3"], dtype="bfloat16", tokenizer=False)
    assert bf16.params["layers"][1]["mlp"]["gate"]["weight"][...].dtype == jnp.float32
    err = np.abs(bf16.logits(ids) - ref).max(-1)  # [B, T]
    # most tokens within bf16 noise; a near-tie in the router may pick another expert for a token or two
    assert (err < 0.05 * np.abs(ref).max()).mean() > 0.8


def test_tree_oracle(tiny):
    """Append 9 nodes of a random tree per row (absorbed form): every node's logits equal HF over prefix + path."""
    hf, model, ids, _ = tiny("deepseek_v3")
    L, N = 6, 9
    rng = np.random.default_rng(1)
    parents = np.stack([[-1] + [int(rng.integers(0, i)) for i in range(1, N)] for _ in range(B)])
    vis = np.broadcast_to(np.eye(N, dtype=bool), (B, N, N)).copy()
    depth = np.zeros((B, N), int)
    for b in range(B):
        for i in range(1, N):
            vis[b, i] |= vis[b, parents[b, i]]
            depth[b, i] = depth[b, parents[b, i]] + 1
    assert depth.max() >= 3
    nodes = rng.integers(0, 128, (B, N))
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    _, _, cache = forward(model, ids[:, :L], Segment.causal(pos), model.module.init_cache(B, L + N))
    seg = Segment(jnp.asarray(L + depth, jnp.int32), jnp.asarray(vis), jnp.asarray(parents, jnp.int32),
                  jnp.full((B,), N, jnp.int32))
    logits, _, _ = forward(model, nodes, seg, cache.advance(L))
    for b in range(B):
        for i in range(N):
            want = hf_logits(hf, np.r_[ids[b, :L], nodes[b, np.flatnonzero(vis[b, i])]][None])[0, -1]
            np.testing.assert_allclose(logits[b, i], want, rtol=0, atol=ATOL, err_msg=f"row {b} node {i}")


def test_kimi_configs():
    """kimi_k2 parses as DeepSeek-V3; kimi_k25 reads its text_config (EOS from the top level); legacy
    rope_scaling becomes YaRN; a rope type the family lacks is refused in one line."""
    text = {**KIMI, "model_type": "kimi_k2"}
    text.pop("rope_parameters")
    text.update(rope_theta=50000.0, max_position_embeddings=262144,
                rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                              "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    k2 = deepseek_config_from_dict(text)
    assert k2.rope.rope_type == "yarn" and k2.rope.factor == 64.0 and k2.rope.theta == 50000.0
    assert k2.n_group == 1 and k2.routed_scaling_factor == 2.827
    k25 = deepseek_config_from_dict({"model_type": "kimi_k25", "text_config": text, "eos_token_id": 163585})
    assert k25.model_type == "kimi_k25" and k25.eos_token_ids == (163585,) and k25.hidden_size == 64
    from jaxspec.models.mla import absorb_threshold, softmax_scale

    assert softmax_scale(k2.rope, 192) == pytest.approx(0.14468, abs=1e-5)  # Kimi K2's real scale (factor 64)
    assert absorb_threshold(512, 128, 128) == 170  # real shapes: decode and a budget-64 verify run absorbed
    with pytest.raises(ConfigError, match="rope_type"):
        deepseek_config_from_dict({**text, "rope_scaling": {"type": "linear", "factor": 2.0}})


def test_checkpoint_layouts(tiny, tiny_paths, tmp_path):
    """The same weights as a Kimi K2.5 VLM checkpoint (language_model.* names, a vision tower, config nested in
    text_config) and with DeepSeek's MTP layer (model.layers.{num_layers}.*, ignored) load to the same model; a
    missing expert slice is reported by name."""
    import json

    from safetensors.numpy import load_file, save_file

    from jaxspec.checkpoint import WeightsError

    _, model, ids, _ = tiny("deepseek_v3")
    src = tiny_paths["deepseek_v3"]
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    L = config["num_hidden_layers"]
    mtp = {k.replace("layers.2.", f"layers.{L}."): v for k, v in tensors.items() if "layers.2." in k}
    mtp[f"model.layers.{L}.enorm.weight"] = np.ones(64, np.float32)
    vlm = {("language_model." + k if k.startswith(("model.", "lm_head")) else k): v
           for k, v in {**tensors, **mtp}.items()}
    vlm["vision_tower.patch_embed.weight"] = np.zeros((2, 2), np.float32)
    (tmp_path / "k25").mkdir()
    save_file(vlm, str(tmp_path / "k25" / "model.safetensors"))
    (tmp_path / "k25" / "config.json").write_text(json.dumps(
        {"model_type": "kimi_k25", "text_config": {**config, "model_type": "kimi_k2"}, "eos_token_id": 1}))
    k25 = jm.load(tmp_path / "k25", tokenizer=False)
    assert k25.config.model_type == "kimi_k25"
    np.testing.assert_array_equal(k25.logits(ids), model.logits(ids))

    (tmp_path / "cut").mkdir()
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.experts.5.up_proj.weight"},
              str(tmp_path / "cut" / "model.safetensors"))
    (tmp_path / "cut" / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match=r"layers\.1\.mlp\.experts\.up_proj\[5\]"):
        jm.load(tmp_path / "cut", tokenizer=False)
