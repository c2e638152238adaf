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
from jaxspec import engine
from jaxspec.decoder import left_pad
from jaxspec.sampling import SamplingParams
from test_batched_spec import FAMILIES
from test_cache import assert_same_cache

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
