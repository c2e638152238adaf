"""Hybrid GDN targets (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against transformers, and tree verification in GDN
layers: the block form (production) against per-node states (the oracle), commit against the oracle's
states, the tree oracle at model level, and the leaky mode really leaking.

Tiny configs after reference/architectures.md §2.9 (hidden 64, 4 layers: GDN, attention, GDN, attention);
every HF weight randomised (conftest.randomize_). Lengths 63/64/65/150 straddle the 64-token chunk.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import jaxspec.model as jm
from conftest import randomize_
from jaxspec.models import gated_deltanet as gdn
from jaxspec.segment import Segment

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, full_attention_interval=2,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
TYPES = {
    "qwen3_next": dict(MOE, norm_topk_prob=True, decoder_sparse_step=1),
    "qwen3_5_text": dict(rope_parameters={**BASE["rope_parameters"], "mrope_section": [1, 1, 0],
                                          "mrope_interleaved": True}),
    "qwen3_5_moe_text": MOE,
}
LENGTHS, B, ATOL = (1, 63, 64, 65, 150), 2, 3e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """model_type -> (hf model, jaxspec Model loaded from its safetensors, ids [B, 150], HF logits)."""
    made = {}

    def make(model_type):
        if model_type not in made:
            cfg = transformers.AutoConfig.for_model(model_type, **{**BASE, **TYPES[model_type]})
            cfg._attn_implementation = "eager"
            torch.manual_seed(0)
            hf = randomize_(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)).eval()
            path = tmp_path_factory.mktemp(model_type)
            hf.save_pretrained(path)
            ids = np.random.default_rng(0).integers(0, 128, (B, max(LENGTHS)))
            made[model_type] = (hf, jm.load(path, tokenizer=False), ids, hf_logits(hf, ids))
        return made[model_type]

    return make


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.numpy()


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(graphdef, params, tokens, segment, cache):
    return nnx.merge(graphdef, params)(tokens, segment, cache)


def causal(model, tokens, positions, cache, lengths=None):
    as_i32 = lambda a: jnp.asarray(np.asarray(a), jnp.int32)  # noqa: E731
    seg = Segment.causal(as_i32(positions), None if lengths is None else as_i32(lengths))
    return _forward(model.graphdef, model.params, as_i32(tokens), seg, cache)


@pytest.mark.parametrize("model_type", list(TYPES))
def test_logits_match_transformers(tiny, model_type):
    """Prefill lengths around the chunk size: the chunked scan (one chunk, exactly one, one + 1, several)."""
    hf, model, ids, ref = tiny(model_type)
    assert model.config.layer_types == ("linear_attention", "full_attention") * 2
    assert 1.0 < np.abs(ref).max() < 20.0
    for T in LENGTHS:
        want = ref[:, :T] if T == max(LENGTHS) else hf_logits(hf, ids[:, :T])
        np.testing.assert_allclose(model.logits(ids[:, :T]), want, rtol=0, atol=ATOL, err_msg=f"length {T}")


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text"])
def test_cached_decode_and_chunked_prefill(tiny, model_type):
    """Prefill 66 tokens (two chunks, the second right-padded with garbage past the real length), then decode
    one at a time: every step equals the full forward. Two prefill chunks equal one prefill, state and all."""
    _, model, ids, ref = tiny(model_type)
    m, P, T = model.module, 66, 72
    pos = np.broadcast_to(np.arange(80), (B, 80))
    padded = np.concatenate([ids[:, :P], np.full((B, 14), 5)], 1)  # 80 slots, 66 real
    logits, _, cache = causal(model, padded, pos, m.init_cache(B, 80), lengths=P)
    np.testing.assert_allclose(logits[:, :P], ref[:, :P], rtol=0, atol=ATOL)
    cache = cache.advance(P)
    for t in range(P, T):
        logits, _, cache = causal(model, ids[:, t:t + 1], pos[:, t:t + 1], cache)
        cache = cache.advance(1)
        np.testing.assert_allclose(logits[:, 0], ref[:, t], rtol=0, atol=ATOL, err_msg=f"decode step {t}")

    c2 = causal(model, ids[:, :40], pos[:, :40], m.init_cache(B, T))[2].advance(40)
    logits2, _, c2 = causal(model, ids[:, 40:T], pos[:, 40:T], c2)
    np.testing.assert_allclose(logits2, ref[:, 40:T], rtol=0, atol=ATOL)
    whole = causal(model, ids[:, :T], pos[:, :T], m.init_cache(B, T))[2].advance(T)
    # states reach ~2.5: float32 sums cut at the chunk boundary move them by ~5e-5 (CPU-dependent), a lost or
    # doubled chunk by ~1
    for a, b in zip(jax.tree.leaves(c2.advance(T - 40).layers), jax.tree.leaves(whole.layers), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-4)


def test_left_padding(tiny):
    """Row 0 is left-padded by 3 garbage tokens (cache.start = 3): they are identity steps for the GDN state
    and conv window, so its logits, in prefill and in the decode step after, are those of the row alone."""
    hf, model, ids, _ = tiny("qwen3_5_text")
    T, pad = 13, 3
    tokens = np.stack([np.r_[[7, 7, 7], ids[0, :T - pad]], ids[1, :T]])
    start = np.array([pad, 0])
    pos = np.maximum(np.arange(T)[None] - start[:, None], 0)
    cache = model.module.init_cache(B, T + 1).with_start(jnp.asarray(start))
    logits, _, cache = causal(model, tokens, pos, cache)
    nxt = np.array([[11], [12]])
    step, _, _ = causal(model, nxt, pos[:, -1:] + 1, cache.advance(T))
    ref0 = hf_logits(hf, np.r_[ids[0, :T - pad], nxt[0]][None])[0]
    ref1 = hf_logits(hf, np.r_[ids[1, :T], nxt[1]][None])[0]
    np.testing.assert_allclose(logits[0, pad:], ref0[:T - pad], rtol=0, atol=ATOL)
    np.testing.assert_allclose(logits[1], ref1[:T], rtol=0, atol=ATOL)
    np.testing.assert_allclose(step[:, 0], np.stack([ref0[T - pad], ref1[T]]), rtol=0, atol=ATOL)


# ---------------------------------------------------------------------------------------------- trees


def random_tree(rng, n, wide):
    """Parents precede children; `wide` hangs every node off any earlier one, else off one of the last two."""
    parents = np.array([-1] + [int(rng.integers(0 if wide else max(0, i - 2), i)) for i in range(1, n)])
    depth, vis = np.zeros(n, int), np.eye(n, dtype=bool)
    for i in range(1, n):
        depth[i], vis[i] = depth[parents[i]] + 1, vis[i] | vis[parents[i]]
    return parents, depth, vis


def random_inputs(rng, Bn, n, H=4, Hk=2, dk=8, dv=8):
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    k = gdn.l2norm(jnp.repeat(r(Bn, n, Hk, dk), H // Hk, axis=2))
    q = gdn.l2norm(jnp.repeat(r(Bn, n, Hk, dk), H // Hk, axis=2)) * dk**-0.5
    g = -jnp.abs(r(Bn, n, H)) * 0.5
    beta = jax.nn.sigmoid(r(Bn, n, H))
    return q, k, r(Bn, n, H, dv), g, beta, r(Bn, H, dk, dv)


@pytest.mark.parametrize("wide", [True, False])
def test_block_form_equals_per_node_states(wide):
    """The production block form (ancestor mask in place of the causal mask, decay summed along paths) gives
    every node's output, u and path decay of the oracle that steps each node from its parent's state; eq. (1)
    over a node's ancestors gives that node's oracle state; the closed-form commit of any accepted path equals
    the oracle state of its last node."""
    rng = np.random.default_rng(int(wide))
    n = 33
    trees = [random_tree(rng, n, wide) for _ in range(2)]
    parents = jnp.asarray(np.stack([t[0] for t in trees]), jnp.int32)
    vis = jnp.asarray(np.stack([t[2] for t in trees]))
    assert max(t[1].max() for t in trees) >= (3 if wide else 10)
    q, k, v, g, beta, S0 = random_inputs(rng, 2, n)
    o, u, gamma = gdn.delta_block(q, k, v, g, beta, vis, S0)
    o_ref, u_ref, gamma_ref, states = gdn.tree_reference(q, k, v, g, beta, parents, S0)
    for got, want in ((o, o_ref), (u, u_ref), (gamma, gamma_ref)):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    for i in (0, 7, n - 1):
        S_i = gdn.state_at(S0, k, u, gamma, vis[:, i], gamma[:, i])
        np.testing.assert_allclose(S_i, states[:, i], rtol=0, atol=2e-5)

    # commit: node `last`'s path, as the engine passes it (padded to a static length)
    last = int(np.argmax(trees[0][1]))
    path = np.flatnonzero(trees[0][2][last])
    padded = np.zeros(n, np.int32)
    padded[:len(path)] = path
    K1 = 3
    x = tuple(jnp.asarray(rng.standard_normal((2, n, C)), jnp.float32) for C in (4, 4, 12))  # q, k, v conv inputs
    pend = gdn.GDNPending(conv=None, state=None, x=x, k=k[:, :, ::2], u=u, gamma=gamma)  # k stored per key head
    windows = (jnp.asarray(rng.standard_normal((2, K1, C)), jnp.float32) for C in (4, 4, 12))
    entry = gdn.GDNEntry(*windows, S0, pend)
    done = entry.commit(jnp.asarray(np.stack([padded, padded])), jnp.full((2,), len(path), jnp.int32), None, "xla")
    np.testing.assert_allclose(done.state[0], states[0, last], rtol=0, atol=2e-5)
    for old, new, xi in zip(entry.conv, done.conv, x, strict=True):
        ext = np.concatenate([np.asarray(old[0]), np.asarray(xi[0, path])])
        np.testing.assert_allclose(new[0], ext[-K1:], rtol=0, atol=0)


def test_chunked_equals_recurrence():
    """The chunked scan (150 tokens: chunks of 64, the last one padded) against the token-by-token step."""
    rng = np.random.default_rng(5)
    q, k, v, g, beta, S0 = random_inputs(rng, 1, 150)
    o, u, gamma, S = gdn.chunked(q, k, v, g, beta, S0)
    S_ref, outs = S0, []
    for t in range(150):
        o_t, _, S_ref = gdn.recurrent_step(S_ref, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append(o_t)
    np.testing.assert_allclose(o, jnp.stack(outs, 1), rtol=0, atol=2e-5)
    np.testing.assert_allclose(S, S_ref, rtol=0, atol=2e-5)
    np.testing.assert_allclose(gamma, jnp.cumsum(g, axis=1), rtol=1e-5, atol=1e-4)


def tree_logits(model, prefix, tokens, parents, depth, vis, max_len=64):
    L = len(prefix)
    _, _, cache = causal(model, np.asarray(prefix)[None], np.arange(L)[None], model.module.init_cache(1, max_len))
    seg = Segment(positions=jnp.asarray(L + depth, jnp.int32)[None], visible=jnp.asarray(vis)[None],
                  parents=jnp.asarray(parents, jnp.int32)[None], lengths=jnp.full((1,), len(tokens), jnp.int32))
    logits = _forward(model.graphdef, model.params, jnp.asarray(tokens, jnp.int32)[None], seg, cache.advance(L))[0]
    return np.asarray(logits[0])


@pytest.mark.parametrize("wide", [True, False])
def test_tree_oracle(tiny, wide):
    """Model level, exact and reference modes: every node's verify logits equal transformers' causal forward
    over prefix + path(node). The leaky mode (one flat scan over the BFS order) does not."""
    hf, model, ids, _ = tiny("qwen3_5_text")
    rng = np.random.default_rng(2 + wide)
    N, prefix = 24, ids[0, :9]
    parents, depth, vis = random_tree(rng, N, wide)
    tokens = rng.integers(0, 128, N)
    want = np.stack([hf_logits(hf, np.r_[prefix, tokens[np.flatnonzero(vis[i])]][None])[0, -1] for i in range(N)])
    for mode in ("exact", "reference"):
        np.testing.assert_allclose(tree_logits(with_mode(model, mode), prefix, tokens, parents, depth, vis), want,
                                   rtol=0, atol=ATOL, err_msg=mode)
    err = np.abs(tree_logits(with_mode(model, "leaky"), prefix, tokens, parents, depth, vis) - want).max(-1)
    chain = np.array([vis[i, :i + 1].all() for i in range(N)])  # nodes whose path is the BFS prefix 0..i
    assert 0 < chain.sum() < N
    assert err[chain].max() < ATOL and err[~chain].min() > 1e-3  # wrong exactly where siblings leak in


def with_mode(model, mode):
    """The same weights with another GDN tree mode (a static switch: a new graphdef)."""
    cfg = model.config.replace(gdn_mode=mode)
    return model.with_config(cfg)


def test_multimodal_checkpoint_layout(tiny, tmp_path):
    """A Qwen3.5 / Qwen3.6 checkpoint as released: `qwen3_5` config with the text model in text_config, text
    weights under model.language_model., plus a vision tower and an MTP head that the target ignores.
    Loads to the same logits; a bfloat16 load stays close."""
    import copy
    import json

    from safetensors.numpy import load_file, save_file

    hf, model, ids, ref = tiny("qwen3_5_text")
    src = tmp_path / "src"
    hf.save_pretrained(src)
    tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in load_file(src / "model.safetensors").items()}
    tensors |= {"model.visual.patch_embed.proj.weight": np.zeros((4, 3), np.float32),
                "mtp.fc.weight": np.zeros((4, 4), np.float32)}
    dst = tmp_path / "vlm"
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    text = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text,
                                                 "vision_config": {}, "tie_word_embeddings": False}))
    vlm = jm.load(dst, tokenizer=False)
    assert vlm.config.model_type == "qwen3_5_text" and not vlm.config.fused_projections
    np.testing.assert_allclose(vlm.logits(ids[:, :65]), ref[:, :65], rtol=0, atol=ATOL)
    # bfloat16: no worse than transformers' own bfloat16 run (the recurrence compounds rounding)
    bf16 = jm.load(dst, dtype="bfloat16", tokenizer=False).logits(ids[:, :65])
    with torch.no_grad():
        hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)(torch.as_tensor(ids[:, :65])).logits.float().numpy()
    assert np.abs(bf16 - ref[:, :65]).max() < 2 * np.abs(hf_bf16 - ref[:, :65]).max()
