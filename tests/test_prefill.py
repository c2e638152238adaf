"""Chunked prefill (engine.prefill_forward): a prompt prefilled in chunks leaves the same caches, drafter context
and first token as one forward over it, for rows of different lengths (right padding) and left-padded AR
batches, on every family; a chunk a row has no tokens in changes nothing of it (a GDN state included)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from compiles import compiles, engine_compiles
from jaxspec import engine
from jaxspec.batching import generate_many
from jaxspec.decoder import Decoder, left_pad
from jaxspec.sampling import SamplingParams
from test_batched_spec import FAMILIES
from test_cache import assert_same_cache
from test_engine import tiny_target

# The targets' weights are scaled up (peaked logits), so K/V reach ~10: float32 sums cut at other places differ by
# ~1e-4 there, where a chunk that missed its context would move them by ~1.
ATOL = 1e-3
LENS = (40, 13, 64)  # 64 slots: chunks of 16 -> rows end in chunks 2, 0 and 3


def rows_of(m):
    rng = np.random.default_rng(2)
    return [rng.integers(0, m.config.vocab_size, n).tolist() for n in LENS]


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request):
    return FAMILIES[request.param]()


def real_slots(cache):
    """The cache with every row's left-padding slots zeroed: a pad token sees nothing, so what it writes there is
    garbage that depends on how the forward was cut, and no real token ever reads it."""
    start = np.asarray(cache.start)
    axes = jax.tree.leaves(cache.logical_axes().layers, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))

    def clean(x, spec):
        if "seq" not in spec:
            return x
        seq = tuple(spec).index("seq")
        slot = np.arange(x.shape[seq]).reshape([-1 if i == seq else 1 for i in range(x.ndim)])
        keep = slot >= start.reshape([-1] + [1] * (x.ndim - 1))
        return jnp.where(keep, x, 0)

    leaves = [clean(x, a) for x, a in zip(jax.tree.leaves(cache.layers), axes, strict=True)]
    return dataclasses.replace(cache, layers=jax.tree.unflatten(jax.tree.structure(cache.layers), leaves))


def test_ar_prefill_in_chunks(model):
    tokens, start = left_pad(rows_of(model), 64)
    args = (model.jit_def, model.params, jnp.asarray(tokens), jnp.asarray(start), jax.random.key(0), jnp.int32(8))
    kw = dict(max_len=128, out_len=64, sampling=SamplingParams(), eos=(-1,))
    whole, chunked = engine.ar_prefill(*args, **kw, chunk=64), engine.ar_prefill(*args, **kw, chunk=16)
    assert_same_cache(real_slots(chunked.cache), real_slots(whole.cache), atol=ATOL)
    np.testing.assert_array_equal(np.asarray(chunked.last), np.asarray(whole.last))
    go = lambda s: engine.ar_decode(model.jit_def, model.params, s, jnp.int32(8), sampling=SamplingParams(),  # noqa: E731
                                    eos=(-1,)).out
    np.testing.assert_array_equal(np.asarray(go(chunked)), np.asarray(go(whole)))


def test_spec_prefill_in_chunks(model):
    d = jaxspec.init_drafter(model, num_layers=1, block_size=8, seed=1)
    dc = d.config
    settings = engine.SpecSettings("ddtree", 4, dc.block_size, dc.target_layer_ids, SamplingParams(), (-1,))
    tokens = np.zeros((3, 64), np.int32)
    for b, r in enumerate(rows_of(model)):
        tokens[b, : len(r)] = r
    args = (model.jit_def, model.params, d.jit_def, d.params, jnp.asarray(tokens), jnp.asarray(LENS, jnp.int32),
            jax.random.key(0), jnp.int32(16))
    kw = dict(max_len=256, out_len=96, settings=settings)
    whole, chunked = engine.spec_prefill(*args, **kw, chunk=64), engine.spec_prefill(*args, **kw, chunk=16)
    assert_same_cache(chunked.cache, whole.cache, atol=ATOL)
    assert_same_cache(chunked.draft_cache, whole.draft_cache, atol=ATOL)
    np.testing.assert_array_equal(np.asarray(chunked.bonus), np.asarray(whole.bonus))
    go = lambda s: engine.spec_decode(model.jit_def, model.params, d.jit_def, d.params, s, jnp.int32(16),  # noqa: E731
                                      settings=settings).out
    np.testing.assert_array_equal(np.asarray(go(chunked)), np.asarray(go(whole)))


@pytest.mark.parametrize("family,method", [("qwen3", "ar"), ("gemma3", "ar"), ("qwen3", "ddtree")])
def test_long_refills_share_one_program(family, method):
    """Prompts longer than a prefill chunk (1100 and 2050 tokens: 2 and 3 chunks of 1024) refill a row of a
    continuous batch while a 2100-token row runs on. A speculative refill pads both to the widest prompt the buffer
    holds, so they share one compiled program, and its prefill stops after each prompt's last real chunk; AR keeps a
    program per width. Every answer is the prompt's greedy one alone (DDTree rows at slot 0; AR rows slid to make
    room and the new row placed to end with the running one, Gemma 3's sliding layers in rings)."""
    model = tiny_target(family, max_position_embeddings=4096)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (2100, 3, 1100, 2050)]
    limits = [40, 5, 8, 8]
    d = jaxspec.init_drafter(model, num_layers=1, block_size=8, seed=1) if method == "ddtree" else None
    with compiles() as counted:
        got = generate_many(model, prompts, limits, batch=2, chunk=4, method=method, drafter=d, budget=4)
    refills = {k: v for k, v in engine_compiles(counted).items() if k.endswith("_refill)")}
    assert refills == ({"jit(ar_refill)": 2} if method == "ar" else {"jit(spec_refill)": 1}), counted
    alone = Decoder(model)
    assert got == [alone.tokens(alone.decode(alone.prefill([p], n), n))[0] for p, n in zip(prompts, limits)]
