"""Typed model configs parsed from Hugging Face `config.json`.

One frozen dataclass per family. `transformers.AutoConfig` fills in the defaults and standardises the
RoPE fields (legacy `rope_theta` / `rope_scaling` / Gemma's `rope_local_base_freq` all become
`rope_parameters`), so a real config.json and a tiny test config go through the same path.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

DENSE_TYPES = ("llama", "qwen3", "gemma3_text")
SUPPORTED_TYPES = DENSE_TYPES + ("gemma3",)


class ConfigError(ValueError):
    """A config.json that jaxspec cannot run; the message says what and how to fix it."""


@dataclass(frozen=True)
class RopeConfig:
    """One RoPE table: `inv_freq` is derived from these (layers.rope_inv_freq)."""

    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class DenseConfig:
    """Llama, Qwen3 and Gemma 3 text: one decoder, differing in a handful of switches."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention" per layer
    sliding_window: int | None = None  # window counts the current token
    rope_global: RopeConfig = RopeConfig()
    rope_local: RopeConfig = RopeConfig()  # used by sliding layers
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3, Gemma 3
    norm_plus_one: bool = False  # Gemma: RMSNorm weight applied as (1 + w)
    sandwich_norm: bool = False  # Gemma: post-attention and post-ffn norms
    embed_scale: float = 1.0  # Gemma: sqrt(hidden_size)
    query_scale: float = 0.0  # softmax scale; head_dim ** -0.5 unless Gemma's query_pre_attn_scalar
    hidden_act: str = "silu"  # silu | gelu_tanh
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @property
    def is_sliding(self) -> tuple[bool, ...]:
        return tuple(t == "sliding_attention" for t in self.layer_types)

    def replace(self, **kw) -> "DenseConfig":
        return dataclasses.replace(self, **kw)


def _rope(params: dict | None) -> RopeConfig:
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ConfigError(
            f"unsupported rope_type {rope_type!r}; jaxspec supports default, linear and llama3 for dense models"
        )
    return RopeConfig(
        theta=float(params.get("rope_theta", 10000.0)),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0) or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192) or 8192),
    )


def _eos_ids(*candidates) -> tuple[int, ...]:
    out: list[int] = []
    for c in candidates:
        if c is None:
            continue
        for t in c if isinstance(c, (list, tuple)) else [c]:
            if t is not None and int(t) not in out:
                out.append(int(t))
    return tuple(out)


def dense_config_from_dict(d: dict) -> DenseConfig:
    """Parse a HF config dict (the contents of config.json) into a DenseConfig."""
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise ConfigError(
            f"unsupported model_type {model_type!r}; jaxspec supports: {', '.join(SUPPORTED_TYPES)}"
        )
    if model_type == "gemma3":  # multimodal checkpoint: the language model lives in text_config
        text = dict(d.get("text_config") or {})
        text["model_type"] = "gemma3_text"
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            text.setdefault(key, d.get(key))
        return dense_config_from_dict(text)

    import transformers  # fills defaults and standardises rope_parameters

    kw = {k: v for k, v in d.items() if k not in ("model_type", "architectures", "auto_map", "transformers_version")}
    try:
        hf = transformers.AutoConfig.for_model(model_type, **kw)
    except Exception as e:  # transformers raises many types for malformed values
        raise ConfigError(f"config.json for {model_type} is invalid: {e}") from e

    H, nH = hf.hidden_size, hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or H // nH
    L = hf.num_hidden_layers
    layer_types = tuple(getattr(hf, "layer_types", None) or ["full_attention"] * L)
    rp = getattr(hf, "rope_parameters", None) or {}
    if "full_attention" in rp or "sliding_attention" in rp:
        rope_global = _rope(rp.get("full_attention"))
        rope_local = _rope(rp.get("sliding_attention", rp.get("full_attention")))
    else:
        rope_global = rope_local = _rope(rp)
    gemma = model_type == "gemma3_text"
    sliding = getattr(hf, "sliding_window", None) if "sliding_attention" in layer_types else None
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    act = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(act)
    if act is None:
        raise ConfigError(f"unsupported activation in config.json: {hf.hidden_act!r} (supported: silu, gelu_pytorch_tanh)")
    qscale = (
        float(hf.query_pre_attn_scalar) ** -0.5 if gemma and getattr(hf, "query_pre_attn_scalar", None) else head_dim**-0.5
    )
    return DenseConfig(
        model_type=model_type,
        vocab_size=hf.vocab_size,
        hidden_size=H,
        intermediate_size=hf.intermediate_size,
        num_layers=L,
        num_heads=nH,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or nH,
        head_dim=head_dim,
        rms_norm_eps=float(hf.rms_norm_eps),
        max_position_embeddings=int(hf.max_position_embeddings),
        layer_types=layer_types,
        sliding_window=int(sliding) if sliding else None,
        rope_global=rope_global,
        rope_local=rope_local,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        norm_plus_one=gemma,
        sandwich_norm=gemma,
        embed_scale=math.sqrt(H) if gemma else 1.0,
        query_scale=qscale,
        hidden_act=act,
        attn_logit_softcapping=getattr(hf, "attn_logit_softcapping", None),
        final_logit_softcapping=getattr(hf, "final_logit_softcapping", None),
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=_eos_ids(getattr(hf, "eos_token_id", None)),
        pad_token_id=getattr(hf, "pad_token_id", None),
    )


def load_config(model_dir: str | Path) -> DenseConfig:
    """Read `<model_dir>/config.json` (and generation_config.json's EOS ids, if present)."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found; point --model at a Hugging Face model directory or a .gguf file")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); re-download or re-export the model") from e
    cfg = dense_config_from_dict(d)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            g = json.loads(gen.read_text())
            cfg = cfg.replace(eos_token_ids=_eos_ids(cfg.eos_token_ids, g.get("eos_token_id")))
        except json.JSONDecodeError:
            pass  # generation_config is optional; config.json's EOS stands
    return cfg
