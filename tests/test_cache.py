"""Cache conformance: the one promise every cache entry type keeps, whatever it stores.

After a verify forward over a random tree behind a committed prefix and the commit of an accepted path, the
cache equals the cache of a plain causal prefill of prefix + accepted tokens (float32, tight tolerance), and
the next forward's logits agree. Cases: only the root accepted, a path to the deepest node, a random path,
a tree that ends exactly at the end of the cache, and a 32-node chain with side branches accepted whole (a
lookup copy, which reaches past the drafter's block). Right padding in a prefill is never committed.

Written once for every family: a new family adds its tiny targets to `TARGETS` (the comparison reads the
cache's logical axes: buffers with a `seq` axis are compared over the committed slots only, rings (a `window`
axis) over the committed slots they still hold, in slot order, every other buffer, e.g. a recurrent state, in
full). Sliding-window layers' rings are also held to the full-length buffers they replace.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec.cache import KVEntry, RingKVEntry
from jaxspec.config import dense_config_from_dict
from jaxspec.models.deepseek import deepseek_config_from_dict
from jaxspec.models.gemma4 import gemma4_config_from_dict
from jaxspec.models.qwen3_next import hybrid_config_from_dict
from jaxspec.segment import Segment

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
MLA = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
           first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
           max_position_embeddings=512, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                         "original_max_position_embeddings": 128})
PREFIX, NODES, ATOL = 7, 10, 2e-5
# A tree verify against a causal prefill: different summation orders, which the hybrid targets' recurrent
# layers carry into later layers' K/V (3e-5 seen on an AMD EPYC VM); a wrong commit moves rows by 1e-1 or more.
TREE_ATOL = 1e-4
# The next forward's logits: float32 summation order alone moves them by up to 5e-5 on the hybrid targets,
# whose gated norms rescale a small recurrent output (a wrong commit moves them by 1e-2 or more).
LOGIT_ATOL = 1e-4
TARGETS = {
    "llama": lambda: dense_config_from_dict({**BASE, "model_type": "llama"}),
    "qwen3": lambda: dense_config_from_dict({**BASE, "model_type": "qwen3", "tie_word_embeddings": True}),
    "gemma3": lambda: dense_config_from_dict({**BASE, "model_type": "gemma3_text", "num_hidden_layers": 3,
                                              "sliding_window": 4, "sliding_window_pattern": 3,
                                              "query_pre_attn_scalar": 16}),
    # MLA + MoE: verify (10 nodes) runs the absorbed form, the reference prefills of 8+ tokens the expanded one
    "deepseek_v3": lambda: deepseek_config_from_dict({**MLA, "model_type": "deepseek_v3"}).replace(
        absorb_max_tokens=NODES),
    "kimi_k2": lambda: deepseek_config_from_dict({**MLA, "model_type": "kimi_k2", "n_group": 1, "topk_group": 1,
                                                  "routed_scaling_factor": 2.827}),
}
GDN = dict(BASE, num_hidden_layers=3, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
           linear_value_head_dim=8, full_attention_interval=3,  # layers: GDN, GDN, attention
           rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
TARGETS.update({
    "qwen3_5": lambda: hybrid_config_from_dict({**GDN, "model_type": "qwen3_5_text"}),
    "qwen3_next": lambda: hybrid_config_from_dict({**GDN, "model_type": "qwen3_next", "num_experts": 4,
                                                   "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                                   "shared_expert_intermediate_size": 32}),
})
# Gemma 4: sliding (window 4 < the tree's reach) and full layers of different geometry (k_eq_v: 1 KV head of 32);
# layers 2 and 3 read layers 0 and 1's K/V and own no cache entry, so a commit moves 2 entries for 4 layers
TARGETS["gemma4_shared_kv"] = lambda: gemma4_config_from_dict(dict(
    BASE, model_type="gemma4_text", num_hidden_layers=4, global_head_dim=32, num_global_key_value_heads=1,
    attention_k_eq_v=True, sliding_window=4, hidden_size_per_layer_input=0, num_kv_shared_layers=2,
    layer_types=["sliding_attention", "full_attention"] * 2))


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request):
    return jaxspec.random_model(TARGETS[request.param](), seed=1)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def forward(graphdef, params, tokens, segment, cache):
    return nnx.merge(graphdef, params)(tokens, segment, cache)


def prefill(model, tokens, max_len, *, pad_to=None):
    """Causal prefill of tokens [T] (right-padded to pad_to with garbage), committed: the reference cache."""
    T = len(tokens)
    N = pad_to or T
    ids = np.full((1, N), 5, np.int32)
    ids[0, :T] = tokens
    segment = Segment.causal(jnp.arange(N, dtype=jnp.int32)[None], lengths=jnp.int32(T))
    _, _, cache = forward(model.graphdef, model.params, jnp.asarray(ids), segment, model.module.init_cache(1, max_len))
    return cache.advance(T)


def tree_of(parents):
    """Parents (-1 for the root, else an earlier node) -> (parents, depths, host ancestor mask)."""
    n = len(parents)
    depth, vis = np.zeros(n, int), np.eye(n, dtype=bool)
    for i in range(1, n):
        depth[i], vis[i] = depth[parents[i]] + 1, vis[i] | vis[parents[i]]
    return np.asarray(parents), depth, vis


def random_tree(rng, n):
    """A random tree of n nodes, each under one of the two nodes before it (so trees get deep): tree_of's triple."""
    return tree_of([-1] + [int(rng.integers(max(0, i - 2), i)) for i in range(1, n)])


def committed_view(cache):
    """Every buffer of every row of the cache, restricted to the row's committed slots where it has a `seq`
    axis, and for a ring (`window` axis of R slots) to the last R committed slots, oldest first."""
    out = []
    axes = jax.tree.leaves(cache.logical_axes().layers, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    length = np.asarray(cache.length)
    for leaf, spec in zip(jax.tree.leaves(cache.layers), axes, strict=True):
        for b, row in enumerate(np.asarray(leaf)):
            if "seq" in spec:
                row = np.take(row, np.arange(length[b]), axis=tuple(spec).index("seq") - 1)
            if "window" in spec:
                axis = tuple(spec).index("window") - 1
                R = row.shape[axis]
                row = np.take(row, np.arange(max(0, length[b] - R), length[b]) % R, axis=axis)
            out.append(row)
    return out


def assert_same_cache(got, want, atol=ATOL):
    np.testing.assert_array_equal(np.asarray(got.length), np.asarray(want.length))
    np.testing.assert_array_equal(np.asarray(got.start), np.asarray(want.start))
    for a, b in zip(committed_view(got), committed_view(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)


def chain_tree(rng, depth: int, side: int):
    """A chain root -> 1 -> .. -> depth (a lookup copy past the drafter's block) and `side` nodes hanging off its
    first levels (the drafter's alternatives): tree_of's triple."""
    return tree_of(np.r_[-1, np.arange(depth), rng.integers(0, 4, side)])


CASES = ["root_only", "deepest", "random", "at_cache_end", "long_chain"]


@pytest.mark.parametrize("case", CASES)
def test_verify_commit_equals_causal_prefill(target, case):
    rng = np.random.default_rng(CASES.index(case))
    V = target.config.vocab_size
    prefix = rng.integers(0, V, PREFIX)
    parents, depth, vis = chain_tree(rng, 32, 7) if case == "long_chain" else random_tree(rng, NODES)
    N = len(parents)
    nodes = rng.integers(0, V, N)
    if case == "root_only":
        last = 0
    elif case == "random":
        last = int(rng.integers(1, NODES))
    else:  # the deepest node (the first one, if several)
        last = int(np.argmax(depth))
    path = np.flatnonzero(vis[last])  # root .. last, increasing (parents precede children)
    n = len(path)
    assert (case == "root_only") == (n == 1) and (case not in ("deepest", "at_cache_end") or n >= 4)
    assert case != "long_chain" or n == 33
    max_len = PREFIX + N if case == "at_cache_end" else 64  # the tree's last slot is the cache's last

    cache = prefill(target, prefix, max_len)
    segment = Segment(positions=jnp.asarray(PREFIX + depth, jnp.int32)[None], visible=jnp.asarray(vis)[None],
                      parents=jnp.asarray(parents, jnp.int32)[None], lengths=jnp.full((1,), N, jnp.int32))
    _, _, pending = forward(target.graphdef, target.params, jnp.asarray(nodes, jnp.int32)[None], segment, cache)
    padded_path = np.zeros(N, np.int32)  # static length; entries past n are ignored
    padded_path[:n] = path
    committed = pending.commit(jnp.asarray(padded_path), jnp.int32(n))
    want = prefill(target, np.r_[prefix, nodes[path]], max_len)
    assert_same_cache(committed, want, atol=TREE_ATOL)

    nxt = rng.integers(0, V, 2)  # the next forward sees the same past
    pos = jnp.asarray(PREFIX + n + np.arange(2), jnp.int32)[None]
    got = forward(target.graphdef, target.params, jnp.asarray(nxt, jnp.int32)[None], Segment.causal(pos), committed)[0]
    ref = forward(target.graphdef, target.params, jnp.asarray(nxt, jnp.int32)[None], Segment.causal(pos), want)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=LOGIT_ATOL)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_rows_commit_their_own_paths(target, impl):
    """A batch of two rows with prefixes of different lengths (one right-padded prefill) verifies a different tree
    per row in one forward and commits paths of different lengths (the deepest node; the root alone): each row's
    cache equals the causal prefill of its own prefix + path, alone."""
    rng = np.random.default_rng(11)
    V = target.config.vocab_size
    lens = [PREFIX + 4, PREFIX]
    prefixes = [rng.integers(0, V, n) for n in lens]
    trees = [random_tree(rng, NODES) for _ in lens]
    nodes = rng.integers(0, V, (2, NODES))
    paths = [np.flatnonzero(trees[0][2][int(np.argmax(trees[0][1]))]), np.zeros(1, int)]
    ids = np.full((2, max(lens)), 5, np.int32)
    for b, p in enumerate(prefixes):
        ids[b, : len(p)] = p
    segment = Segment.causal(jnp.broadcast_to(jnp.arange(max(lens), dtype=jnp.int32), ids.shape),
                             lengths=jnp.asarray(lens, jnp.int32))
    _, _, cache = forward(target.graphdef, target.params, jnp.asarray(ids), segment, target.module.init_cache(2, 48))
    cache = cache.advance(jnp.asarray(lens, jnp.int32))
    segment = Segment(positions=jnp.asarray([n + t[1] for n, t in zip(lens, trees)], jnp.int32),
                      visible=jnp.asarray(np.stack([t[2] for t in trees])),
                      parents=jnp.asarray(np.stack([t[0] for t in trees]), jnp.int32),
                      lengths=jnp.full((2,), NODES, jnp.int32))
    _, _, pending = forward(target.graphdef, target.params, jnp.asarray(nodes, jnp.int32), segment, cache)
    padded = np.zeros((2, NODES), np.int32)
    for b, p in enumerate(paths):
        padded[b, : len(p)] = p
    committed = pending.commit(jnp.asarray(padded), jnp.asarray([len(p) for p in paths], jnp.int32), impl=impl)
    assert len(paths[0]) >= 3
    for b in range(2):
        row = jax.tree.map(lambda x: x[b: b + 1], committed)
        assert_same_cache(row, prefill(target, np.r_[prefixes[b], nodes[b][paths[b]]], 48), atol=TREE_ATOL)


def test_pallas_commit_conforms(target):
    """The same promise with the KV commit as the Pallas kernel (interpret mode on CPU)."""
    rng = np.random.default_rng(9)
    V = target.config.vocab_size
    prefix, nodes = rng.integers(0, V, PREFIX), rng.integers(0, V, NODES)
    parents, depth, vis = random_tree(rng, NODES)
    path = np.flatnonzero(vis[int(np.argmax(depth))])
    cache = prefill(target, prefix, 32)
    segment = Segment(positions=jnp.asarray(PREFIX + depth, jnp.int32)[None], visible=jnp.asarray(vis)[None],
                      parents=jnp.asarray(parents, jnp.int32)[None], lengths=jnp.full((1,), NODES, jnp.int32))
    _, _, pending = forward(target.graphdef, target.params, jnp.asarray(nodes, jnp.int32)[None], segment, cache)
    padded_path = np.zeros(NODES, np.int32)
    padded_path[: len(path)] = path
    committed = pending.commit(jnp.asarray(padded_path), jnp.int32(len(path)), impl="pallas")
    assert_same_cache(committed, prefill(target, np.r_[prefix, nodes[path]], 32), atol=TREE_ATOL)


def test_right_padding_is_never_committed(target):
    """A prefill right-padded with garbage and told its real length, then advanced by it, equals the unpadded
    prefill; so does the forward after it."""
    rng = np.random.default_rng(3)
    V = target.config.vocab_size
    tokens = rng.integers(0, V, 9)
    padded, plain = prefill(target, tokens, 32, pad_to=16), prefill(target, tokens, 32)
    assert_same_cache(padded, plain)
    pos = jnp.full((1, 1), 9, jnp.int32)
    nxt = jnp.asarray([[int(rng.integers(0, V))]], jnp.int32)
    np.testing.assert_allclose(np.asarray(forward(target.graphdef, target.params, nxt, Segment.causal(pos), padded)[0]),
                               np.asarray(forward(target.graphdef, target.params, nxt, Segment.causal(pos), plain)[0]),
                               rtol=0, atol=ATOL)


def test_grow_keeps_the_committed_cache(target):
    """A cache prefilled with room for one more slot, then grown, equals one prefilled at the larger size; the
    next forward, which writes past the old end, sees the same past."""
    rng = np.random.default_rng(4)
    V = target.config.vocab_size
    prefix = rng.integers(0, V, PREFIX)
    grown, want = prefill(target, prefix, PREFIX + 1).grow(32), prefill(target, prefix, 32)
    assert grown.max_len == 32
    assert jax.tree.map(np.shape, grown) == jax.tree.map(np.shape, want)
    assert_same_cache(grown, want)
    nxt = jnp.asarray(rng.integers(0, V, (1, 3)), jnp.int32)
    pos = jnp.asarray(PREFIX + np.arange(3), jnp.int32)[None]
    np.testing.assert_allclose(np.asarray(forward(target.graphdef, target.params, nxt, Segment.causal(pos), grown)[0]),
                               np.asarray(forward(target.graphdef, target.params, nxt, Segment.causal(pos), want)[0]),
                               rtol=0, atol=ATOL)


AXES = {"batch", "seq", "window", "vocab", "embed", "q_heads", "kv_heads", "head_dim", "ffn", "experts", "layers",
        "tap_embed", "latent", "q_latent", "shared_gate", "gdn_heads", "gdn_key_heads", "gdn_key_dim", "gdn_value_dim",
        "conv_kernel", "per_layer"}


def test_logical_axes(target):
    """Every parameter and every cache buffer names one known logical axis per dimension."""
    for path, var in nnx.to_flat_state(target.params):
        axes = var.get_metadata().get("out_sharding")
        assert axes is not None and len(axes) == var.ndim and set(axes) <= AXES, (path, axes, var.shape)
    cache = target.module.init_cache(2, 16)
    specs = jax.tree.leaves(cache.logical_axes(), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for leaf, spec in zip(jax.tree.leaves(cache), specs, strict=True):
        assert len(spec) == np.ndim(leaf) and set(spec) <= AXES, (spec, np.shape(leaf))


RINGED = ["gemma3", "gemma4_shared_kv"]


def full_length(cache):
    """The same cache with every ring replaced by the full-length, slot-addressed buffer it stands for (the
    attention then applies the window as a mask, models/attention.sliding): the independent reference."""
    B = cache.length.shape[0]
    return cache.__class__(tuple(KVEntry.init(B, cache.max_len, e.k.shape[1], e.k.shape[3], e.k.dtype)
                                 if isinstance(e, RingKVEntry) else e for e in cache.layers),
                           cache.length, cache.start, cache.max_len)


def assert_ring_holds(ring_cache, full_cache):
    """Every ring holds the full buffer's last R committed slots of each row (left padding aside)."""
    length, start = np.asarray(full_cache.length), np.asarray(full_cache.start)
    for r, f in zip(ring_cache.layers, full_cache.layers, strict=True):
        if not isinstance(r, RingKVEntry):
            continue
        R = r.slots
        for b in range(length.shape[0]):
            s = np.arange(max(start[b], length[b] - R), length[b])
            for x, y in ((r.k, f.k), (r.v, f.v)):
                np.testing.assert_allclose(np.asarray(x)[b][:, s % R], np.asarray(y)[b][:, s], rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", RINGED)
def test_ring_equals_full_length_buffer(name):
    """Sliding layers' rings against full-length buffers, through a prefill three windows long, two tree verifies
    whose commits wrap the ring (a path longer than the window, then a random one) and a decode: the same logits
    at every forward, and each ring holds the full buffer's last window."""
    model = jaxspec.random_model(TARGETS[name](), seed=2)
    rng = np.random.default_rng(5)
    V = model.config.vocab_size
    prefix = rng.integers(0, V, 13)
    ring = model.module.init_cache(1, 64)
    assert any(isinstance(e, RingKVEntry) and e.slots == 4 for e in ring.layers)
    caches = [ring, full_length(ring)]

    def step(tokens, segment, commit=None):
        outs = [forward(model.graphdef, model.params, jnp.asarray(tokens, jnp.int32)[None], segment, c) for c in caches]
        np.testing.assert_allclose(np.asarray(outs[0][0]), np.asarray(outs[1][0]), rtol=0, atol=LOGIT_ATOL)
        caches[:] = [commit(o[2]) for o in outs]
        assert_ring_holds(*caches)

    step(prefix, Segment.causal(jnp.arange(13, dtype=jnp.int32)[None]), lambda c: c.advance(13))
    for path_kind in ("deepest", "random"):
        parents, depth, vis = chain_tree(rng, 6, 5) if path_kind == "deepest" else random_tree(rng, NODES)
        L = int(caches[0].length[0])
        last = int(np.argmax(depth)) if path_kind == "deepest" else int(rng.integers(1, len(parents)))
        path = np.flatnonzero(vis[last])
        padded = np.zeros(len(parents), np.int32)
        padded[: len(path)] = path
        segment = Segment(positions=jnp.asarray(L + depth, jnp.int32)[None], visible=jnp.asarray(vis)[None],
                          parents=jnp.asarray(parents, jnp.int32)[None],
                          lengths=jnp.full((1,), len(parents), jnp.int32))
        step(rng.integers(0, V, len(parents)), segment,
             lambda c, p=padded, n=len(path): c.commit(jnp.asarray(p), jnp.int32(n)))
    L = int(caches[0].length[0])
    step(rng.integers(0, V, 1), Segment.causal(jnp.full((1, 1), L, jnp.int32)), lambda c: c.advance(1))


@pytest.mark.parametrize("name", RINGED)
def test_ring_moves_with_the_cache(name):
    """Cache.grow past the window (the ring widens from max_len to the window), reslot (a shift left) and
    put_rows (a fresh prefill placed to end where a row ends, continuous batching) keep each ring equal to
    the full-length buffer they stand for, and the next forward's logits equal the full buffer's."""
    cfg = TARGETS[name]()
    cfg = dataclasses.replace(cfg, sliding_window=12)
    model = jaxspec.random_model(cfg, seed=3)
    rng = np.random.default_rng(6)
    V = model.config.vocab_size
    ids = rng.integers(0, V, (2, 7))
    start = jnp.asarray([0, 2], jnp.int32)

    def run(cache, tokens, n):
        B, N = tokens.shape
        pos = jnp.maximum((cache.length - cache.start)[:, None] + jnp.arange(N)[None], 0)
        logits, _, pending = forward(model.graphdef, model.params, jnp.asarray(tokens, jnp.int32), Segment.causal(pos),
                                     cache)
        return logits, pending.advance(n)

    ring = model.module.init_cache(2, 8).with_start(start)  # max_len 8 < window 12: rings of 8
    assert {e.slots for e in ring.layers if isinstance(e, RingKVEntry)} == {8}
    caches = [run(c, ids, 7)[1] for c in (ring, full_length(ring))]
    caches = [c.grow(40) for c in caches]  # rings of 12
    assert {e.slots for e in caches[0].layers if isinstance(e, RingKVEntry)} == {12}
    assert_ring_holds(*caches)
    more = rng.integers(0, V, (2, 9))
    caches = [run(c, more, 9)[1] for c in caches]  # 16 committed: the rings have wrapped
    assert_ring_holds(*caches)
    caches = [c.reslot(3, 40) for c in caches]
    assert_ring_holds(*caches)
    fresh_ids = rng.integers(0, V, (2, 6))
    empty = model.module.init_cache(2, 6)
    fresh = [run(c, fresh_ids, 6)[1] for c in (empty, full_length(empty))]
    caches = [c.put_rows(jnp.asarray([1, 5]), f) for c, f in zip(caches, fresh)]  # row 5: padding, dropped
    assert_ring_holds(*caches)
    nxt = rng.integers(0, V, (2, 3))
    outs = [run(c, nxt, 3) for c in caches]
    np.testing.assert_allclose(np.asarray(outs[0][0]), np.asarray(outs[1][0]), rtol=0, atol=LOGIT_ATOL)
    assert_ring_holds(outs[0][1], outs[1][1])
