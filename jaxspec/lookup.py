"""Prompt lookup: a draft chain copied from the context itself, competing for the tree's budget.

Small targets repeat themselves (lists, code, restated questions), and a repetition is something a
learned drafter predicts poorly but the context spells out. At each round the longest suffix of the
context (at most MAX_NGRAM tokens, the bonus included) is looked up at its latest earlier occurrence, and
the tokens that followed it there form a chain below the root. The chain is not cut at the drafter's block: a
copy is often right far past it, so it reaches as deep as the budget allows (up to MAX_DEPTH nodes, the
verified tree then deeper than the block) and a round inside a repetition commits up to budget + 1 tokens.
Each chain token is scored with how often such a token is right (CHAIN_ACCURACY, by the matched length), the
chain is merged into the drafter's tree (tree.add_chain) and the best `budget` nodes of the union are kept
(tree.prune): the verify costs what it did without lookup, and chain nodes displace only draft nodes less
likely to be accepted. The target verifies whatever is kept, so greedy output stays AR's and sampling keeps
the target's distribution (accept.py's target-only rule accepts from any tree).

Everything has static shapes and no loop: one [MAX_NGRAM, H] comparison against the history buffer finds the
matches of every length at once (XLA:CPU compiles each op as a kernel of its own, and the decode loop is
compiled for every budget, so a few whole-array ops beat a loop of small ones).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_NGRAM = 4  # the longest suffix looked up; shorter ones are tried when it never occurred before

MAX_DEPTH = 32  # the deepest chain: a copy may run far past the drafter's block, as deep as the budget allows

# P(chain token i right | the tokens before it right), row n - 1 for an n-token match, i = 0..15 (deeper
# tokens reuse the last column): measured by bench/cpu/lookup_table.py on SmolLM2-135M-Instruct's greedy answers
# to training prompts (data/smollm2-135m-instruct/selfinstruct4.s0.npz).
CHAIN_ACCURACY = ((0.20, 0.56, 0.63, 0.66, 0.77, 0.78, 0.82, 0.84, 0.80, 0.87, 0.84, 0.93, 0.85, 0.91, 0.86, 0.88),
                  (0.54, 0.64, 0.69, 0.76, 0.79, 0.83, 0.86, 0.84, 0.89, 0.88, 0.91, 0.89, 0.92, 0.90, 0.92, 0.91),
                  (0.62, 0.69, 0.76, 0.80, 0.83, 0.86, 0.84, 0.89, 0.88, 0.91, 0.89, 0.92, 0.90, 0.92, 0.91, 0.95),
                  (0.87, 0.90, 0.92, 0.93, 0.94, 0.94, 0.95, 0.95, 0.96, 0.96, 0.97, 0.97, 0.97, 0.98, 0.98, 0.98))


def lookup_chain(history: jax.Array, n_valid, depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """history [H] int32, its first `n_valid` entries the context (prompt, committed tokens, bonus) ->
    (chain [depth] int32, count int32 [], n int32 []): the tokens that followed the latest earlier occurrence
    of the longest context suffix of n = MAX_NGRAM..1 tokens, as if the text were copied on from there (so a
    copy that reaches the context's end repeats what it copied); count = depth, or count = n = 0 when no
    suffix occurred before (the chain is then junk).
    """
    H = history.shape[0]
    # For every end e of a window history[e - n:e]: does it match the context's last n tokens, n = 1..MAX_NGRAM?
    t = jnp.arange(1, MAX_NGRAM + 1)[:, None]  # [G, 1] offset back from the end
    e = jnp.arange(H)[None, :]  # [1, H] window end (exclusive): the copy starts there
    back = history[jnp.clip(e - t, 0, H - 1)] == history[jnp.clip(n_valid - t, 0, H - 1)]  # [G, H]
    same = jnp.cumprod(back, axis=0).astype(bool) & (e - t >= 0) & (e < n_valid)  # [G, H] row n-1: an n-gram match
    last = jnp.max(jnp.where(same, e, -1), axis=1)  # [G] latest match end per n; -1: none
    found = jnp.max(jnp.where(last >= 0, jnp.arange(1, MAX_NGRAM + 1), 0))  # the longest n that occurred before
    start = jnp.where(found > 0, last[jnp.maximum(found - 1, 0)], 0)
    # Past the context the repetition goes on: a token beyond it copies the one a period (n_valid - start) back.
    idx, period = start + jnp.arange(depth), jnp.maximum(n_valid - start, 1)
    idx = jnp.where(idx < n_valid, idx, n_valid - period + (idx - n_valid) % period)
    return history[idx], jnp.where(found > 0, depth, 0).astype(jnp.int32), found


def chain_logprobs(n, depth: int) -> jax.Array:
    """[depth] log-probability of each chain token given the ones before, for an n-token match (n >= 1)."""
    table = jnp.log(jnp.asarray(CHAIN_ACCURACY, jnp.float32))  # [MAX_NGRAM, 16]
    cols = jnp.minimum(jnp.arange(depth), table.shape[1] - 1)
    return table[jnp.clip(n - 1, 0, MAX_NGRAM - 1), cols]
