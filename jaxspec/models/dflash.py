"""DFlash block-diffusion drafter (Chen, Liang, Liu 2026).

A few Qwen3-style layers read a block `[bonus, MASK x (B-1)]` at absolute positions `L .. L+B-1`,
bidirectionally inside the block, and attend to a *context*: the target's hidden states at
`target_layer_ids` for every committed token, concatenated, projected by `fc` and normed by
`hidden_norm`. Each layer projects the context with its own k/v projections (k_norm and RoPE included),
so context K/V are computed once per committed token and kept in a `Cache` of KV entries
(`append_context`). The layers are the targets' `Attention` with q/k norms.
The drafter owns no embedding or LM head: it uses the target's (frozen), and its output norm replaces
the target's final norm. One forward gives B-1 distributions, for positions L+1 .. L+B-1.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from jaxspec.cache import Cache, KVEntry
from jaxspec.config import DrafterConfig
from jaxspec.models.attention import Attention, AttentionSpec, attend_cache
from jaxspec.models.layers import MLP, Linear, RMSNorm


def attention_spec(cfg: DrafterConfig, layer: int) -> AttentionSpec:
    return AttentionSpec(
        hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        rope=cfg.rope, scale=cfg.head_dim**-0.5, eps=cfg.rms_norm_eps, bias=cfg.attention_bias, qk_norm=True,
        window=cfg.sliding_window if cfg.is_sliding[layer] else None,
    )


def block_attention(attn: Attention, x, positions, ctx_k, ctx_v, ctx_mask, ctx_pos, length=None):
    """Block x [B, Bk, H] attends to [context (ctx_mask [B, T]) | whole block], non-causally.

    ctx_k, ctx_v: [B, KVH, T, D] context K/V (computed once per committed token); ctx_pos: [B, T]. When
    drafting, ctx_k, ctx_v are the drafter's cache and `length` its committed slots: the block's keys stand
    beside them at slots length.., and the attention reads only the committed slots (`attend_cache`, the CPU
    kernel, whose cost grows with the committed length where XLA's form pays for the whole buffer;
    docs/benchmarks/cpu.md, "The drafter's attention on the kernel").
    Training (length None) gives every block its own context mask over one shared sequence."""
    B, N, _ = x.shape
    T = ctx_mask.shape[1]
    q, kb, vb = attn.qkv(x, positions)  # q [B, Bk, heads, D], kb, vb [B, Bk, KVH, D]
    cm = jnp.broadcast_to(ctx_mask[:, None, :], (B, N, T))  # [B, Bk, T]
    if attn.spec.window is not None:  # sliding layers see only the last `window` context positions
        cm = cm & (positions[:, :, None] - ctx_pos[:, None, :] < attn.spec.window)
    if length is not None:
        slot = jnp.arange(T)
        s0 = jnp.clip(length, 0, T - N)[:, None, None]  # [B, 1, 1]: where attend_cache reads the new keys' visibility
        o = attend_cache(q, ctx_k, ctx_v, kb, vb, length, cm | ((slot >= s0) & (slot < s0 + N)), attn.spec.scale,
                         attn.spec.softcap, ranged=attn.spec.window is None)
        return attn.o_proj(o.reshape(B, N, -1))
    k = jnp.concatenate([ctx_k, kb.transpose(0, 2, 1, 3).astype(ctx_k.dtype)], axis=2)
    v = jnp.concatenate([ctx_v, vb.transpose(0, 2, 1, 3).astype(ctx_v.dtype)], axis=2)
    mask = jnp.concatenate([cm, jnp.ones((B, N, N), bool)], axis=2)
    return attn.output(q, k, v, mask)


class DraftLayer(nnx.Module):
    def __init__(self, cfg: DrafterConfig, layer: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(attention_spec(cfg, layer), dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, "silu", dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, ctx_k, ctx_v, ctx_mask, ctx_pos, length=None):
        x = x + block_attention(self.self_attn, self.input_layernorm(x), positions, ctx_k, ctx_v, ctx_mask, ctx_pos,
                                length)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        H = cfg.hidden_size
        self.fc = Linear(len(cfg.target_layer_ids) * H, H, ("tap_embed", "embed"), dtype=dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([DraftLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)

    def init_cache(self, batch: int, max_len: int) -> Cache:
        c = self.config
        dt = self.fc.kernel.dtype
        return Cache.init([KVEntry.init(batch, max_len, c.num_kv_heads, c.head_dim, dt) for _ in range(c.num_layers)],
                          batch, max_len)

    def append_context(self, cache: Cache, taps, n_valid) -> Cache:
        """Write context K/V for taps [B, n, n_taps*H] at slots cache.length.., then commit n_valid of them.

        Rows past n_valid are written as scratch (past the new length) and overwritten next time, so the
        row count stays static (e.g. always depth+1 after a round) while the committed count varies.
        """
        B, n, _ = taps.shape
        ctx = self.hidden_norm(self.fc(taps))
        pos = (cache.length - cache.start)[:, None] + jnp.arange(n)[None, :]
        layers = tuple(e.write(*layer.self_attn.keys_values(ctx, pos), cache.length)
                       for e, layer in zip(cache.layers, self.layers))
        return dataclasses.replace(cache, layers=layers).advance(n_valid)

    def draft_logits(self, target, cache: Cache, bonus, L, depth: int | None = None):
        """Draft logits for each row's block [bonus[b], MASK x (Bk-1)] at slots L[b].. -> float32 [B, depth, K],
        over the draft vocabulary (column j is token `config.draft_vocab[j]`) when there is one, else over all V
        tokens. bonus, L: [B] (the cache's rows).

        target supplies the (frozen) embedding and LM head: `target.embed`, `target.head`. depth (static,
        default B-1): the rows of depths 1..depth only. The whole block still goes through the layers, so
        those rows are unchanged, and the head, the drafter's largest product, skips the rest: a tree of b
        nodes is at most b deep, so a small DDTree budget never reads the deep rows. The tree is built on
        the K columns and maps its tokens through the vocabulary (`build_tree(..., ids=)`): spreading them
        over [depth, V] first made its top-k and softmax read all V columns, a visible share of a CPU round
        (docs/benchmarks/cpu.md, "The tree built on the draft vocabulary").
        """
        Bk = self.config.block_size
        depth = Bk - 1 if depth is None else depth
        B = cache.start.shape[0]
        block = jnp.full((B, Bk), self.config.mask_token_id, jnp.int32).at[:, 0].set(bonus)
        pos = (L - cache.start)[:, None] + jnp.arange(Bk, dtype=jnp.int32)[None, :]
        return self.head(target, self(target.embed(block), pos, cache)[:, 1 : 1 + depth])

    def head(self, target, h):
        """h [..., H] -> float32 logits over the draft vocabulary [..., K] (the target's V without one).

        A draft vocabulary (the target's most frequent output tokens) makes the head, which dominates
        the drafter's cost, several times cheaper in training and drafting; verification still uses the
        full vocabulary, so output is unchanged and only the rare tokens outside it are never drafted.
        """
        ids = self.config.draft_vocab
        return target.head(h, jnp.asarray(ids, jnp.int32) if ids else None)

    def train_forward(self, taps, block_emb, anchors):
        """Many blocks per sequence at once, each seeing the context strictly before its anchor.

        taps [Bs, S, n_taps*H] (target taps of whole sequences); block_emb [Bs, A, Bk, H] (embedded
        [x_a, MASK...] per anchor); anchors [Bs, A] -> hidden [Bs, A, Bk, H]. Blocks are folded into the
        batch and go through exactly the inference layers, so training and drafting cannot drift apart.
        """
        Bs, S, _ = taps.shape
        A, Bk = block_emb.shape[1:3]
        ctx = self.hidden_norm(self.fc(taps))
        ctx_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (Bs, S))
        ctx_mask = (ctx_pos[:, None, :] < anchors[..., None]).reshape(Bs * A, S)
        pos = (anchors[..., None] + jnp.arange(Bk, dtype=jnp.int32)).reshape(Bs * A, Bk)
        x = block_emb.reshape(Bs * A, Bk, -1)
        for layer in self.layers:
            k, v = (t.transpose(0, 2, 1, 3) for t in layer.self_attn.keys_values(ctx, ctx_pos))  # [Bs, KVH, S, D]
            x = layer(x, pos, jnp.repeat(k, A, 0), jnp.repeat(v, A, 0), ctx_mask, jnp.repeat(ctx_pos, A, 0))
        return self.norm(x).reshape(Bs, A, Bk, -1)

    def __call__(self, block_emb, positions, cache: Cache):
        """block_emb [B, Bk, H] (target embedding of [bonus, MASK...]); positions [B, Bk] -> hidden [B, Bk, H].

        The caller applies the target's LM head to rows 1.. to get the draft distributions.
        """
        slot = jnp.arange(cache.max_len)
        ctx_mask = (slot[None, :] >= cache.start[:, None]) & (slot[None, :] < cache.length[:, None])  # [B, T]
        ctx_pos = slot[None, :] - cache.start[:, None]
        x = block_emb
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, cache.layers[i].k, cache.layers[i].v, ctx_mask, ctx_pos, cache.length)
        return self.norm(x)

