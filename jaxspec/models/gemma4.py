"""Gemma 4 text targets: `gemma4_text`, and the text model inside the multimodal `gemma4` config.

A Gemma 3-like decoder (sandwich norms, GeGLU, sqrt(H)-scaled tied embedding, sliding and full layers from
`layer_types`) with these differences, all switches of `Gemma4TextConfig`:

  * every RMSNorm is plain `w * x_hat`, multiplied in float32 (not Gemma 3's 1 + w); q_norm and k_norm are
    weighted, v_norm (and the router's norm) have no weight; the softmax scale is 1 (the norms set it);
  * the two layer types differ in geometry: full layers use `global_head_dim` and, with `attention_k_eq_v`,
    `num_global_key_value_heads` and no v_proj (V is k_proj's output through v_norm, before k_norm and RoPE);
  * each layer type has its own RoPE table: sliding layers default RoPE, full layers "proportional" RoPE
    (only the first partial_rotary_factor * head_dim / 2 frequencies rotate; the rest have frequency 0);
  * per-layer inputs (PLE, `hidden_size_per_layer_input` P > 0): a second embedding [V_ple, L * P] plus a
    projection of the main embedding give every layer a P-vector per token, which the layer gates in after
    its MLP;
  * KV sharing (`num_kv_shared_layers`): the last layers compute no K/V; each reads the K/V of the last
    earlier layer of its own type. Such a layer owns no cache entry, so the cache holds one entry per
    *computing* layer and a commit moves every entry once;
  * an optional MoE branch beside the dense MLP (`enable_moe_block`), a double-wide MLP on the KV-sharing
    layers (`use_double_wide_mlp`), a learned per-layer output scalar, and final logit soft-capping.

`Gemma4LM.__call__` is the family's one forward, with `DenseLM.__call__`'s contract (models/dense.py).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.cache import Cache, KVEntry, RingKVEntry
from jaxspec.config import ConfigError, RopeConfig, check_values, eos_ids
from jaxspec.models.attention import attend, attend_and_write, attend_cache, attend_ring, masks, sliding
from jaxspec.models.layers import MLP, Linear, apply_rope, embed_rows, finish, lm_logits, param
from jaxspec.models.moe import GATHER_MAX_PAIRS, experts_gather, experts_ragged
from jaxspec.segment import Segment

GEMMA4_TYPES = ("gemma4_text", "gemma4")  # gemma4: the multimodal config, whose text_config is the model
_ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class Gemma4Rope:
    """One layer type's RoPE: "default" rotates every dim pair; "proportional" the first
    int(partial_rotary_factor * head_dim / 2) pairs only, with exponents over the whole head_dim."""

    rope_type: str = "default"
    theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@dataclass(frozen=True)
class Gemma4Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_types: tuple[str, ...]  # "sliding_attention" | "full_attention" per layer
    head_dims: tuple[int, ...]  # per layer: head_dim (sliding) or global_head_dim (full)
    kv_heads: tuple[int, ...]  # per layer
    kv_source: tuple[int, ...]  # per layer: the layer whose K/V it attends to (itself unless KV-shared)
    sliding_window: int
    rope_sliding: Gemma4Rope = Gemma4Rope()
    rope_full: Gemma4Rope = Gemma4Rope("proportional", 1e6, 0.25)
    attention_k_eq_v: bool = False  # full layers: V = v_norm(k_proj(x)), no v_proj
    hidden_size_per_layer_input: int = 0  # PLE width P (0: no per-layer inputs)
    vocab_size_per_layer_input: int = 0
    use_double_wide_mlp: bool = False  # KV-shared layers' MLP is 2 x intermediate_size
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    final_logit_softcapping: float | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    hidden_act: str = "gelu_tanh"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @property
    def kv_shared(self) -> tuple[bool, ...]:
        return tuple(s != i for i, s in enumerate(self.kv_source))

    @property
    def cache_slots(self) -> tuple[int, ...]:
        """Per layer: the index of the cache entry it writes (or, KV-shared, reads)."""
        own = [i for i, s in enumerate(self.kv_source) if s == i]
        return tuple(own.index(s) for s in self.kv_source)

    def replace(self, **kw) -> "Gemma4Config":
        return dataclasses.replace(self, **kw)


def _rope_of(params: dict | None, layer_type: str) -> Gemma4Rope:
    p = dict(params or {})
    rope_type = p.get("rope_type", "default") or "default"
    if rope_type not in ("default", "proportional"):
        raise ConfigError(f"unsupported rope_type {rope_type!r} for Gemma 4 {layer_type} layers; "
                          "jaxspec supports default and proportional")
    return Gemma4Rope(rope_type, float(p.get("rope_theta", 10000.0)), float(p.get("partial_rotary_factor", 1.0)),
                      float(p.get("factor", 1.0) or 1.0))


def gemma4_config_from_dict(d: dict) -> Gemma4Config:
    """Parse a `gemma4_text` config dict, or a `gemma4` one (its text_config)."""
    model_type = d.get("model_type")
    if model_type not in GEMMA4_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not a Gemma 4 model; "
                          f"this family reads: {', '.join(GEMMA4_TYPES)}")
    if model_type == "gemma4":
        text = dict(d.get("text_config") or {})
        if not text:
            raise ConfigError("gemma4 config.json has no text_config; is it a complete Gemma 4 config?")
        for key in ("bos_token_id", "pad_token_id", "tie_word_embeddings"):
            if key in d:
                text.setdefault(key, d[key])
        cfg = gemma4_config_from_dict({**text, "model_type": "gemma4_text"})
        # the wrapper's EOS list (end of turn too) is what generation stops on; keep the text model's as well
        return cfg.replace(model_type=model_type, eos_token_ids=eos_ids(cfg.eos_token_ids, d.get("eos_token_id")))

    import transformers  # fills defaults, derives layer_types, per-layer geometry and the KV-sharing modes

    kw = {k: v for k, v in d.items() if k not in ("model_type", "architectures", "auto_map", "transformers_version")}
    try:
        hf = transformers.AutoConfig.for_model("gemma4_text", **kw)
        modes = hf.kv_sharing_modes
    except Exception as e:  # transformers raises many types for malformed values
        raise ConfigError(f"config.json for {model_type} is invalid: {e}") from e
    if hf.use_bidirectional_attention == "all":
        raise ConfigError("use_bidirectional_attention='all' makes a non-causal encoder; jaxspec decodes causal models")
    act = _ACTS.get(hf.hidden_activation)
    if act is None:
        raise ConfigError(f"unsupported hidden_activation {hf.hidden_activation!r} for Gemma 4 "
                          "(supported: gelu_pytorch_tanh)")
    L = hf.num_hidden_layers
    what = f"config.json for {model_type}"
    check_values(what, dict(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
                            intermediate_size=hf.intermediate_size, num_hidden_layers=L,
                            num_attention_heads=hf.num_attention_heads, sliding_window=hf.sliding_window,
                            max_position_embeddings=hf.max_position_embeddings), dict(rms_norm_eps=hf.rms_norm_eps))
    layer_types = tuple(hf.layer_types)
    if set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ConfigError(f"unknown layer_types {sorted(set(layer_types))} in config.json for {model_type}")
    if all(m == "reuse" for m in modes):
        raise ConfigError(f"num_kv_shared_layers ({hf.num_kv_shared_layers}) leaves no layer that computes K/V")
    store = {layer_types[i]: i for i, m in enumerate(modes) if m == "store"}
    kv_source = tuple(store[t] if m == "reuse" else i for i, (t, m) in enumerate(zip(layer_types, modes)))
    per_layer = [hf.per_layer_config[i] for i in range(L)]
    for i, c in enumerate(per_layer):
        check_values(f"{what} (layer {i})", dict(head_dim=c.head_dim, num_key_value_heads=c.num_key_value_heads))
        if hf.num_attention_heads % c.num_key_value_heads:
            raise ConfigError(f"{what} is invalid: num_attention_heads {hf.num_attention_heads} is not a multiple of "
                              f"layer {i}'s {c.num_key_value_heads} KV heads; re-download the model or correct it")
    rp = hf.rope_parameters or {}
    E = int(hf.num_experts or 0) if hf.enable_moe_block else 0
    if hf.enable_moe_block and not (E and hf.top_k_experts and hf.moe_intermediate_size):
        raise ConfigError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size in config.json")
    return Gemma4Config(
        model_type=model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_layers=L, num_heads=hf.num_attention_heads,
        layer_types=layer_types, head_dims=tuple(int(c.head_dim) for c in per_layer),
        kv_heads=tuple(int(c.num_key_value_heads) for c in per_layer), kv_source=kv_source,
        sliding_window=int(hf.sliding_window),
        rope_sliding=_rope_of(rp.get("sliding_attention"), "sliding_attention"),
        rope_full=_rope_of(rp.get("full_attention"), "full_attention"),
        attention_k_eq_v=bool(hf.attention_k_eq_v),
        hidden_size_per_layer_input=int(hf.hidden_size_per_layer_input or 0),
        vocab_size_per_layer_input=int(hf.vocab_size_per_layer_input or 0),
        use_double_wide_mlp=bool(hf.use_double_wide_mlp), enable_moe_block=bool(hf.enable_moe_block),
        num_experts=E, top_k_experts=int(hf.top_k_experts or 0) if E else 0,
        moe_intermediate_size=int(hf.moe_intermediate_size or 0) if E else 0,
        final_logit_softcapping=hf.final_logit_softcapping, rms_norm_eps=float(hf.rms_norm_eps),
        max_position_embeddings=int(hf.max_position_embeddings),
        tie_word_embeddings=bool(hf.tie_word_embeddings), attention_bias=bool(hf.attention_bias), hidden_act=act,
        bos_token_id=hf.bos_token_id, eos_token_ids=eos_ids(hf.eos_token_id), pad_token_id=hf.pad_token_id,
    )


def drafter_geometry(c: Gemma4Config) -> dict:
    """A new DFlash drafter takes the sliding layers' attention shape (the common one), the dense MLP width and
    plain RoPE at the full layers' base, as z-lab's gemma-4 drafters do (theta 1e6, every dim rotated)."""
    s = c.layer_types.index("sliding_attention") if "sliding_attention" in c.layer_types else 0
    return dict(intermediate_size=c.intermediate_size, num_heads=c.num_heads, num_kv_heads=c.kv_heads[s],
                head_dim=c.head_dims[s], rms_norm_eps=c.rms_norm_eps, rope=RopeConfig(theta=c.rope_full.theta),
                max_position_embeddings=c.max_position_embeddings)


def rope_inv_freq(head_dim: int, rope: Gemma4Rope) -> np.ndarray:
    """inv_freq [head_dim / 2] (HF's default and `_compute_proportional_rope_parameters`); zero frequencies
    leave their dim pairs unrotated, so one half-split `apply_rope` serves both types."""
    n = head_dim // 2 if rope.rope_type == "default" else int(rope.partial_rotary_factor * head_dim // 2)
    exponent = np.arange(0, 2 * n, 2).astype(np.float32) / np.float32(head_dim)
    inv = np.zeros(head_dim // 2, np.float32)
    inv[:n] = np.float32(1.0) / (np.float32(rope.theta) ** exponent)
    return (inv / np.float32(rope.factor)).astype(np.float32)


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """Gemma 4's RMSNorm: x_hat (* w), both in float32, cast back to x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y if weight is None else y * weight.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Weighted Gemma 4 RMSNorm (weight initialised to ones, applied as w, not 1 + w)."""

    def __init__(self, dim: int, eps: float, *, axis: str = "embed", dtype=jnp.float32):
        self.eps = eps
        self.weight = param(jnp.ones((dim,), dtype), (axis,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


@dataclass(frozen=True)
class AttentionSpec:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    inv_freq: tuple[float, ...]
    window: int | None  # sliding window (counts the query itself); None = full
    eps: float
    bias: bool = False
    k_eq_v: bool = False  # no v_proj: V is k_proj's output (through v_norm)
    kv_shared: bool = False  # no k/v projections: attends to another layer's K/V


class Attention(nnx.Module):
    """Gemma 4 attention: q = RoPE(q_norm(q)), k = RoPE(k_norm(k)), v = v_norm(v); softmax scale 1."""

    def __init__(self, spec: AttentionSpec, *, dtype=jnp.float32, rngs: nnx.Rngs):
        H, nH, nKV, D = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.spec = spec
        self.q_proj = Linear(H, nH * D, ("embed", "q_heads"), bias=spec.bias, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(D, spec.eps, axis="head_dim", dtype=dtype)
        if not spec.kv_shared:
            self.k_proj = Linear(H, nKV * D, ("embed", "kv_heads"), bias=spec.bias, dtype=dtype, rngs=rngs)
            self.k_norm = RMSNorm(D, spec.eps, axis="head_dim", dtype=dtype)
            if not spec.k_eq_v:
                self.v_proj = Linear(H, nKV * D, ("embed", "kv_heads"), bias=spec.bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(nH * D, H, ("q_heads", "embed"), bias=spec.bias, dtype=dtype, rngs=rngs)

    def keys_values(self, x, positions):
        """x [B, N, H] -> k, v [B, N, kv_heads, D]: k normed and rotated, v normed (no weight)."""
        B, N, _ = x.shape
        s = self.spec
        k = self.k_proj(x).reshape(B, N, s.num_kv_heads, s.head_dim)
        v = k if s.k_eq_v else self.v_proj(x).reshape(B, N, s.num_kv_heads, s.head_dim)
        k = apply_rope(self.k_norm(k), positions, jnp.asarray(s.inv_freq, jnp.float32))
        return k, rms_norm(v, None, s.eps)

    def __call__(self, x, positions, entry: KVEntry | RingKVEntry, length, mask, key_pos):
        """x: [B, N, H]; mask [B, N, T] over [cache | new] (a ring entry: ring_mask's, the window in it). A KV-shared
        layer gets its source layer's entry (already holding this forward's K/V, written or pending) and leaves
        it as it is. Returns (out [B, N, H], entry)."""
        B, N, _ = x.shape
        s = self.spec
        ring = isinstance(entry, RingKVEntry)
        if s.window is not None and not ring:
            mask = sliding(mask, positions, key_pos, s.window)
        q = self.q_norm(self.q_proj(x).reshape(B, N, s.num_heads, s.head_dim))
        q = apply_rope(q, positions, jnp.asarray(s.inv_freq, jnp.float32))
        if s.kv_shared and ring:
            o = attend_cache(q, entry.k, entry.v, *entry.pending, jnp.minimum(length, entry.slots), mask, 1.0)
        elif s.kv_shared:
            o = attend(q, entry.k, entry.v, mask, 1.0)
        elif ring:
            o, entry = attend_ring(q, entry, *self.keys_values(x, positions), length, mask, 1.0)
        else:
            o, entry = attend_and_write(q, entry, *self.keys_values(x, positions), length, mask, 1.0,
                                        ranged=s.window is None)
        return self.o_proj(o.reshape(B, N, s.num_heads * s.head_dim)), entry


class Router(nnx.Module):
    """`router`: p = softmax(proj(x_hat * scale * H^-0.5)) in float32; top-k renormalised, times the
    chosen experts' `per_expert_scale`."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.top_k, self.eps = top_k, eps
        self.proj = Linear(hidden, num_experts, ("embed", "experts"), dtype=dtype, rngs=rngs)
        self.scale = param(jnp.ones((hidden,), dtype), ("embed",))
        self.per_expert_scale = param(jnp.ones((num_experts,), dtype), ("experts",))

    def __call__(self, x):
        """x [T, H] -> (weights [T, k] float32, expert ids [T, k] int32)."""
        h = rms_norm(x, None, self.eps) * self.scale[...] * jnp.asarray(x.shape[-1] ** -0.5, x.dtype)
        p = jax.nn.softmax(self.proj(h).astype(jnp.float32), axis=-1)
        w, idx = jax.lax.top_k(p, self.top_k)
        w = w / jnp.sum(w, axis=-1, keepdims=True)
        return w * self.per_expert_scale[...][idx].astype(jnp.float32), idx.astype(jnp.int32)


class Experts(nnx.Module):
    """`experts`: gate_up_proj [E, H, 2I] (gate | up, as the checkpoint fuses them) and down_proj [E, I, H], GeGLU."""

    def __init__(self, num_experts: int, hidden: int, d_ff: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        E, H, I = num_experts, hidden, d_ff
        normal = lambda shape, fan_in: jax.random.normal(rngs.params(), shape, dtype) * fan_in**-0.5  # noqa: E731
        self.gate_up_proj = param(normal((E, H, 2 * I), H), ("experts", "embed", "ffn"))
        self.down_proj = param(normal((E, I, H), I), ("experts", "ffn", "embed"))

    def __call__(self, x, w, idx):
        """x [T, H], w/idx [T, k] -> [T, H]: gathered experts for few (token, expert) pairs, ragged_dot above."""
        run = experts_gather if idx.size <= GATHER_MAX_PAIRS else experts_ragged
        return run(x, w, idx, self.gate_up_proj[...], None, self.down_proj[...],
                   act=lambda g: jax.nn.gelu(g, approximate=True))


def attention_spec(cfg: Gemma4Config, layer: int) -> AttentionSpec:
    is_sliding = cfg.layer_types[layer] == "sliding_attention"
    D = cfg.head_dims[layer]
    rope = cfg.rope_sliding if is_sliding else cfg.rope_full
    return AttentionSpec(
        hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.kv_heads[layer], head_dim=D,
        inv_freq=tuple(float(f) for f in rope_inv_freq(D, rope)), window=cfg.sliding_window if is_sliding else None,
        eps=cfg.rms_norm_eps, bias=cfg.attention_bias, k_eq_v=cfg.attention_k_eq_v and not is_sliding,
        kv_shared=cfg.kv_shared[layer],
    )


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Gemma4Config, layer: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        H, eps, P = cfg.hidden_size, cfg.rms_norm_eps, cfg.hidden_size_per_layer_input
        norm = lambda: RMSNorm(H, eps, dtype=dtype)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Attention(attention_spec(cfg, layer), dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        wide = 2 if cfg.use_double_wide_mlp and cfg.kv_shared[layer] else 1
        self.mlp = MLP(H, cfg.intermediate_size * wide, cfg.hidden_act, dtype=dtype, rngs=rngs)
        self.post_feedforward_layernorm = norm()
        self.moe = cfg.enable_moe_block
        if self.moe:
            self.router = Router(H, cfg.num_experts, cfg.top_k_experts, eps, dtype=dtype, rngs=rngs)
            self.experts = Experts(cfg.num_experts, H, cfg.moe_intermediate_size, dtype=dtype, rngs=rngs)
            self.post_feedforward_layernorm_1 = norm()
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_2 = norm()
        if P:
            self.per_layer_input_gate = Linear(H, P, ("embed", "per_layer"), dtype=dtype, rngs=rngs)
            self.per_layer_projection = Linear(P, H, ("per_layer", "embed"), dtype=dtype, rngs=rngs)
            self.post_per_layer_input_norm = norm()
        self.layer_scalar = param(jnp.ones((), dtype), ())  # a learned output scale (HF: a [1] buffer)

    def __call__(self, x, per_layer_input, positions, entry: KVEntry, length, mask, key_pos):
        """x [B, N, H]; per_layer_input [B, N, P] or None -> (x [B, N, H], entry)."""
        a, entry = self.self_attn(self.input_layernorm(x), positions, entry, length, mask, key_pos)
        x = x + self.post_attention_layernorm(a)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:  # the MoE branch reads the residual, beside the dense MLP
            flat = x.reshape(-1, x.shape[-1])
            w, idx = self.router(flat)
            moe = self.experts(self.pre_feedforward_layernorm_2(flat), w, idx).reshape(x.shape)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(moe)
        x = x + self.post_feedforward_layernorm(h)
        if per_layer_input is not None:
            g = jax.nn.gelu(self.per_layer_input_gate(x), approximate=True) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar[...], entry


class Gemma4LM(nnx.Module):
    def __init__(self, cfg: Gemma4Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        H, L, P = cfg.hidden_size, cfg.num_layers, cfg.hidden_size_per_layer_input
        self.embed_tokens = param(jax.random.normal(rngs.params(), (cfg.vocab_size, H), dtype) * 0.02,
                                  ("vocab", "embed"))
        if P:
            self.embed_tokens_per_layer = param(
                jax.random.normal(rngs.params(), (cfg.vocab_size_per_layer_input, L * P), dtype) * 0.02,
                ("vocab", "per_layer"))
            self.per_layer_model_projection = Linear(H, L * P, ("embed", "per_layer"), dtype=dtype, rngs=rngs)
            self.per_layer_projection_norm = RMSNorm(P, cfg.rms_norm_eps, axis="per_layer", dtype=dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(L)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else Linear(H, cfg.vocab_size, ("embed", "vocab"), dtype=dtype, rngs=rngs))

    def init_cache(self, batch: int, max_len: int) -> Cache:
        """One KV entry per layer that computes K/V (KV-shared layers read their source's), each of its
        layer type's geometry; sliding layers keep a ring of their window (cache.RingKVEntry)."""
        c = self.config
        dt = self.embed_tokens.dtype

        def entry(i):
            kv = c.kv_heads[i], c.head_dims[i], dt
            if c.layer_types[i] == "sliding_attention":
                return RingKVEntry.init(batch, max_len, c.sliding_window, *kv)
            return KVEntry.init(batch, max_len, *kv)

        return Cache.init([entry(i) for i in range(c.num_layers) if not c.kv_shared[i]], batch, max_len)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, N] -> [B, N, H], scaled by sqrt(H) cast to the parameter dtype."""
        x = embed_rows(self.embed_tokens, tokens)
        return x * jnp.asarray(math.sqrt(self.config.hidden_size), x.dtype)

    def per_layer_inputs(self, tokens: jax.Array, x: jax.Array) -> jax.Array:
        """PLE: tokens [B, N], their scaled embedding x [B, N, H] -> [B, N, L, P]:
        (norm(reshape(x W * H^-0.5)) + E_ple[tokens] * sqrt(P)) * 2^-0.5."""
        c = self.config
        B, N = tokens.shape
        P, L = c.hidden_size_per_layer_input, c.num_layers
        proj = self.per_layer_model_projection(x) * jnp.asarray(c.hidden_size**-0.5, x.dtype)
        proj = self.per_layer_projection_norm(proj.reshape(B, N, L, P))
        E = self.embed_tokens_per_layer[...]
        own = jnp.take(E, tokens, axis=0) * jnp.asarray(math.sqrt(P), E.dtype)
        return (proj + own.reshape(B, N, L, P)) * jnp.asarray(2.0**-0.5, x.dtype)

    def head(self, h: jax.Array, vocab: jax.Array | None = None) -> jax.Array:
        """Final hidden (already normed) [..., H] -> float32 logits [..., V] (or [..., K] for `vocab` ids),
        soft-capped where the config says so."""
        logits = lm_logits(h, self.embed_tokens, self.lm_head, vocab)
        cap = self.config.final_logit_softcapping
        return cap * jnp.tanh(logits / cap) if cap else logits

    def __call__(self, tokens, segment: Segment, cache: Cache, *, tap_layers=(), logits_idx=None):
        """Append N tokens to the cache and return (logits, taps, pending cache); arguments as
        `DenseLM.__call__`. A KV-shared layer attends to the entry its source layer wrote in this forward."""
        c = self.config
        mask, key_pos, ring = masks(segment, cache)
        x = self.embed(tokens)
        ple = self.per_layer_inputs(tokens, x) if c.hidden_size_per_layer_input else None
        entries, tapped = list(cache.layers), {}
        for i, (layer, slot) in enumerate(zip(self.layers, c.cache_slots)):
            m = ring if isinstance(entries[slot], RingKVEntry) else mask
            x, entry = layer(x, None if ple is None else ple[:, :, i], segment.positions, entries[slot], cache.length,
                             m, key_pos)
            if not c.kv_shared[i]:
                entries[slot] = entry
            if i in tap_layers:
                tapped[i] = x
        return (*finish(self, x, tapped, tap_layers, logits_idx), dataclasses.replace(cache, layers=tuple(entries)))
