"""jaxspec.tree against the reference best-first heap (DDTree's build_ddtree_tree, rewritten on numpy)."""
from __future__ import annotations

import functools
import heapq

import jax
import numpy as np
import pytest

from jaxspec.tree import Tree, add_chain, ancestor_mask, build_chain, build_tree, prune


def build_tree_heap(draft_logits: np.ndarray, budget: int):
    """Reference: pop the best prefix, push its next sibling and its first child, `budget` times.

    Returns (tokens, parents, depths, scores) of the non-root nodes in pop order; node i (1-based) has
    parent index parents[i-1] (0 = root). Ties pop by the rank tuple, so the output is deterministic.
    """
    D, V = draft_logits.shape
    K = min(budget, V)
    x = draft_logits.astype(np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    tok = np.argsort(-logp, axis=-1, kind="stable")[:, :K]  # [D, K]
    lp = np.take_along_axis(logp, tok, -1)
    heap = [(-lp[0, 0], (0,), 0, 1, 0, lp[0, 0])]  # (-logw, ranks, parent, depth, rank, logw)
    nodes = []  # (token, parent, depth, score)
    while heap and len(nodes) < budget:
        _, ranks, parent, depth, rank, logw = heapq.heappop(heap)
        nodes.append((tok[depth - 1, rank], parent, depth, logw))
        i = len(nodes)
        if rank + 1 < K:
            w = logw - lp[depth - 1, rank] + lp[depth - 1, rank + 1]
            heapq.heappush(heap, (-w, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, w))
        if depth < D:
            w = logw + lp[depth, 0]
            heapq.heappush(heap, (-w, ranks + (0,), i, depth + 1, 0, w))
    return tuple(np.array(col) for col in zip(*nodes))


@functools.cache
def jit_build(budget: int):
    return jax.jit(functools.partial(build_tree, budget=budget))


def host(tree: Tree) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in vars(tree).items()}


def paths(tokens, parents) -> list[tuple[int, ...]]:
    """Token path root -> node for each node (index 0 = root, path ())."""
    out = [()]
    for t, p in zip(tokens[1:], parents[1:]):
        assert p < len(out), "parent after child"
        out.append(out[p] + (int(t),))
    return out


def host_ancestor_mask(parents: np.ndarray) -> np.ndarray:
    n = len(parents)
    vis = np.eye(n, dtype=bool)
    for i in range(n):
        j = i
        while j != 0:
            j = parents[j]
            vis[i, j] = True
    return vis


def check_structure(t: dict, budget: int, num_valid: int):
    """Shapes, root conventions, BFS numbering, prefix closure and the ancestor mask."""
    n = budget + 1
    assert all(v.shape == (n,) for v in t.values())
    assert (t["parents"][0], t["depths"][0], t["valid"][0], t["scores"][0]) == (0, 0, True, 0.0)
    v, par = t["valid"], t["parents"]
    assert v.sum() == num_valid + 1 and v[: num_valid + 1].all()  # invalid nodes come last
    i = np.arange(1, n)
    assert (par[1:] < i).all()
    assert (t["depths"][1:] == t["depths"][par[1:]] + 1).all()
    assert v[par[v]].all()  # prefix-closed
    assert (np.diff(t["depths"][v]) >= 0).all()  # BFS
    assert np.isneginf(t["scores"][~v]).all() and (t["scores"][v] <= t["scores"][par[v]]).all()
    mask = np.asarray(ancestor_mask(Tree(**t)))
    np.testing.assert_array_equal(mask, host_ancestor_mask(par))
    assert (mask[~v].sum(1) == 2).all() and mask[~v, 0].all()  # an invalid node sees only the root and itself


def check_against_heap(logits: np.ndarray, budget: int):
    D, V = logits.shape
    t = host(jit_build(budget)(logits))
    h_tok, h_par, h_dep, h_score = build_tree_heap(logits, budget)
    possible = sum(min(V, budget) ** d for d in range(1, D + 1))
    assert len(h_tok) == min(budget, possible)
    check_structure(t, budget, len(h_tok))
    v = t["valid"]
    got = {p: s for p, s, ok in zip(paths(t["tokens"], t["parents"]), t["scores"], v) if ok}
    assert len(got) == v.sum()  # no path kept twice
    want = dict(zip(paths(np.r_[0, h_tok], np.r_[0, h_par]), np.r_[0.0, h_score]))
    assert got.keys() == want.keys()
    np.testing.assert_allclose([got[p] for p in want], list(want.values()), rtol=1e-5, atol=1e-4)
    assert [len(p) for p in want] == list(np.r_[0, h_dep])
    assert (t["depths"][v] == [len(p) for p in got]).all()


@pytest.mark.parametrize("budget", [1, 2, 4, 16, 64, 100])
@pytest.mark.parametrize("D,V", [(15, 128), (4, 50)])
def test_matches_heap(D, V, budget):
    for seed in range(3):
        rng = np.random.default_rng(seed)
        scale = rng.uniform(0.5, 4.0, (D, 1))  # mixes sharp and flat rows
        check_against_heap((rng.standard_normal((D, V)) * scale).astype(np.float32), budget)


@pytest.mark.parametrize("budget", [1, 2, 3, 6])
def test_rows_below_the_budget_never_matter(budget):
    """A tree of `budget` nodes is at most `budget` deep, so the engine drafts only min(budget, D) rows: the
    tree from those rows alone is the tree from all of them. Peaked rows make deep spines likely."""
    for seed in range(4):
        rng = np.random.default_rng(seed)
        logits = (rng.standard_normal((7, 40)) * rng.uniform(2.0, 20.0, (7, 1))).astype(np.float32)
        full, cut = host(jit_build(budget)(logits)), host(jit_build(budget)(logits[:budget]))
        for f in ("tokens", "parents", "depths", "valid"):
            np.testing.assert_array_equal(full[f], cut[f])
        np.testing.assert_allclose(full["scores"], cut["scores"], rtol=1e-6)


def test_budget_above_possible():
    check_against_heap(np.random.default_rng(7).standard_normal((2, 3)).astype(np.float32), 16)  # 3 + 9 paths


def test_masked_vocab():
    """-inf logits are zero-probability tokens: the tree is the heap's on the finite columns, padded invalid."""
    logits = np.random.default_rng(8).standard_normal((3, 10)).astype(np.float32)
    logits[:, 2:] = -np.inf
    t = host(jit_build(16)(logits))
    check_structure(t, 16, 2 + 4 + 8)
    h_tok, h_par, _, h_score = build_tree_heap(logits[:, :2], 16)
    got = {p for p, ok in zip(paths(t["tokens"], t["parents"]), t["valid"]) if ok}
    assert got == set(paths(np.r_[0, h_tok], np.r_[0, h_par]))
    np.testing.assert_allclose(np.sort(t["scores"][t["valid"]]), np.sort(np.r_[0.0, h_score]), rtol=1e-5)


@pytest.mark.parametrize("budget", [1, 5, 16])
def test_draft_vocabulary_columns(budget):
    """Logits over a draft vocabulary (column j is token ids[j], ids unsorted) give the heap's tree over the
    full vocabulary with -inf outside it: the same token paths and scores, for the tree and for the chain."""
    rng = np.random.default_rng(9)
    V, ids = 300, rng.choice(300, 40, replace=False)
    narrow = (rng.standard_normal((6, 40)) * rng.uniform(0.5, 4.0, (6, 1))).astype(np.float32)
    full = np.full((6, V), -np.inf, np.float32)
    full[:, ids] = narrow
    t = host(jax.jit(build_tree, static_argnums=1)(narrow, budget, ids))
    h_tok, h_par, _, h_score = build_tree_heap(full, budget)
    want = dict(zip(paths(np.r_[0, h_tok], np.r_[0, h_par]), np.r_[0.0, h_score]))
    got = dict(zip(paths(t["tokens"], t["parents"]), t["scores"]))
    assert got.keys() == want.keys()
    np.testing.assert_allclose([got[p] for p in want], list(want.values()), rtol=1e-5, atol=1e-5)
    chain = host(jax.jit(build_chain)(narrow, ids))
    np.testing.assert_array_equal(chain["tokens"], np.r_[0, full.argmax(-1)])


def test_peaked_gives_spine_flat_gives_fan():
    rng = np.random.default_rng(1)
    D, V, budget = 15, 128, 16
    peaked = rng.standard_normal((D, V)).astype(np.float32)
    peaked[np.arange(D), rng.integers(0, V, D)] += 30.0
    t = host(jit_build(budget)(peaked))
    assert t["depths"].max() == D  # the whole argmax chain, plus a fan of second choices near the root
    chain = host(build_chain(peaked))
    assert paths(chain["tokens"], chain["parents"])[-1] in set(paths(t["tokens"], t["parents"]))
    flat = (0.01 * rng.standard_normal((D, V))).astype(np.float32)
    t = host(jit_build(budget)(flat))
    assert (t["depths"][1:] == 1).all()


def test_chain():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((15, 128)).astype(np.float32)
    t = host(jax.jit(build_chain)(logits))
    np.testing.assert_array_equal(t["tokens"], np.r_[0, logits.argmax(-1)])
    np.testing.assert_array_equal(t["parents"], np.r_[0, np.arange(15)])
    np.testing.assert_array_equal(t["depths"], np.arange(16))
    assert t["valid"].all()
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(t["scores"], np.r_[0.0, np.cumsum(lp.max(-1))], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(ancestor_mask(Tree(**t))), np.tri(16, dtype=bool))


@pytest.mark.parametrize("budget", [16, 64])
def test_exact_ties(budget):
    """Heavily tied logits: still a prefix-closed tree of the right size, the same scores as the heap
    (which tied paths are kept may differ), and the same output on a second call."""
    D, V = 4, 50
    logits = np.random.default_rng(3).integers(0, 3, (D, V)).astype(np.float32)
    logits[1] = 0.0  # a fully flat row
    logits[2, 7] = 100.0  # log-prob exactly 0 in float32: depth-3 children tie their parents
    a, b = host(jit_build(budget)(logits)), host(jit_build(budget)(logits))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    check_structure(a, budget, budget)
    _, _, _, h_score = build_tree_heap(logits, budget)
    np.testing.assert_allclose(np.sort(a["scores"][1:]), np.sort(h_score), rtol=1e-5, atol=1e-5)
    assert len(set(paths(a["tokens"], a["parents"]))) == budget + 1  # no path kept twice


def chain_case(seed: int, budget: int = 6, D: int = 5, V: int = 6):
    """A drafter tree and a chain that follows one of its paths for a while, then leaves it. Seeds from 12 on:
    one possible token per depth, never 0, so the tree has fewer than `budget` paths and an invalid padding node
    (token 0 at depth 1), and the chain starts with token 0."""
    rng, sparse = np.random.default_rng(seed), seed >= 12
    logits = (rng.standard_normal((D, V)) * 2.0).astype(np.float32)
    if sparse:
        logits[:] = -np.inf
        logits[np.arange(D), rng.integers(1, V, D)] = 0.0
    tree = jit_build(budget)(logits)
    t = host(tree)
    assert t["valid"].all() != sparse
    nodes = paths(t["tokens"], t["parents"])
    follow = [] if sparse else list(nodes[rng.integers(0, budget + 1)])[: rng.integers(0, D + 1)]
    chain = np.array(follow + list(rng.integers(0, V, D - len(follow))), np.int32)
    if sparse:
        chain[0] = 0
    count = int(rng.integers(int(sparse), D + 1))
    logprobs = np.log(rng.uniform(0.05, 0.99, D)).astype(np.float32)
    return tree, chain, count, logprobs


@pytest.mark.parametrize("seed", range(16))
def test_add_chain_is_the_union(seed):
    """The merged tree holds the drafter tree's paths and the chain's prefixes, each once, with the higher of
    its two scores (a chain prefix scores its log-probs' sum)."""
    tree, chain, count, lp = chain_case(seed)
    t, m = host(tree), host(jax.jit(add_chain)(tree, chain, count, lp))
    want = {p: s for p, s, ok in zip(paths(t["tokens"], t["parents"]), t["scores"], t["valid"]) if ok}
    for i in range(1, count + 1):
        p = tuple(int(x) for x in chain[:i])
        want[p] = max(want.get(p, -np.inf), float(lp[:i].sum()))
    v = m["valid"]
    got = [(p, s) for p, s, ok in zip(paths(m["tokens"], m["parents"]), m["scores"], v) if ok]
    assert len(got) == len(want) and dict(got).keys() == want.keys()  # no path twice
    np.testing.assert_allclose([s for _, s in got], [want[p] for p, _ in got], rtol=1e-5)
    assert (m["depths"][v] == [len(p) for p, _ in got]).all()
    assert (m["parents"][1:] < np.arange(1, len(v))).all() and v[m["parents"][v]].all()
    assert (m["scores"][v] <= m["scores"][m["parents"][v]]).all()


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("budget", [1, 3, 6])
def test_prune_keeps_the_best(seed, budget):
    """prune(b) keeps b of the merged tree's paths, prefix-closed, none scoring below one it dropped."""
    tree, chain, count, lp = chain_case(seed)
    merged = jax.jit(add_chain)(tree, chain, count, lp)
    m, p = host(merged), host(jax.jit(prune, static_argnums=1)(merged, budget))
    before = {q: s for q, s, ok in zip(paths(m["tokens"], m["parents"]), m["scores"], m["valid"]) if ok}
    kept = {q: s for q, s, ok in zip(paths(p["tokens"], p["parents"]), p["scores"], p["valid"]) if ok}
    assert all(v.shape == (budget + 1,) for v in p.values())
    assert len(kept) == min(budget, len(before) - 1) + 1 and kept.keys() <= before.keys()
    assert all(q[:-1] in kept for q in kept if q)  # prefix-closed
    assert all(kept[q] == before[q] for q in kept)
    dropped = [s for q, s in before.items() if q not in kept]
    assert not dropped or min(s for q, s in kept.items() if q) >= max(dropped)
    depth_of = [len(q) for q, ok in zip(paths(p["tokens"], p["parents"]), p["valid"]) if ok]
    assert (p["depths"][p["valid"]] == depth_of).all()
