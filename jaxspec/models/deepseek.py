"""The MLA + MoE family: DeepSeek-V3 and Kimi K2 (K2-Thinking, and the text model of K2.5 / K2.6).

Kimi K2 is DeepSeek-V3's architecture with other sizes (64 heads, 384 experts, n_group 1, routed scale
2.827, YaRN with beta_fast = beta_slow = 1); its config.json says `kimi_k2`, which transformers does not
know, so it is parsed as `deepseek_v3`. `kimi_k25` is a VLM whose `text_config` is such a model.

Layers: input norm -> MLA (models/mla.py) -> residual -> post-attention norm -> dense MLP for the first
`first_k_dense_replace` layers, MoE (models/moe.py) after -> residual. `DeepseekLM.__call__` is the family's
one forward, with the dense family's signature: it appends a `Segment` behind a cache of `LatentEntry`s.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache import Cache, LatentEntry
from jaxspec.config import ConfigError, RopeConfig, check_values, eos_ids
from jaxspec.models.attention import cache_mask
from jaxspec.models.layers import MLP, Linear, RMSNorm, embed_rows, finish, lm_logits, param
from jaxspec.models.mla import MLA, MLARope, MLASpec, absorb_threshold, rope_tables, softmax_scale
from jaxspec.models.moe import MoE
from jaxspec.segment import Segment

DEEPSEEK_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25")


@dataclass(frozen=True)
class DeepseekConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    moe_intermediate_size: int  # one expert's (and, times n_shared_experts, the shared experts')
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    rope: MLARope
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    absorb_max_tokens: int | None = None  # None: the FLOP crossover, `mla.absorb_threshold`

    def replace(self, **kw) -> "DeepseekConfig":
        return dataclasses.replace(self, **kw)


def deepseek_config_from_dict(d: dict) -> DeepseekConfig:
    """Parse a DeepSeek-V3 / Kimi K2 / Kimi K2.5 config.json dict."""
    model_type = d.get("model_type")
    if model_type not in DEEPSEEK_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not an MLA + MoE model; "
                          f"this family reads: {', '.join(DEEPSEEK_TYPES)}")
    if model_type == "kimi_k25":  # VLM: the language model lives in text_config
        text = dict(d.get("text_config") or {})
        if not text:
            raise ConfigError("kimi_k25 config.json has no text_config; is it a complete Kimi K2.5 config?")
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            text.setdefault(key, d.get(key))
        return dataclasses.replace(deepseek_config_from_dict({**text, "model_type": "kimi_k2"}), model_type=model_type)

    import transformers  # fills defaults and standardises rope_parameters (legacy rope_scaling too)

    kw = {k: v for k, v in d.items()
          if k not in ("model_type", "architectures", "auto_map", "transformers_version", "quantization_config")}
    try:
        hf = transformers.AutoConfig.for_model("deepseek_v3", **kw)
    except Exception as e:  # transformers raises many types for malformed values
        raise ConfigError(f"config.json for {model_type} is invalid: {e}") from e
    sizes = dict(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
                 moe_intermediate_size=hf.moe_intermediate_size, num_hidden_layers=hf.num_hidden_layers,
                 num_attention_heads=hf.num_attention_heads, kv_lora_rank=hf.kv_lora_rank,
                 qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
                 n_routed_experts=hf.n_routed_experts, num_experts_per_tok=hf.num_experts_per_tok,
                 n_group=hf.n_group, topk_group=hf.topk_group, max_position_embeddings=hf.max_position_embeddings)
    if hf.q_lora_rank is not None:  # None: q projected directly (no low-rank query)
        sizes["q_lora_rank"] = hf.q_lora_rank
    what = f"config.json for {model_type}"
    check_values(what, sizes, dict(rms_norm_eps=hf.rms_norm_eps, routed_scaling_factor=hf.routed_scaling_factor))
    if hf.n_routed_experts % hf.n_group or hf.topk_group > hf.n_group or hf.num_experts_per_tok > hf.n_routed_experts:
        raise ConfigError(f"{what} is invalid: {hf.n_routed_experts} routed experts in {hf.n_group} groups, "
                          f"{hf.topk_group} groups and {hf.num_experts_per_tok} experts chosen per token; re-download "
                          "the model or correct the values")
    rp = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = rp.get("rope_type", rp.get("type", "default")) or "default"
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"unsupported rope_type {rope_type!r}; the DeepSeek family supports default and yarn")
    orig = rp.get("original_max_position_embeddings")
    factor = rp.get("factor")
    if rope_type == "yarn":
        if orig is None:
            raise ConfigError("yarn rope_parameters need original_max_position_embeddings; copy it from the model card")
        factor = float(factor) if factor is not None else hf.max_position_embeddings / orig
    rope = MLARope(theta=float(rp.get("rope_theta", 10000.0)), rope_type=rope_type, factor=factor,
                   original_max_position_embeddings=orig, beta_fast=float(rp.get("beta_fast") or 32),
                   beta_slow=float(rp.get("beta_slow") or 1), mscale=rp.get("mscale"),
                   mscale_all_dim=rp.get("mscale_all_dim"), attention_factor=rp.get("attention_factor"),
                   truncate=bool(rp.get("truncate", True)))
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported activation {hf.hidden_act!r}; the DeepSeek family uses silu")
    return DeepseekConfig(
        model_type=model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, moe_intermediate_size=hf.moe_intermediate_size,
        num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads, q_lora_rank=hf.q_lora_rank,
        kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim, n_routed_experts=hf.n_routed_experts, num_experts_per_tok=hf.num_experts_per_tok,
        n_shared_experts=hf.n_shared_experts, n_group=hf.n_group, topk_group=hf.topk_group,
        routed_scaling_factor=float(hf.routed_scaling_factor), norm_topk_prob=bool(hf.norm_topk_prob),
        first_k_dense_replace=hf.first_k_dense_replace, rope=rope, rope_interleave=bool(hf.rope_interleave),
        rms_norm_eps=float(hf.rms_norm_eps), max_position_embeddings=int(hf.max_position_embeddings),
        attention_bias=bool(hf.attention_bias), tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        bos_token_id=getattr(hf, "bos_token_id", None), eos_token_ids=eos_ids(getattr(hf, "eos_token_id", None)),
        pad_token_id=getattr(hf, "pad_token_id", None),
    )


def mla_spec(cfg: DeepseekConfig) -> MLASpec:
    inv_freq, rope_factor = rope_tables(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings)
    return MLASpec(
        hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, inv_freq=tuple(float(f) for f in inv_freq), rope_factor=rope_factor,
        scale=softmax_scale(cfg.rope, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), interleave=cfg.rope_interleave,
        bias=cfg.attention_bias,
        absorb_max_tokens=(absorb_threshold(cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim)
                           if cfg.absorb_max_tokens is None else cfg.absorb_max_tokens),
    )


def drafter_geometry(c: DeepseekConfig) -> dict:
    """A DFlash drafter is a GQA model: heads of v_head_dim width spanning the hidden size, 8 KV heads at most,
    the dense layers' MLP width, and plain RoPE at the target's base (the drafter's positions stay short)."""
    num_heads = max(1, c.hidden_size // c.v_head_dim)
    num_kv = next(k for k in (8, 4, 2, 1) if num_heads % k == 0)
    return dict(intermediate_size=c.intermediate_size, num_heads=num_heads, num_kv_heads=num_kv,
                head_dim=c.v_head_dim, rms_norm_eps=c.rms_norm_eps, rope=RopeConfig(theta=c.rope.theta),
                max_position_embeddings=c.max_position_embeddings)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DeepseekConfig, spec: MLASpec, layer: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = MLA(spec, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        if layer < cfg.first_k_dense_replace:
            self.mlp = MLP(H, cfg.intermediate_size, "silu", dtype=dtype, rngs=rngs)
        else:
            self.mlp = MoE(H, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.n_shared_experts,
                           top_k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
                           norm_topk_prob=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, entry: LatentEntry, length, mask):
        a, entry = self.self_attn(self.input_layernorm(x), positions, entry, length, mask)
        h = x + a
        return h + self.mlp(self.post_attention_layernorm(h)), entry


class DeepseekLM(nnx.Module):
    def __init__(self, cfg: DeepseekConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        H = cfg.hidden_size
        spec = mla_spec(cfg)
        self.embed_tokens = param(jax.random.normal(rngs.params(), (cfg.vocab_size, H), dtype) * 0.02,
                                  ("vocab", "embed"))
        self.layers = nnx.List([DecoderLayer(cfg, spec, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else Linear(H, cfg.vocab_size, ("embed", "vocab"), dtype=dtype, rngs=rngs))

    def init_cache(self, batch: int, max_len: int) -> Cache:
        c = self.config
        width = c.kv_lora_rank + c.qk_rope_head_dim
        dt = self.embed_tokens.dtype
        return Cache.init([LatentEntry.init(batch, max_len, width, dt) for _ in range(c.num_layers)], batch, max_len)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, N] -> [B, N, H]."""
        return embed_rows(self.embed_tokens, tokens)

    def head(self, h: jax.Array, vocab: jax.Array | None = None) -> jax.Array:
        """Final hidden (normed) [..., H] -> float32 logits [..., V], or [..., K] for the token ids in `vocab`."""
        return lm_logits(h, self.embed_tokens, self.lm_head, vocab)

    def __call__(self, tokens, segment: Segment, cache: Cache, *, tap_layers=(), logits_idx=None):
        """Append N tokens to the cache and return (logits, taps, pending cache); the contract of
        `DenseLM.__call__` (models/dense.py)."""
        mask, _ = cache_mask(segment.positions, cache.length, cache.start, segment.visible, cache.max_len)
        x = self.embed(tokens)
        entries, tapped = list(cache.layers), {}
        for i, layer in enumerate(self.layers):
            x, entries[i] = layer(x, segment.positions, entries[i], cache.length, mask)
            if i in tap_layers:
                tapped[i] = x
        return (*finish(self, x, tapped, tap_layers, logits_idx), dataclasses.replace(cache, layers=tuple(entries)))
