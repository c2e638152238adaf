"""DFlash block-diffusion drafter (Chen, Liang, Liu 2026).

A few Qwen3-style layers read a block `[bonus, MASK x (B-1)]` at absolute positions `L .. L+B-1`,
bidirectionally inside the block, and attend to a *context*: the target's hidden states at
`target_layer_ids` for every committed token, concatenated, projected by `fc` and normed by
`hidden_norm`. Each layer projects the context with its own k/v projections (k_norm and RoPE included),
so context K/V are computed once per committed token and kept in a `KVCache` (`append_context`).
The drafter owns no embedding or LM head: it uses the target's (frozen), and its output norm replaces
the target's final norm. One forward gives B-1 distributions, for positions L+1 .. L+B-1.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache import KVCache
from jaxspec.config import DrafterConfig
from jaxspec.models.attention import attend
from jaxspec.models.layers import MLP, Linear, RMSNorm, apply_rope, rope_inv_freq


class DraftAttention(nnx.Module):
    def __init__(self, cfg: DrafterConfig, layer: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        H, nH, nKV, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = nH, nKV, D
        self.window = cfg.sliding_window if cfg.is_sliding[layer] else None
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(D, cfg.rope))  # static
        self.q_proj = Linear(H, nH * D, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(H, nKV * D, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(H, nKV * D, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(nH * D, H, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)

    def kv(self, x, positions):
        """x [B, N, H] -> k, v [B, KVH, N, D] (k normed and rotated): used for context and block alike."""
        B, N, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, N, self.num_kv_heads, self.head_dim))
        k = apply_rope(k, positions, jnp.asarray(self.inv_freq, jnp.float32))
        v = self.v_proj(x).reshape(B, N, self.num_kv_heads, self.head_dim)
        return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def __call__(self, x, positions, ctx_k, ctx_v, ctx_mask, ctx_pos):
        """Block x [B, Bk, H] attends to [context (ctx_mask) | whole block]; non-causal."""
        B, N, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, N, self.num_heads, self.head_dim))
        q = apply_rope(q, positions, jnp.asarray(self.inv_freq, jnp.float32))
        kb, vb = self.kv(x, positions)
        k = jnp.concatenate([ctx_k, kb.astype(ctx_k.dtype)], axis=2)
        v = jnp.concatenate([ctx_v, vb.astype(ctx_v.dtype)], axis=2)
        cm = jnp.broadcast_to(ctx_mask[:, None, :], (B, N, ctx_mask.shape[1]))  # [B, Bk, T]
        if self.window is not None:  # sliding layers see only the last `window` context positions
            cm = cm & (positions[:, :, None] - ctx_pos[:, None, :] < self.window)
        mask = jnp.concatenate([cm, jnp.ones((B, N, N), bool)], axis=2)
        o = attend(q, k, v, mask, self.head_dim**-0.5)
        return self.o_proj(o.reshape(B, N, self.num_heads * self.head_dim))


class DraftLayer(nnx.Module):
    def __init__(self, cfg: DrafterConfig, layer: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = DraftAttention(cfg, layer, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, "silu", dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, ctx_k, ctx_v, ctx_mask, ctx_pos):
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, ctx_mask, ctx_pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        H = cfg.hidden_size
        self.fc = Linear(len(cfg.target_layer_ids) * H, H, dtype=dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([DraftLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache.init(c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim, self.fc.kernel.dtype)

    def append_context(self, cache: KVCache, taps, n_valid) -> KVCache:
        """Write context K/V for taps [B, n, n_taps*H] at slots cache.length.., then commit n_valid of them.

        Rows past n_valid are written as scratch (past the new length) and overwritten next time, so the
        row count stays static (e.g. always depth+1 after a round) while the committed count varies.
        """
        B, n, _ = taps.shape
        ctx = self.hidden_norm(self.fc(taps))
        pos = cache.length - cache.start[:, None] + jnp.arange(n)[None, :]
        ks, vs = list(cache.k), list(cache.v)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(ctx, pos)
            ks[i] = jax.lax.dynamic_update_slice(ks[i], k.astype(ks[i].dtype), (0, 0, cache.length, 0))
            vs[i] = jax.lax.dynamic_update_slice(vs[i], v.astype(vs[i].dtype), (0, 0, cache.length, 0))
        return KVCache(tuple(ks), tuple(vs), cache.length + n_valid, cache.start)

    def draft_logits(self, target, cache: KVCache, bonus, L):
        """Draft distributions for the block [bonus, MASK x (B-1)] at positions L.. -> float32 [B-1, V].

        target supplies the (frozen) embedding and LM head: `target.embed`, `target.head`.
        """
        Bk = self.config.block_size
        block = jnp.full((1, Bk), self.config.mask_token_id, jnp.int32).at[0, 0].set(bonus)
        pos = (L - cache.start[0] + jnp.arange(Bk, dtype=jnp.int32))[None]
        logits = self.head(target, self(target.embed(block), pos, cache)[0, 1:])
        if not self.config.draft_vocab:
            return logits
        full = jnp.full((Bk - 1, self.config.vocab_size), -jnp.inf, jnp.float32)  # never draft the rest
        return full.at[:, jnp.asarray(self.config.draft_vocab, jnp.int32)].set(logits)

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
            k, v = layer.self_attn.kv(ctx, ctx_pos)  # [Bs, KVH, S, D], shared by the sequence's blocks
            x = layer(x, pos, jnp.repeat(k, A, 0), jnp.repeat(v, A, 0), ctx_mask, jnp.repeat(ctx_pos, A, 0))
        return self.norm(x).reshape(Bs, A, Bk, -1)

    def __call__(self, block_emb, positions, cache: KVCache):
        """block_emb [B, Bk, H] (target embedding of [bonus, MASK...]); positions [B, Bk] -> hidden [B, Bk, H].

        The caller applies the target's LM head to rows 1.. to get the draft distributions.
        """
        slot = jnp.arange(cache.max_len)
        ctx_mask = (slot[None, :] >= cache.start[:, None]) & (slot[None, :] < cache.length)  # [B, T]
        ctx_pos = slot[None, :] - cache.start[:, None]
        x = block_emb
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, cache.k[i], cache.v[i], ctx_mask, ctx_pos)
        return self.norm(x)

