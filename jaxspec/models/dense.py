"""Dense decoder-only targets: Llama (incl. llama3 RoPE), Qwen3 (q/k norm), Gemma 3 text.

Gemma 3 differs by (1+w) sandwich norms, sqrt(H) embedding scale, `query_pre_attn_scalar`, GeGLU,
5:1 sliding/global layers with their own RoPE tables, and tied embeddings; all are config switches.

`DenseLM.__call__` is the family's one forward: it appends a `Segment` of N tokens behind the cache (its
K/V written as pending slots) and returns (logits, taps, pending cache). Prefill, AR decode and tree
verification are all this call; attention needs only the segment's positions and visibility.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache import Cache, KVEntry, RingKVEntry
from jaxspec.config import DenseConfig
from jaxspec.models.attention import Attention, AttentionSpec, masks
from jaxspec.models.layers import MLP, Linear, RMSNorm, embed_rows, finish, lm_logits, param
from jaxspec.segment import Segment


def attention_spec(cfg: DenseConfig, layer: int) -> AttentionSpec:
    sliding = cfg.is_sliding[layer]
    return AttentionSpec(
        hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        rope=cfg.rope_local if sliding else cfg.rope_global, scale=cfg.query_scale, eps=cfg.rms_norm_eps,
        bias=cfg.attention_bias, qk_norm=cfg.qk_norm, norm_plus_one=cfg.norm_plus_one,
        window=cfg.sliding_window if sliding else None, softcap=cfg.attn_logit_softcapping,
    )


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DenseConfig, layer: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, plus_one=cfg.norm_plus_one, dtype=dtype)  # noqa: E731
        self.sandwich = cfg.sandwich_norm
        self.input_layernorm = norm()
        self.self_attn = Attention(attention_spec(cfg, layer), dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=cfg.mlp_bias, dtype=dtype,
                       rngs=rngs)
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def __call__(self, x, positions, entry: KVEntry, length, mask, key_pos):
        a, entry = self.self_attn(self.input_layernorm(x), positions, entry, length, mask, key_pos)
        if self.sandwich:
            h = x + self.post_attention_layernorm(a)
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))), entry
        h = x + a
        return h + self.mlp(self.post_attention_layernorm(h)), entry


class DenseLM(nnx.Module):
    def __init__(self, cfg: DenseConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = param(jax.random.normal(rngs.params(), (cfg.vocab_size, H), dtype) * 0.02,
                                  ("vocab", "embed"))
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps, plus_one=cfg.norm_plus_one, dtype=dtype)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else Linear(H, cfg.vocab_size, ("embed", "vocab"), dtype=dtype, rngs=rngs))

    def init_cache(self, batch: int, max_len: int) -> Cache:
        """A KV entry per layer; sliding layers keep a ring of their window (cache.RingKVEntry)."""
        c = self.config
        dt = self.embed_tokens.dtype
        kv = c.num_kv_heads, c.head_dim, dt
        return Cache.init([RingKVEntry.init(batch, max_len, c.sliding_window, *kv) if c.is_sliding[i]
                           else KVEntry.init(batch, max_len, *kv) for i in range(c.num_layers)], batch, max_len)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, N] -> [B, N, H] (Gemma scales by sqrt(H) cast to the parameter dtype)."""
        x = embed_rows(self.embed_tokens, tokens)
        if self.config.embed_scale != 1.0:
            x = x * jnp.asarray(self.config.embed_scale, x.dtype)
        return x

    def head(self, h: jax.Array, vocab: jax.Array | None = None) -> jax.Array:
        """Final hidden (already normed) [..., H] -> float32 logits [..., V], or [..., K] for the K token
        ids in `vocab` only. The drafter reuses it (with its draft vocabulary)."""
        logits = lm_logits(h, self.embed_tokens, self.lm_head, vocab)
        cap = self.config.final_logit_softcapping
        return cap * jnp.tanh(logits / cap) if cap else logits

    def __call__(self, tokens, segment: Segment, cache: Cache, *, tap_layers=(), logits_idx=None):
        """Append N tokens to the cache and return (logits, taps, pending cache).

        tokens: [B, N] int; segment: their positions and visibility (parents and lengths do not matter to
        attention: right padding is never committed and left padding is hidden by cache.start);
        tap_layers: static tuple of layer ids whose outputs are returned concatenated as the taps,
        [B, N, len(tap_layers) * H] (None without tap layers);
        logits_idx: optional [B, M] rows to project (e.g. only the last prompt token) -> logits [B, M, V].
        """
        mask, key_pos, ring = masks(segment, cache)
        x = self.embed(tokens)
        entries, tapped = list(cache.layers), {}
        for i, layer in enumerate(self.layers):
            m = ring if isinstance(entries[i], RingKVEntry) else mask
            x, entries[i] = layer(x, segment.positions, entries[i], cache.length, m, key_pos)
            if i in tap_layers:
                tapped[i] = x
        return (*finish(self, x, tapped, tap_layers, logits_idx), dataclasses.replace(cache, layers=tuple(entries)))
