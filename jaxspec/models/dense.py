"""Dense decoder-only targets: Llama (incl. llama3 RoPE), Qwen3 (q/k norm), Gemma 3 text.

Gemma 3 differs by (1+w) sandwich norms, sqrt(H) embedding scale, `query_pre_attn_scalar`, GeGLU,
5:1 sliding/global layers with their own RoPE tables, and tied embeddings; all are config switches.

`DenseLM.__call__` is the one forward entry point: it appends N tokens at explicit positions with an
explicit visibility mask over `[cache | new]` and writes their K/V into the cache (not committing them:
`cache.length` is unchanged). Prefill, AR decode and tree verification are all this call.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache import KVCache
from jaxspec.config import DenseConfig
from jaxspec.models.attention import Attention, cache_mask
from jaxspec.models.layers import MLP, Linear, RMSNorm


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DenseConfig, layer: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, plus_one=cfg.norm_plus_one, dtype=dtype)  # noqa: E731
        self.sandwich = cfg.sandwich_norm
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, layer, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def __call__(self, x, positions, k, v, length, mask, key_pos):
        a, k, v = self.self_attn(self.input_layernorm(x), positions, k, v, length, mask, key_pos)
        if self.sandwich:
            h = x + self.post_attention_layernorm(a)
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))), k, v
        h = x + a
        return h + self.mlp(self.post_attention_layernorm(h)), k, v


class DenseLM(nnx.Module):
    def __init__(self, cfg: DenseConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, H), dtype) * 0.02)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps, plus_one=cfg.norm_plus_one, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(H, cfg.vocab_size, dtype=dtype, rngs=rngs)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache.init(c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim, self.embed_tokens.dtype)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, N] -> [B, N, H] (Gemma scales by sqrt(H) cast to the parameter dtype)."""
        E = self.embed_tokens[...]
        x = jnp.take(E, tokens, axis=0)
        if self.config.embed_scale != 1.0:
            x = x * jnp.asarray(self.config.embed_scale, E.dtype)
        return x

    def head(self, h: jax.Array, vocab: jax.Array | None = None) -> jax.Array:
        """Final hidden (already normed) [..., H] -> float32 logits [..., V], or [..., K] for the K token
        ids in `vocab` only. The drafter reuses it (with its draft vocabulary)."""
        if self.lm_head is None:
            W = self.embed_tokens[...] if vocab is None else jnp.take(self.embed_tokens[...], vocab, axis=0)
            logits = jnp.einsum("...h,vh->...v", h, W, preferred_element_type=jnp.float32)
        else:
            W = self.lm_head.kernel[...] if vocab is None else jnp.take(self.lm_head.kernel[...], vocab, axis=1)
            logits = jnp.einsum("...h,hv->...v", h, W, preferred_element_type=jnp.float32)
        cap = self.config.final_logit_softcapping
        return cap * jnp.tanh(logits / cap) if cap else logits

    def __call__(self, tokens, positions, cache: KVCache, visible, *, taps=(), logits_idx=None):
        """Append N tokens to the cache and return (logits, taps, pending cache).

        tokens, positions: [B, N] int; visible: [B, N, N] bool (new token i sees new token j);
        taps: static tuple of layer ids whose outputs are returned concatenated, [B, N, len(taps) * H];
        logits_idx: optional [B, M] rows to project (e.g. only the last prompt token) -> logits [B, M, V].
        """
        mask, key_pos = cache_mask(positions, cache.length, cache.start, visible, cache.max_len)
        x = self.embed(tokens)
        ks, vs, tapped = list(cache.k), list(cache.v), {}
        for i, layer in enumerate(self.layers):
            x, ks[i], vs[i] = layer(x, positions, ks[i], vs[i], cache.length, mask, key_pos)
            if i in taps:
                tapped[i] = x
        if logits_idx is not None:
            x = jnp.take_along_axis(x, logits_idx[..., None], axis=1)
        logits = self.head(self.norm(x))
        tap_out = jnp.concatenate([tapped[t] for t in taps], -1) if taps else None
        return logits, tap_out, KVCache(tuple(ks), tuple(vs), cache.length, cache.start)
