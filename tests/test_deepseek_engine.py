"""The speculative engine on an MLA + MoE target: tree oracle at budget 64, lossless greedy with oracle and random
drafters (DFlash chain and DDTree up to budget 64), and the Pallas latent commit in the loop.

The prompt (70 tokens) is longer than `absorb_max_tokens` (65), so prefill runs the expanded form while AR decode
and every verify (at most 1 + 64 nodes) run the absorbed one over [cache | tree], as on a real model.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.models.deepseek import deepseek_config_from_dict
from jaxspec.segment import Segment
from jaxspec.testing import oracle_drafter
from jaxspec.tree import build_tree, tree_segment

CONFIG = dict(model_type="deepseek_v3", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16,
              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
              n_group=4, topk_group=2, max_position_embeddings=1024, eos_token_id=None, bos_token_id=None,
              rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                               "original_max_position_embeddings": 256})
PROMPT = [int(t) for t in np.random.RandomState(1).randint(0, 128, 70)]


@pytest.fixture(scope="module")
def target():
    """Peaked logits (weights scaled up) so greedy ties are vanishingly rare; a random correction bias."""
    cfg = deepseek_config_from_dict(CONFIG).replace(absorb_max_tokens=65)
    m = jaxspec.random_model(cfg, seed=0)
    m.params = jax.tree.map(lambda x: x * 2.5, m.params)
    for layer in range(cfg.first_k_dense_replace, cfg.num_layers):
        bias = m.params["layers"][layer]["mlp"]["gate"]["e_score_correction_bias"]
        bias.set_value(jax.random.normal(jax.random.key(layer), bias.shape) * 0.3)
    return m


@pytest.fixture(scope="module")
def ar_ref(target):
    return jaxspec.generate(target, input_ids=PROMPT, method="ar", max_new_tokens=96).token_ids


def path_of(tokens, parents, i):
    out = []
    while i >= 0:
        out.append(int(tokens[i]))
        i = int(parents[i]) if i else -1
    return out[::-1]


def test_tree_oracle_budget_64(target):
    """Every node of a wide and deep 64-node tree: verify logits = a plain causal forward over prefix + path."""
    rng = np.random.RandomState(0)
    D, V = 15, target.config.vocab_size
    draft = 0.5 * rng.randn(D, V).astype(np.float32)
    draft[0, rng.choice(V, 3, replace=False)] += 4.0
    draft[np.arange(1, D), rng.randint(0, V, D - 1)] += 6.0
    tree = build_tree(jnp.asarray(draft), 64)
    tokens = tree.tokens.at[0].set(PROMPT[-1])
    prefix = PROMPT[:-1]
    m, L = target.module, len(prefix)
    _, _, cache = m(jnp.asarray([prefix]), Segment.causal(jnp.arange(L)[None]), m.init_cache(1, 160))
    logits, _, _ = m(tokens[None], tree_segment(tree, L), cache.advance(L))
    assert int(tree.depths.max()) >= 3 and int((tree.depths == 1).sum()) >= 2
    toks, parents, depths, valid = (np.asarray(a) for a in (tokens, tree.parents, tree.depths, tree.valid))
    for depth in np.unique(depths[valid]):
        nodes = np.flatnonzero(valid & (depths == depth))
        want = target.logits([prefix + path_of(toks, parents, i) for i in nodes])[:, -1]
        # the scaled-up weights give logits up to ~17: 1e-3 is float32 noise (6e-5 relative), a wrong mask is O(1)
        np.testing.assert_allclose(np.asarray(logits[0, nodes]), want, atol=1e-3, rtol=0)


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 4), ("ddtree", 64)])
def test_lossless_greedy_oracle(target, ar_ref, method, budget):
    d = oracle_drafter(target, PROMPT + ar_ref, noise=0.3, max_rank=3)
    res = jaxspec.generate(target, input_ids=PROMPT, drafter=d, method=method, budget=budget, max_new_tokens=96)
    assert res.token_ids == ar_ref
    assert res.stats["acceptance_length"] > 1.5


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 16)])
def test_lossless_greedy_random_drafter(target, ar_ref, method, budget):
    d = jaxspec.init_drafter(target, num_layers=1, block_size=8, seed=3)
    res = jaxspec.generate(target, input_ids=PROMPT, drafter=d, method=method, budget=budget, max_new_tokens=48)
    assert res.token_ids == ar_ref[:48]


def test_pallas_latent_commit_in_the_loop(target, ar_ref):
    """Noisy enough that accepted nodes sit off the first-child chain, so the commit really moves rows."""
    d = oracle_drafter(target, PROMPT + ar_ref, noise=0.5, max_rank=3)
    res = jaxspec.generate(target, input_ids=PROMPT, drafter=d, method="ddtree", budget=32, max_new_tokens=48,
                           kv_impl="pallas")
    assert res.token_ids == ar_ref[:48] and res.stats["acceptance_length"] > 2
