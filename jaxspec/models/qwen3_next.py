"""Hybrid Gated DeltaNet targets: Qwen3-Next (`qwen3_next`) and Qwen3.5 / Qwen3.6 (`qwen3_5_text`,
`qwen3_5_moe_text`, and the text model inside the `qwen3_5` / `qwen3_5_moe` multimodal configs).

Layers alternate by `layer_types`: "linear_attention" (Gated DeltaNet, gated_deltanet.py) and
"full_attention" (gated attention: an output gate from a doubled q_proj, (1 + w) q/k norms, partial RoPE).
Every norm is the (1 + w) RMSNorm. The FFN is a dense SwiGLU (Qwen3.5) or the sparse MoE with a gated
shared expert (Qwen3-Next, Qwen3.5-MoE). Qwen3.5's M-RoPE reduces to 1-D RoPE for text, which is all a
text target sees.

`HybridLM.__call__` is the family's one forward, like `DenseLM`'s: attention layers write K/V slots,
GDN layers attach pending state that `advance` or `commit` folds in (cache.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache import Cache, KVEntry
from jaxspec.config import ConfigError, RopeConfig, _rope, check_values, eos_ids
from jaxspec.models.attention import Attention, AttentionSpec, attend_and_write, cache_mask
from jaxspec.models.gated_deltanet import MODES, GatedDeltaNet, GDNEntry, GDNSpec
from jaxspec.models.layers import (
    MLP,
    Linear,
    RMSNorm,
    apply_rope,
    embed_rows,
    finish,
    lm_logits,
    param,
    project,
    rope_inv_freq,
)
from jaxspec.models.moe import SparseMoeBlock
from jaxspec.segment import Segment

HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")
_TEXT_OF = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}  # multimodal config -> its text model


@dataclass(frozen=True)
class HybridConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # partial RoPE: the first rotary_dim dims of each head rotate
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention"
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    fused_projections: bool = False  # Qwen3-Next's in_proj_qkvz / in_proj_ba
    moe_layers: tuple[bool, ...] = ()  # per layer: sparse MoE (else dense MLP)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    gdn_mode: str = "exact"  # tree verification in GDN layers: exact | reference | leaky (benchmarks only)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def replace(self, **kw) -> "HybridConfig":
        return dataclasses.replace(self, **kw)


def hybrid_config_from_dict(d: dict) -> HybridConfig:
    """Parse a HF config dict of the hybrid family (multimodal wrappers read their text_config)."""
    model_type = d.get("model_type")
    if model_type not in HYBRID_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not a hybrid GDN model; "
                          f"this family reads: {', '.join(HYBRID_TYPES)}")
    if model_type in _TEXT_OF:
        text = dict(d.get("text_config") or {})
        text["model_type"] = _TEXT_OF[model_type]
        for key in ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings"):
            if key in d:
                text.setdefault(key, d[key])
        return hybrid_config_from_dict(text)

    import transformers  # fills defaults, derives layer_types, standardises rope_parameters

    kw = {k: v for k, v in d.items() if k not in ("model_type", "architectures", "auto_map", "transformers_version")}
    try:
        hf = transformers.AutoConfig.for_model(model_type, **kw)
    except Exception as e:  # transformers raises many types for malformed values
        raise ConfigError(f"config.json for {model_type} is invalid: {e}") from e
    if hf.hidden_act != "silu":
        raise ConfigError(f"unsupported hidden_act {hf.hidden_act!r} for {model_type}; the hybrid family runs silu")
    L, head_dim = hf.num_hidden_layers, hf.head_dim
    what = f"config.json for {model_type}"
    check_values(what, dict(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_hidden_layers=L,
                            num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
                            head_dim=head_dim, linear_num_key_heads=hf.linear_num_key_heads,
                            linear_num_value_heads=hf.linear_num_value_heads,
                            linear_key_head_dim=hf.linear_key_head_dim, linear_value_head_dim=hf.linear_value_head_dim,
                            linear_conv_kernel_dim=hf.linear_conv_kernel_dim,
                            max_position_embeddings=hf.max_position_embeddings),
                 dict(rms_norm_eps=hf.rms_norm_eps))
    if hf.num_attention_heads % hf.num_key_value_heads:
        raise ConfigError(f"{what} is invalid: num_attention_heads {hf.num_attention_heads} is not a multiple of "
                          f"num_key_value_heads {hf.num_key_value_heads}; re-download the model or correct the value")
    rp = dict(getattr(hf, "rope_parameters", None) or {})
    rotary_dim = int(head_dim * float(rp.get("partial_rotary_factor", 1.0)))
    layer_types = tuple(hf.layer_types)
    if set(layer_types) - {"linear_attention", "full_attention"}:
        raise ConfigError(f"unknown layer_types {sorted(set(layer_types))} in config.json for {model_type}")
    E = int(getattr(hf, "num_experts", 0) or 0)
    if model_type == "qwen3_next":
        step, only = int(hf.decoder_sparse_step), set(hf.mlp_only_layers or ())
        moe = tuple(i not in only and E > 0 and (i + 1) % step == 0 for i in range(L))
    else:
        moe = (model_type == "qwen3_5_moe_text",) * L
    if not all(moe):  # the dense MLP layers' width
        check_values(what, dict(intermediate_size=getattr(hf, "intermediate_size", None)))
    if any(moe):
        check_values(what, dict(num_experts=E, num_experts_per_tok=getattr(hf, "num_experts_per_tok", None),
                                moe_intermediate_size=getattr(hf, "moe_intermediate_size", None)))
    Hk, Hv = hf.linear_num_key_heads, hf.linear_num_value_heads
    if Hv % Hk:
        raise ConfigError(f"linear_num_value_heads ({Hv}) must be a multiple of linear_num_key_heads ({Hk})")
    return HybridConfig(
        model_type=model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=int(getattr(hf, "intermediate_size", 0) or 0), num_layers=L,
        num_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads, head_dim=head_dim,
        rotary_dim=rotary_dim, layer_types=layer_types, linear_num_key_heads=Hk, linear_num_value_heads=Hv,
        linear_key_head_dim=hf.linear_key_head_dim, linear_value_head_dim=hf.linear_value_head_dim,
        linear_conv_kernel_dim=hf.linear_conv_kernel_dim, fused_projections=model_type == "qwen3_next",
        moe_layers=moe, num_experts=E, num_experts_per_tok=int(getattr(hf, "num_experts_per_tok", 0) or 0),
        moe_intermediate_size=int(getattr(hf, "moe_intermediate_size", 0) or 0),
        shared_expert_intermediate_size=int(getattr(hf, "shared_expert_intermediate_size", 0) or 0),
        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", True)),  # Qwen3.5-MoE always renormalises
        rms_norm_eps=float(hf.rms_norm_eps), max_position_embeddings=int(hf.max_position_embeddings),
        rope=_rope({k: v for k, v in rp.items() if k in ("rope_type", "rope_theta", "factor")}),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        bos_token_id=getattr(hf, "bos_token_id", None), eos_token_ids=eos_ids(getattr(hf, "eos_token_id", None)),
        pad_token_id=getattr(hf, "pad_token_id", None),
    )


class GatedAttention(Attention):
    """Full attention of the hybrid family: q_proj yields per head [q_h | gate_h], the output is multiplied
    by sigmoid(gate) before o_proj; (1 + w) q/k norms; RoPE on the first `rotary_dim` dims only."""

    def __init__(self, spec: AttentionSpec, rotary_dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(spec, dtype=dtype, rngs=rngs)  # k/v/o projections and the q/k norms
        H, nH, D = spec.hidden_size, spec.num_heads, spec.head_dim
        self.rotary_dim = rotary_dim
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(rotary_dim, spec.rope))
        self.q_proj = Linear(H, 2 * nH * D,  # replaces the parent's: per head [q_h | gate_h]
                              ("embed", "q_heads"), bias=spec.bias, dtype=dtype, rngs=rngs)

    def rope(self, x, positions):
        r = self.rotary_dim
        rot = apply_rope(x[..., :r], positions, jnp.asarray(self.inv_freq, jnp.float32))
        return jnp.concatenate([rot, x[..., r:]], axis=-1)

    def __call__(self, x, positions, entry: KVEntry, length, mask, key_pos):
        B, N, _ = x.shape
        nH, nKV, D = self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim
        qg, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q, gate = jnp.split(qg.reshape(B, N, nH, 2 * D), 2, axis=-1)
        q = self.rope(self.q_norm(q), positions)
        k = self.rope(self.k_norm(k.reshape(B, N, nKV, D)), positions)
        o, entry = attend_and_write(q, entry, k, v.reshape(B, N, nKV, D), length, mask, self.spec.scale, ranged=True)
        o = o.reshape(B, N, nH * D)
        return self.o_proj(o * jax.nn.sigmoid(gate.reshape(B, N, nH * D))), entry


class HybridLayer(nnx.Module):
    def __init__(self, cfg: HybridConfig, layer: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        H = cfg.hidden_size
        self.linear = cfg.layer_types[layer] == "linear_attention"
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, plus_one=True, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps, plus_one=True, dtype=dtype)
        if self.linear:
            self.linear_attn = GatedDeltaNet(gdn_spec(cfg), dtype=dtype, rngs=rngs)
        else:
            spec = AttentionSpec(hidden_size=H, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                 head_dim=cfg.head_dim, rope=cfg.rope, scale=cfg.head_dim**-0.5, eps=cfg.rms_norm_eps,
                                 bias=cfg.attention_bias, qk_norm=True, norm_plus_one=True)
            self.self_attn = GatedAttention(spec, cfg.rotary_dim, dtype=dtype, rngs=rngs)
        if cfg.moe_layers[layer]:
            self.mlp = SparseMoeBlock(H, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                                      cfg.shared_expert_intermediate_size, cfg.norm_topk_prob, dtype=dtype, rngs=rngs)
        else:
            self.mlp = MLP(H, cfg.intermediate_size, "silu", dtype=dtype, rngs=rngs)

    def __call__(self, x, segment: Segment, entry, length, mask, key_pos, real):
        h = self.input_layernorm(x)
        if self.linear:
            a, entry = self.linear_attn(h, segment, entry, real)
        else:
            a, entry = self.self_attn(h, segment.positions, entry, length, mask, key_pos)
        h = x + a
        return h + self.mlp(self.post_attention_layernorm(h)), entry


def gdn_spec(cfg: HybridConfig) -> GDNSpec:
    if cfg.gdn_mode not in MODES:
        raise ConfigError(f"unknown gdn_mode {cfg.gdn_mode!r}; use one of {', '.join(MODES)}")
    return GDNSpec(hidden_size=cfg.hidden_size, num_key_heads=cfg.linear_num_key_heads,
                   num_value_heads=cfg.linear_num_value_heads, key_dim=cfg.linear_key_head_dim,
                   value_dim=cfg.linear_value_head_dim, conv_kernel=cfg.linear_conv_kernel_dim, eps=cfg.rms_norm_eps,
                   fused=cfg.fused_projections, mode=cfg.gdn_mode)


class HybridLM(nnx.Module):
    def __init__(self, cfg: HybridConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = param(jax.random.normal(rngs.params(), (cfg.vocab_size, H), dtype) * 0.02,
                                  ("vocab", "embed"))
        self.layers = nnx.List([HybridLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps, plus_one=True, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(H, cfg.vocab_size, ("embed", "vocab"), dtype=dtype,
                                                                   rngs=rngs)

    def init_cache(self, batch: int, max_len: int) -> Cache:
        c, s = self.config, gdn_spec(self.config)
        dt = self.embed_tokens.dtype
        return Cache.init([GDNEntry.init(batch, s, dt) if t == "linear_attention"
                           else KVEntry.init(batch, max_len, c.num_kv_heads, c.head_dim, dt)
                           for t in c.layer_types], batch, max_len)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, N] -> [B, N, H]."""
        return embed_rows(self.embed_tokens, tokens)

    def head(self, h: jax.Array, vocab: jax.Array | None = None) -> jax.Array:
        """Final hidden (already normed) [..., H] -> float32 logits [..., V] (or [..., K] for `vocab` ids)."""
        return lm_logits(h, self.embed_tokens, self.lm_head, vocab)

    def __call__(self, tokens, segment: Segment, cache: Cache, *, tap_layers=(), logits_idx=None):
        """Append N tokens and return (logits, taps, pending cache); arguments as `DenseLM.__call__`.
        GDN layers fold exactly `segment.lengths` real tokens per row (slots before `cache.start` are left
        padding and fold as identity steps), so the engine advances by those lengths."""
        B, N = tokens.shape
        mask, key_pos = cache_mask(segment.positions, cache.length, cache.start, segment.visible, cache.max_len)
        i = jnp.arange(N)[None]
        real = (cache.length[:, None] + i >= cache.start[:, None]) & (i < segment.lengths[:, None])  # [B, N]
        x = self.embed(tokens)
        entries, tapped = list(cache.layers), {}
        for n, layer in enumerate(self.layers):
            x, entries[n] = layer(x, segment, entries[n], cache.length, mask, key_pos, real)
            if n in tap_layers:
                tapped[n] = x
        return (*finish(self, x, tapped, tap_layers, logits_idx), dataclasses.replace(cache, layers=tuple(entries)))
