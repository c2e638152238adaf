"""The speculative engine on a hybrid GDN target: tree oracle through `build_tree`, lossless greedy DFlash and
DDTree (budgets up to 64) with oracle and random drafters, batched left-padded AR, and the leaky mode's
loss of exactness. The engine is the dense family's: only the target differs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec.models.qwen3_next import hybrid_config_from_dict
from jaxspec.segment import Segment
from jaxspec.testing import oracle_drafter
from jaxspec.tree import build_tree, tree_segment

CFG = dict(model_type="qwen3_5_text", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
           linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, full_attention_interval=3,
           max_position_embeddings=1024, eos_token_id=None, bos_token_id=None,
           rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
PROMPT = [int(t) for t in np.random.RandomState(0).randint(0, 128, 13)]
NEW = 96


def hybrid_target(mode="exact", seed=0):
    """A random GDN, GDN, attention target with peaked logits (weights scaled up) so greedy ties are rare."""
    cfg = hybrid_config_from_dict(CFG).replace(gdn_mode=mode)
    m = jaxspec.random_model(cfg, seed=seed)
    m.params = jax.tree.map(lambda x: x * 2.0, m.params)
    return m


def with_mode(model, mode):
    cfg = model.config.replace(gdn_mode=mode)
    return model.with_config(cfg)


@pytest.fixture(scope="module")
def target():
    return hybrid_target()


@pytest.fixture(scope="module")
def ar_ref(target):
    return jaxspec.generate(target, input_ids=PROMPT, method="ar", max_new_tokens=NEW).token_ids


def path_of(tokens, parents, i):
    out = [int(tokens[i])]
    while i:
        i = int(parents[i])
        out.append(int(tokens[i]))
    return out[::-1]


def test_tree_oracle(target):
    """A DDTree (budget 40, wide then deep) verified in one forward: every node's logits equal a causal
    forward over prefix + path(node)."""
    rng = np.random.RandomState(40)
    D, V = 15, 128
    draft = 0.5 * rng.randn(D, V).astype(np.float32)
    draft[0, rng.choice(V, 3, replace=False)] += 4.0
    draft[np.arange(1, D), rng.randint(0, V, D - 1)] += 6.0
    tree = build_tree(jnp.asarray(draft), 40)
    tokens = tree.tokens.at[0].set(PROMPT[-1])
    prefix = PROMPT[:-1]
    L = len(prefix)

    @jax.jit
    def verify(params, tokens):
        m = nnx.merge(target.graphdef, params)
        _, _, cache = m(jnp.asarray([prefix]), Segment.causal(jnp.arange(L)[None]), m.init_cache(1, 128))
        return m(tokens[None], tree_segment(tree, L), cache.advance(L))[0]

    logits = verify(target.params, tokens)
    toks, parents, depths = np.asarray(tokens), np.asarray(tree.parents), np.asarray(tree.depths)
    valid = np.asarray(tree.valid)
    assert depths.max() >= 3 and (depths == 1).sum() >= 2
    rows = [prefix + path_of(toks, parents, i) for i in np.flatnonzero(valid)]
    T = max(map(len, rows))
    padded = np.array([r + [0] * (T - len(r)) for r in rows])  # right padding never reaches earlier logits
    want = target.logits(padded)[np.arange(len(rows)), [len(r) - 1 for r in rows]]
    np.testing.assert_allclose(np.asarray(logits[0, valid]), want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)])
def test_lossless_greedy_oracle(target, ar_ref, method, budget):
    d = oracle_drafter(target, PROMPT + ar_ref, noise=0.3, max_rank=3)
    res = jaxspec.generate(target, input_ids=PROMPT, drafter=d, method=method, budget=budget, max_new_tokens=NEW)
    assert res.token_ids == ar_ref
    assert res.stats["acceptance_length"] > 1.5


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 16)])
def test_lossless_greedy_random_drafter(target, ar_ref, method, budget):
    d = jaxspec.init_drafter(target, num_layers=1, block_size=8, seed=3)
    res = jaxspec.generate(target, input_ids=PROMPT, drafter=d, method=method, budget=budget, max_new_tokens=32)
    assert res.token_ids == ar_ref[:32]


def test_batched_left_padded_ar(target, ar_ref):
    """A batch of prompts of different lengths (left-padded) gives each row its own AR output."""
    other = PROMPT[4:]
    res = jaxspec.generate(target, input_ids=[PROMPT, other], method="ar", max_new_tokens=24)
    alone = jaxspec.generate(target, input_ids=other, method="ar", max_new_tokens=24).token_ids
    assert res.token_ids == [ar_ref[:24], alone]


def test_leaky_mode_loses_exactness(target, ar_ref):
    """The seed's flat scan over the tree: wide trees leak sibling writes into the GDN state, so the verify
    logits are wrong and the output leaves the target's greedy path (or acceptance collapses)."""
    leaky = with_mode(target, "leaky")
    d = oracle_drafter(target, PROMPT + ar_ref, noise=0.3, max_rank=3)
    exact = jaxspec.generate(target, input_ids=PROMPT, drafter=d, budget=64, max_new_tokens=NEW)
    res = jaxspec.generate(leaky, input_ids=PROMPT, drafter=d, budget=64, max_new_tokens=NEW)
    assert res.token_ids != ar_ref or res.stats["acceptance_length"] < exact.stats["acceptance_length"]
