"""Acceptance walk over a verified tree.

Greedy: from the root, follow the child whose token equals the target's argmax at the current node.
Sampling: the same walk, with the target's argmax replaced by one independent target sample per node
(SpecInfer's target-only rule). Each committed token is then an exact sample of the target given the
committed prefix, whatever the draft distributions were; `min(1, p/q)` with draft marginals would be
biased on these trees and is deliberately not used.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.tree import Tree


def accept_walk(tree: Tree, target_tokens, max_depth: int):
    """Walk the tree along `target_tokens` [N], the target's token at every node (its argmax,
    or one independent sample per node).

    max_depth (static) bounds the walk: the deepest node of the tree (SpecSettings.tree_depth).
    Returns (path [D+1] int32: accepted node ids a_0 = 0 (root), a_1 .. a_k, then zeros; k: int32 [],
    the number of accepted draft nodes). The next bonus is target_tokens[path[k]].
    """
    N = tree.tokens.shape[0]
    D = max_depth
    ids = jnp.arange(N)
    # child[i] = the child of node i carrying the target's token at i, if any (siblings' tokens differ)
    match = (tree.parents[None, :] == ids[:, None]) & (tree.tokens[None, :] == target_tokens[:, None])
    match = match & tree.valid[None, :] & (ids[None, :] > 0)
    has_child, child = match.any(axis=1), jnp.argmax(match, axis=1)

    def step(i, carry):
        cur, k, path, alive = carry
        go = alive & has_child[cur]
        cur = jnp.where(go, child[cur], cur)
        path = path.at[i + 1].set(jnp.where(go, cur, 0))
        return cur, k + go.astype(jnp.int32), path, go

    init = (jnp.int32(0), jnp.int32(0), jnp.zeros((D + 1,), jnp.int32), jnp.bool_(True))
    _, k, path, _ = jax.lax.fori_loop(0, D, step, init)
    return path, k
