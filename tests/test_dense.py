"""Dense targets (Llama with llama3 RoPE, Qwen3, Gemma 3 text) against transformers, and the append-with-mask
forward against a plain causal forward: cached decode, chunked prefill, left padding, taps, tree masks.

Sequences are 13 tokens, longer than the Gemma window (4), so sliding layers are exercised.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jaxspec.model as jm
from conftest import FAMILIES
from jaxspec.segment import Segment

B, T, ATOL = 2, 13, 1e-4


@functools.partial(jax.jit, static_argnames=("graphdef", "taps"))
def _forward(graphdef, params, tokens, segment, cache, taps=()):
    return nnx.merge(graphdef, params)(tokens, segment, cache, tap_layers=taps)


def forward(model, tokens, positions, cache, parents=None, taps=()):
    """One `DenseLM.__call__` (jitted): numpy-friendly inputs, returns (logits, taps, pending cache).

    Causal unless `parents` [B, N] (-1 = continues from the cache) gives a tree: each token then sees
    itself and its ancestors."""
    as_i32 = lambda a: jnp.asarray(np.asarray(a), jnp.int32)  # noqa: E731
    segment = Segment.causal(as_i32(positions))
    if parents is not None:
        segment = Segment(segment.positions, jnp.asarray(ancestors(parents)), as_i32(parents), segment.lengths)
    return _forward(model.graphdef, model.params, as_i32(tokens), segment, cache, taps=taps)


def ancestors(parents):
    """[B, N] parent pointers (parents precede children) -> [B, N, N] node i sees j (j is i or an ancestor)."""
    B, N = parents.shape
    vis = np.broadcast_to(np.eye(N, dtype=bool), (B, N, N)).copy()
    for b in range(B):
        for i in range(N):
            if parents[b, i] >= 0:
                vis[b, i] |= vis[b, parents[b, i]]
    return vis


def hf_logits(hf, ids, **kw):
    with torch.no_grad():
        return hf(torch.as_tensor(np.asarray(ids), dtype=torch.long), **kw).logits.numpy()


@pytest.fixture(scope="module")
def tiny(tiny_hf):
    """Factory model_type -> (hf_model, jaxspec float32 Model, ids [B, T], HF logits [B, T, V])."""
    made = {}

    def make(model_type):
        if model_type not in made:
            hf, path = tiny_hf(model_type)
            ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, (B, T))
            made[model_type] = (hf, jm.load(path), ids, hf_logits(hf, ids))
        return made[model_type]

    return make


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny, family):
    _, model, ids, ref = tiny(family)
    assert 1.0 < np.abs(ref).max() < 20.0  # the tolerance below is meaningful at this scale
    np.testing.assert_allclose(model.logits(ids), ref, rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decode_and_chunked_prefill(tiny, family):
    """Prefill 5 tokens, decode the other 8 one at a time: every step equals the full forward. Then the
    same 13 tokens as two chunks (5 + 8) equal one prefill, logits and cached K/V alike."""
    _, model, ids, ref = tiny(family)
    m, P = model.module, 5
    pos = np.broadcast_to(np.arange(T), (B, T))
    cache = m.init_cache(B, T)
    logits, _, cache = forward(model, ids[:, :P], pos[:, :P], cache)
    np.testing.assert_allclose(logits, ref[:, :P], rtol=0, atol=ATOL)
    cache = cache.advance(P)
    for t in range(P, T):
        logits, _, cache = forward(model, ids[:, t:t + 1], pos[:, t:t + 1], cache)
        cache = cache.advance(1)
        np.testing.assert_allclose(logits[:, 0], ref[:, t], rtol=0, atol=ATOL, err_msg=f"decode step {t}")
    assert np.asarray(cache.length).tolist() == [T] * cache.length.shape[0]

    # second chunk of a chunked prefill, on top of the first chunk's cache (same as prefix above)
    c2 = forward(model, ids[:, :P], pos[:, :P], m.init_cache(B, T))[2].advance(P)
    logits2, _, c2 = forward(model, ids[:, P:], pos[:, P:], c2)
    np.testing.assert_allclose(logits2, ref[:, P:], rtol=0, atol=ATOL)
    whole = forward(model, ids, pos, m.init_cache(B, T))[2].advance(T)
    for a, b in zip(jax.tree.leaves(c2.advance(T - P).layers), jax.tree.leaves(whole.layers)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding(tiny, family):
    """Row 0 is left-padded by 3 slots (cache.start = 3, positions = slot - start): its real tokens give the
    logits of the unpadded sequence alone, in prefill and in the decode step after it. The pad slots hold
    garbage tokens and a plain causal `visible`: the mask must hide them by `start`, not by `visible`."""
    hf, model, ids, _ = tiny(family)
    pad, n = 3, T - 3  # row 0: 3 pads + ids[0, :10]; row 1: ids[1, :13]
    tokens = np.stack([np.r_[[7, 7, 7], ids[0, :n]], ids[1]])
    start = np.array([pad, 0])
    pos = np.maximum(np.arange(T)[None] - start[:, None], 0)
    cache = model.module.init_cache(B, T + 1).with_start(start)
    logits, _, cache = forward(model, tokens, pos, cache)
    nxt = np.array([[11], [12]])
    step, _, _ = forward(model, nxt, pos[:, -1:] + 1, cache.advance(T))
    ref0 = hf_logits(hf, np.r_[ids[0, :n], nxt[0]][None])[0]
    ref1 = hf_logits(hf, np.r_[ids[1], nxt[1]][None])[0]
    np.testing.assert_allclose(logits[0, pad:], ref0[:n], rtol=0, atol=ATOL)
    np.testing.assert_allclose(logits[1], ref1[:T], rtol=0, atol=ATOL)
    np.testing.assert_allclose(step[:, 0], np.stack([ref0[n], ref1[T]]), rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_taps_are_decoder_layer_outputs(tiny, family):
    """taps=(0, 1) is [layer 0 output | layer 1 output]. Compared with forward hooks on HF's decoder
    layers: HF's `hidden_states[-1]` has the final norm applied, so for the 2-layer models hidden_states[2]
    is not layer 1's output (for Gemma's 6 layers hidden_states[1:3] are)."""
    hf, model, ids, _ = tiny(family)
    outs = {}
    hooks = [hf.model.layers[i].register_forward_hook(lambda mod, a, o, i=i: outs.__setitem__(i, o)) for i in (0, 1)]
    try:
        with torch.no_grad():
            hs = hf(torch.as_tensor(ids), output_hidden_states=True).hidden_states
    finally:
        for h in hooks:
            h.remove()
    layer_out = [(o[0] if isinstance(o, tuple) else o).numpy() for o in (outs[0], outs[1])]
    pos = np.broadcast_to(np.arange(T), (B, T))
    _, taps, _ = forward(model, ids, pos, model.module.init_cache(B, T), taps=(0, 1))
    H = hf.config.hidden_size
    assert taps.shape == (B, T, 2 * H)
    np.testing.assert_allclose(taps, np.concatenate(layer_out, -1), rtol=0, atol=ATOL * 10)
    np.testing.assert_allclose(taps[..., :H], hs[1].numpy(), rtol=0, atol=ATOL * 10)
    if hf.config.num_hidden_layers > 2:
        np.testing.assert_allclose(taps[..., H:], hs[2].numpy(), rtol=0, atol=ATOL * 10)


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_load(tiny_hf, tiny, family):
    _, path = tiny_hf(family)
    _, _, ids, ref = tiny(family)
    model = jm.load(path, dtype="bfloat16", tokenizer=False)
    assert model.dtype == jnp.bfloat16
    out = model.logits(ids)
    assert out.dtype == np.float32
    # bf16 has 8 bits of mantissa: ~1% per op, compounded over the layers
    assert np.abs(out - ref).max() < 0.1 * np.abs(ref).max()
    assert (out.argmax(-1) == ref.argmax(-1)).mean() > 0.8


def random_tree(rng, n):
    """parents[0] = -1 (root); every other node hangs off an earlier one. Returns parents, depths, ancestor
    mask [n, n] (node i sees j iff j is i or an ancestor of i)."""
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
    depth, vis = np.zeros(n, int), np.eye(n, dtype=bool)
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
        vis[i] |= vis[parents[i]]
    return parents, depth, vis


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_oracle(tiny, family):
    """Tree verification at model level: append 9 nodes of a random tree (a different tree per row) at
    positions L + depth with the ancestor mask; every node's logits equal a plain causal forward over
    prefix + path(node)."""
    hf, model, ids, _ = tiny(family)
    L, N = 6, 9
    rng = np.random.default_rng(1)
    trees = [random_tree(rng, N) for _ in range(B)]
    assert max(t[1].max() for t in trees) >= 3  # deeper than the Gemma window reaches back
    nodes = rng.integers(0, hf.config.vocab_size, (B, N))
    pos = np.broadcast_to(np.arange(L), (B, L))
    _, _, cache = forward(model, ids[:, :L], pos, model.module.init_cache(B, L + N))
    depth = np.stack([t[1] for t in trees])
    parents = np.stack([t[0] for t in trees])
    logits, _, _ = forward(model, nodes, L + depth, cache.advance(L), parents=parents)
    for b, (_, _, anc) in enumerate(trees):
        for i in range(N):
            path = nodes[b, np.flatnonzero(anc[i])]  # ancestors precede children: already root-first
            ref = hf_logits(hf, np.r_[ids[b, :L], path][None])[0, -1]
            np.testing.assert_allclose(logits[b, i], ref, rtol=0, atol=ATOL, err_msg=f"row {b} node {i}")


def test_rope_rotates_like_float64_and_evaluates_cos_sin_once_per_angle():
    """apply_rope against a float64 rotate_half, and in XLA:CPU's compiled form no fusion that writes the
    rotated [B, N, heads, D] tensor evaluates cos or sin: fused there they ran once per head and half (RoPE
    was 1 ms of SmolLM2's 9-node verify)."""
    from jaxspec.models.layers import apply_rope

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 9, 6, 64)).astype(np.float32)  # [B, N, heads, D]
    pos = np.arange(300, 309, dtype=np.int32)[None]
    inv = (1e4 ** -(np.arange(0, 64, 2) / 64)).astype(np.float32)
    fn = jax.jit(lambda x, p: apply_rope(x, p, inv))
    ang = pos[0].astype(np.float64)[:, None, None] * inv.astype(np.float64)  # [N, 1, D/2]
    x1, x2 = np.split(x[0].astype(np.float64), 2, axis=-1)
    want = np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)
    np.testing.assert_allclose(np.asarray(fn(x, pos))[0], want, atol=1e-4)  # float32 angles near 300 rad
    if jax.default_backend() != "cpu":
        return
    hlo = fn.lower(x, pos).compile().as_text()
    computations = [c for c in hlo.split("\n\n") if " cosine(" in c or " sine(" in c]
    assert computations, "no cos/sin found in the compiled module"
    for c in computations:
        root = next(line for line in c.splitlines() if "ROOT" in line)
        assert "[1,9,6,64]" not in root, "cos/sin are evaluated inside the rotation's fusion:\n" + c[:2000]
