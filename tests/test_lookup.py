"""jaxspec.lookup against a plain-Python copy of its rule, on contexts small vocabularies make repetitive."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.lookup import CHAIN_ACCURACY, MAX_NGRAM, chain_logprobs, lookup_chain


def lookup_reference(ctx: list[int], depth: int):
    """The latest earlier occurrence of the longest suffix (MAX_NGRAM..1 tokens), then copy on from there,
    one token at a time, so a copy that runs into the tokens it makes keeps repeating them."""
    for n in range(MAX_NGRAM, 0, -1):
        starts = [j for j in range(len(ctx) - n) if ctx[j:j + n] == ctx[len(ctx) - n:]]
        if starts:
            seq = list(ctx)
            for i in range(depth):
                seq.append(seq[starts[-1] + n + i])
            return seq[len(ctx):], n
    return None, 0


@functools.cache
def jit_lookup(depth: int):
    return jax.jit(functools.partial(lookup_chain, depth=depth))


@pytest.mark.parametrize("vocab", [2, 3, 8, 1000])
@pytest.mark.parametrize("depth", [1, 7])
def test_lookup_matches_reference(vocab, depth):
    rng = np.random.default_rng(vocab + depth)
    H = 40
    for _ in range(50):
        T = int(rng.integers(1, H + 1))
        history = rng.integers(0, vocab, H).astype(np.int32)  # entries past T are junk the lookup must not read
        chain, count, n = jit_lookup(depth)(jnp.asarray(history), T)
        want, want_n = lookup_reference(history[:T].tolist(), depth)
        assert int(n) == want_n
        if want is None:
            assert int(count) == 0
        else:
            assert int(count) == depth and np.asarray(chain).tolist() == want


def test_periodic_context_continues():
    ctx = [5, 1, 2, 3, 1, 2, 3, 1]
    chain, count, n = jit_lookup(7)(jnp.asarray(ctx + [0] * 8, jnp.int32), len(ctx))
    assert (int(count), int(n)) == (7, 4) and np.asarray(chain).tolist() == [2, 3, 1, 2, 3, 1, 2]


def test_chain_logprobs():
    acc = np.asarray(CHAIN_ACCURACY)
    lp = np.asarray(chain_logprobs(jnp.int32(2), acc.shape[1] + 2))
    np.testing.assert_allclose(np.exp(lp), np.r_[acc[1], acc[1, -1], acc[1, -1]], rtol=1e-6)
    assert acc.shape[0] == MAX_NGRAM and ((acc > 0) & (acc < 1)).all()
