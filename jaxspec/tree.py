"""Draft trees: DDTree's best-`budget` prefix tree, and the DFlash chain as its degenerate case.

The drafter gives one distribution per depth, `draft_logits [D, V]` (row d is the token at depth d+1
below the root; the columns may be a draft vocabulary's, named by `ids`), and a path's score is the sum
of its per-depth log-probs. DDTree keeps the `budget` highest-scoring paths; because a child never
scores above its parent the set is prefix-closed, i.e. a tree. The reference pops a best-first heap on
the host; here the same set comes from static shapes:

  1. per-depth top-K over the columns once (K = min(budget, V)): a kept depth-d token has rank < K,
     else K siblings would beat it;
  2. a beam per depth, beam_d = top-budget of beam_{d-1} x top-K(d): a kept depth-d node's parent is in
     beam_{d-1}, else `budget` better depth-(d-1) nodes each have a better child;
  3. one global top-budget over all D * budget beam entries.

Ties go to (score desc, depth asc, beam slot asc), which `lax.top_k` (lower index first) gives for free
on a depth-major flattening; as a parent's score is >= its child's and its depth is lower, the parent
always wins, so the selection stays prefix-closed even on exact ties.

Node numbering: root = 0, then the valid nodes in BFS order (depth, then beam slot), so parents precede
children; invalid nodes (only when fewer than `budget` paths have non-zero probability) come last.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from jaxspec.segment import Segment


@jax.tree_util.register_dataclass
@dataclass
class Tree:
    """A draft tree of N nodes, root at index 0 (N = budget + 1, or D + 1 for the chain).

    Root conventions: tokens[0] = 0 for the caller to set (the bonus token), parents[0] = 0
    (the root is its own parent, so gathers through `parents` never leave the array), depths[0] = 0,
    valid[0] = True, scores[0] = 0. An invalid node is padding: token 0, parent 0, depth 1, score -inf;
    it sees only the root and itself, and a walk over children must skip it.
    """

    tokens: jax.Array  # [N] int32: token at each node
    parents: jax.Array  # [N] int32: parent node index; parents[i] < i for i > 0
    depths: jax.Array  # [N] int32: distance from the root (position offset in the verify forward)
    valid: jax.Array  # [N] bool
    scores: jax.Array  # [N] float32: joint draft log-prob of the path root -> node


def root_only(batch: int) -> Tree:
    """The trees of a round that drafts nothing (DDTree budget 0): the root alone per row, fields [batch, 1]. Its
    verify is an AR step, so a batch where no tree pays for its draft and verify decodes as AR does, within the
    speculative state (the drafter's context keeps up, so trees can return when fewer rows run)."""
    one = lambda v, dtype: jnp.full((batch, 1), v, dtype)  # noqa: E731
    return Tree(tokens=one(0, jnp.int32), parents=one(0, jnp.int32), depths=one(0, jnp.int32),
                valid=one(True, bool), scores=one(0.0, jnp.float32))


def ancestor_mask(tree: Tree) -> jax.Array:
    """[N, N] bool, vis[i, j] = j is i or an ancestor of i: the tree-attention mask for verify.

    Pointer doubling: after k rounds `vis` holds ancestors at distance < 2^k and `jump` the 2^k-th
    ancestor (saturating at the root), so ceil(log2 N) gathers cover any depth with static shapes.
    """
    n = tree.parents.shape[0]
    vis, jump = jnp.eye(n, dtype=bool), tree.parents
    for _ in range(max(1, math.ceil(math.log2(n)))):
        vis, jump = vis | vis[jump], jump[jump]
    return vis


def tree_segment(tree: Tree, offset) -> Segment:
    """Trees as one verify forward's segment: a batch of trees (fields [B, N], offset [B]) or one tree (fields [N],
    batch 1). Row b's node i sits at position offset[b] + depth_i and sees its own ancestors; the root continues
    from the committed cache (parent -1)."""
    if tree.parents.ndim == 1:
        tree = jax.tree.map(lambda x: x[None], tree)
    B, N = tree.parents.shape
    parents = jnp.where(jnp.arange(N) == 0, -1, tree.parents)
    offset = jnp.broadcast_to(jnp.asarray(offset, jnp.int32), (B,))
    return Segment(positions=(offset[:, None] + tree.depths).astype(jnp.int32), visible=jax.vmap(ancestor_mask)(tree),
                   parents=parents.astype(jnp.int32), lengths=jnp.full((B,), N, jnp.int32))


def _log_probs_top_k(draft_logits: jax.Array, k: int, ids=None) -> tuple[jax.Array, jax.Array]:
    """Top-k of log_softmax per row without writing out [D, V] log-probs (top-k of logits, minus lse), as
    token ids (column j is token ids[j] when ids [V] is given)."""
    logits = draft_logits.astype(jnp.float32)
    vals, toks = lax.top_k(logits, k)  # [D, k]
    toks = toks if ids is None else jnp.asarray(ids, jnp.int32)[toks]
    return vals - jax.nn.logsumexp(logits, axis=-1, keepdims=True), toks.astype(jnp.int32)


def build_tree(draft_logits: jax.Array, budget: int, ids=None) -> Tree:
    """DDTree: the `budget` highest joint-log-prob draft paths as a tree. draft_logits [D, V] -> N = budget + 1.

    ids [V]: the token id of each column (a drafter's draft vocabulary); None: column v is token v.
    `budget` is static (it fixes every shape). Equal, as a set of paths with their scores, to the reference
    best-first heap (order aside, and up to which of exactly tied paths is kept). Tokens with -inf logits
    have zero probability and never become valid nodes.
    """
    D, V = draft_logits.shape
    W, K = budget, min(budget, V)  # beam width, candidate tokens per depth
    lp, toks = _log_probs_top_k(draft_logits, K, ids)  # [D, K]

    def step(beam, lp_d):  # beam [W] scores of depth d-1 paths; lp_d [K]
        score, idx = lax.top_k((beam[:, None] + lp_d[None, :]).reshape(W * K), W)  # parent-major
        return score, (score, idx // K, idx % K)

    # The root is the only live entry of a width-W "depth 0" beam, so depth 1 is an ordinary step.
    root_beam = jnp.full((W,), -jnp.inf, jnp.float32).at[0].set(0.0)
    _, (beam_score, beam_parent, beam_rank) = lax.scan(step, root_beam, lp)  # each [D, W]

    score, g = lax.top_k(beam_score.reshape(D * W), budget)  # [budget]; g = depth-major flat index into the beams
    # BFS order: valid nodes by (depth, slot) = by g, then invalid ones.
    key = jnp.sort(jnp.where(score > -jnp.inf, g, g + D * W))
    valid, g = key < D * W, key % (D * W)
    score = beam_score.reshape(D * W)[g]
    d, slot = g // W, g % W  # d = depth - 1
    node_of = jnp.zeros((D * W,), jnp.int32).at[g].set(jnp.arange(1, budget + 1, dtype=jnp.int32))
    parent_g = (d - 1) * W + beam_parent[d, slot]  # meaningless at d == 0, masked below
    parents = jnp.where(d == 0, 0, node_of[jnp.maximum(parent_g, 0)])
    tokens = toks[d, beam_rank[d, slot]]

    def cat(root, rest):
        return jnp.concatenate([jnp.asarray(root, rest.dtype)[None], rest])

    return Tree(
        tokens=cat(0, jnp.where(valid, tokens, 0)),
        parents=cat(0, jnp.where(valid, parents, 0)),
        depths=cat(0, jnp.where(valid, d + 1, 1)),
        valid=cat(True, valid),
        scores=cat(0.0, jnp.where(valid, score, -jnp.inf)),
    )


def build_chain(draft_logits: jax.Array, ids=None) -> Tree:
    """DFlash's chain: the argmax token at every depth, each the child of the previous. N = D + 1.
    ids as in `build_tree`."""
    D = draft_logits.shape[0]
    lp, toks = _log_probs_top_k(draft_logits, 1, ids)  # [D, 1]
    i = jnp.arange(D + 1, dtype=jnp.int32)
    return Tree(
        tokens=jnp.concatenate([jnp.zeros((1,), jnp.int32), toks[:, 0]]),
        parents=jnp.maximum(i - 1, 0),
        depths=i,
        valid=jnp.ones((D + 1,), bool),
        scores=jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(lp[:, 0])]),
    )



def add_chain(tree: Tree, chain: jax.Array, count, logprobs: jax.Array) -> Tree:
    """Merge the path root -> chain[0] -> .. -> chain[count - 1] into `tree`. N -> N + M nodes (M = chain length).

    The chain follows the tree's nodes while their tokens agree and becomes new nodes where it leaves it, so
    siblings keep distinct tokens (accept_walk relies on it). logprobs [M]: log-probability of each chain
    token given the previous ones; a chain node scores its path's sum, a node on both keeps the higher score,
    so scores still never grow from parent to child (prune relies on it). Unused slots are invalid padding.
    """
    N, M = tree.tokens.shape[0], chain.shape[0]
    ids, depth = jnp.arange(N), jnp.arange(1, M + 1)  # depth [M]: chain token i sits at depth i + 1
    live = depth <= count  # [M]
    # A tree node is on the chain when every node on its path holds the chain's token at that depth. Siblings'
    # tokens differ, so at most one node per depth is, and they form the chain's longest prefix in the tree.
    d = jnp.clip(tree.depths - 1, 0, M - 1)
    ok = (ids == 0) | (tree.valid & (tree.depths <= count) & (tree.tokens == chain[d]))  # [N]
    on_chain = ~(ancestor_mask(tree) & ~ok[None, :]).any(1)  # [N]
    match = on_chain[None, :] & (tree.depths[None, :] == depth[:, None])  # [M, N]
    matched, node = match.any(1), jnp.argmax(match, axis=1)  # [M]
    new = live & ~matched  # chain tokens past the shared prefix become nodes N + i
    at = jnp.where(matched, node, N + jnp.arange(M)).astype(jnp.int32)  # [M] chain token i's node in the union
    parent = jnp.concatenate([jnp.zeros((1,), jnp.int32), at[:-1]])  # [M] the root, then the previous token's
    path_score = jnp.cumsum(logprobs)  # [M]
    shared = jnp.max(jnp.where(match & live[:, None], path_score[:, None], -jnp.inf), axis=0)  # [N]
    return Tree(tokens=jnp.concatenate([tree.tokens, jnp.where(new, chain, 0)]).astype(jnp.int32),
                parents=jnp.concatenate([tree.parents, jnp.where(new, parent, 0)]),
                depths=jnp.concatenate([tree.depths, jnp.where(new, depth, 1)]).astype(jnp.int32),
                valid=jnp.concatenate([tree.valid, new]),
                scores=jnp.concatenate([jnp.maximum(tree.scores, shared), jnp.where(new, path_score, -jnp.inf)]))


def prune(tree: Tree, budget: int) -> Tree:
    """The `budget` highest-scoring non-root nodes of `tree`, renumbered in their old order. -> N = budget + 1.

    As scores never grow from parent to child and `lax.top_k` breaks ties to the lower index (a parent's),
    the kept set is prefix-closed. Invalid nodes score -inf and are kept only when too few are valid.
    """
    N = tree.tokens.shape[0]
    score = jnp.where(tree.valid, tree.scores, -jnp.inf)[1:]
    _, keep = lax.top_k(score, budget)
    ids = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.sort(keep).astype(jnp.int32) + 1])  # [budget + 1]
    new_id = jnp.zeros((N,), jnp.int32).at[ids].set(jnp.arange(budget + 1, dtype=jnp.int32))
    valid = tree.valid[ids]
    return Tree(tokens=jnp.where(valid, tree.tokens[ids], 0), parents=jnp.where(valid, new_id[tree.parents[ids]], 0),
                depths=jnp.where(valid, tree.depths[ids], 1).at[0].set(0), valid=valid,
                scores=jnp.where(valid, tree.scores[ids], -jnp.inf).at[0].set(0.0))
