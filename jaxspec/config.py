"""Typed model configs parsed from Hugging Face `config.json`.

One frozen dataclass per family; the engine, drafter, trainer and CLI read only the `TargetConfig`
protocol that all of them satisfy. `transformers.AutoConfig` fills in the defaults and standardises the
RoPE fields (legacy `rope_theta` / `rope_scaling` / Gemma's `rope_local_base_freq` all become
`rope_parameters`), so a real config.json and a tiny test config go through the same path. Which
`model_type` goes to which family's parser is `models/registry.py`'s business.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

DENSE_TYPES = ("llama", "qwen3", "gemma3_text", "gemma3")  # gemma3: the text model of the multimodal config


class ConfigError(ValueError):
    """A config.json that jaxspec cannot run; the message says what and how to fix it."""


def read_config_json(path: Path) -> dict:
    """A config.json -> its dict, with a one-line ConfigError when it is missing, not JSON or not an object."""
    if not path.is_file():
        raise ConfigError(f"{path} not found; pass a Hugging Face model directory (config.json + safetensors) "
                          "or a .gguf file")
    try:
        d = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8 (both ValueErrors), absurd nesting
        raise ConfigError(f"{path} is not valid JSON ({e}); re-download or re-export the model") from e
    if not isinstance(d, dict):
        raise ConfigError(f"{path} holds a JSON {type(d).__name__}, not an object; re-download or re-export the model")
    return d


MAX_SIZE = 2**31 - 1  # XLA indexes arrays with int32: no dimension of a model that runs is larger
MAX_HEAD_DIM = 2**16  # wider than any model's heads (256-512 at most); each layer holds a RoPE table of half of it


def check_values(what: str, sizes: dict | None = None, positive: dict | None = None) -> None:
    """ConfigError naming the first of `sizes` that is not a positive integer up to MAX_SIZE, or of `positive`
    that is not a positive finite number (eps, RoPE theta and factor). transformers checks a field's type, not
    its value: a zero or negative size builds a module that fails far from config.json, and a negative theta or
    a NaN eps loads a model that only ever generates noise."""
    for name, v in (sizes or {}).items():
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SIZE:
            raise ConfigError(f"{what} is invalid: {name} is {v!r}, not a positive integer (up to {MAX_SIZE}); "
                              "re-download the model or correct the value")
    for name, v in (positive or {}).items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise ConfigError(f"{what} is invalid: {name} is {v!r}, not a positive finite number; re-download the "
                              "model or correct the value")


class TargetConfig(Protocol):
    """What everything outside a family may read of a target's config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int  # the context length
    eos_token_ids: tuple[int, ...]

    def replace(self, **kw) -> "TargetConfig": ...


@dataclass(frozen=True)
class RopeConfig:
    """One RoPE table: `inv_freq` is derived from these (layers.rope_inv_freq)."""

    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # llama.cpp's `rope_freqs` tensor (Llama 3.x GGUFs carry their llama3 scaling this way, with no metadata):
    # per-frequency divisors of inv_freq, applied after the rope_type's own scaling
    freq_factors: tuple[float, ...] = ()


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
    if not isinstance(params, (dict, type(None))):
        raise ConfigError(f"the RoPE parameters of config.json are {params!r}, not an object; re-download the model")
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ConfigError(
            f"unsupported rope_type {rope_type!r}; jaxspec supports default, linear and llama3 for dense models"
        )
    scales = {k: params[k] for k in ("rope_theta", "low_freq_factor", "high_freq_factor") if params.get(k) is not None}
    if params.get("factor"):  # 0 or null: no scaling, as below
        scales["factor"] = params["factor"]
    check_values("the RoPE parameters of config.json", positive=scales)
    return RopeConfig(
        theta=float(params.get("rope_theta", 10000.0)),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0) or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192) or 8192),
    )


def eos_ids(*candidates) -> tuple[int, ...]:
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
    if model_type not in DENSE_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not a dense model; "
                          f"the dense family reads: {', '.join(DENSE_TYPES)}")
    if model_type == "gemma3":  # multimodal checkpoint: the language model lives in text_config
        text = dict(d.get("text_config") or {})
        text["model_type"] = "gemma3_text"
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            text.setdefault(key, d.get(key))
        return dense_config_from_dict(text)

    import transformers  # fills defaults and standardises rope_parameters

    kw = {k: v for k, v in d.items() if k not in ("model_type", "architectures", "auto_map", "transformers_version")}
    freq_factors = tuple(float(f) for f in kw.pop("rope_freq_factors", None) or ())  # set by the GGUF reader
    try:
        hf = transformers.AutoConfig.for_model(model_type, **kw)
    except Exception as e:  # transformers raises many types for malformed values
        raise ConfigError(f"config.json for {model_type} is invalid: {e}") from e

    H, nH = hf.hidden_size, hf.num_attention_heads
    what = f"config.json for {model_type}"
    check_values(what, dict(hidden_size=H, num_attention_heads=nH))
    head_dim = getattr(hf, "head_dim", None) or H // nH
    L = hf.num_hidden_layers
    n_kv = getattr(hf, "num_key_value_heads", None) or nH
    check_values(what, dict(vocab_size=hf.vocab_size, intermediate_size=hf.intermediate_size, num_hidden_layers=L,
                            num_key_value_heads=n_kv, head_dim=head_dim,
                            max_position_embeddings=hf.max_position_embeddings),
                 dict(rms_norm_eps=hf.rms_norm_eps))
    if head_dim > MAX_HEAD_DIM:
        raise ConfigError(f"{what} is invalid: head_dim {head_dim} is over {MAX_HEAD_DIM}; re-download the model or "
                          "correct the value")
    if nH % n_kv:
        raise ConfigError(f"{what} is invalid: num_attention_heads {nH} is not a multiple of num_key_value_heads "
                          f"{n_kv}; re-download the model or correct the value")
    layer_types = tuple(getattr(hf, "layer_types", None) or ["full_attention"] * L)
    rp = getattr(hf, "rope_parameters", None) or {}
    if "full_attention" in rp or "sliding_attention" in rp:
        rope_global = _rope(rp.get("full_attention"))
        rope_local = _rope(rp.get("sliding_attention", rp.get("full_attention")))
    else:
        rope_global = rope_local = _rope(rp)
    if freq_factors:
        if len(freq_factors) != head_dim // 2:
            raise ConfigError(f"rope_freqs has {len(freq_factors)} entries, head_dim {head_dim} needs {head_dim // 2}")
        rope_global = dataclasses.replace(rope_global, freq_factors=freq_factors)
        rope_local = dataclasses.replace(rope_local, freq_factors=freq_factors)
    gemma = model_type == "gemma3_text"
    sliding = getattr(hf, "sliding_window", None) if "sliding_attention" in layer_types else None
    if sliding is not None:
        check_values(what, dict(sliding_window=sliding))
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    act = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(act)
    if act is None:
        raise ConfigError(f"unsupported activation in config.json: {hf.hidden_act!r} "
                          "(supported: silu, gelu_pytorch_tanh)")
    qscale = (
        float(hf.query_pre_attn_scalar) ** -0.5 if gemma and getattr(hf, "query_pre_attn_scalar", None)
        else head_dim**-0.5
    )
    return DenseConfig(
        model_type=model_type,
        vocab_size=hf.vocab_size,
        hidden_size=H,
        intermediate_size=hf.intermediate_size,
        num_layers=L,
        num_heads=nH,
        num_kv_heads=n_kv,
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
        eos_token_ids=eos_ids(getattr(hf, "eos_token_id", None)),
        pad_token_id=getattr(hf, "pad_token_id", None),
    )


@dataclass(frozen=True)
class DrafterConfig:
    """A DFlash drafter: Qwen3-style layers over a block, reading taps of the target as extra K/V.

    Serialised in z-lab's released layout: a Qwen3 config.json plus `block_size`, `num_target_layers`
    and `dflash_config: {mask_token_id, target_layer_ids}`.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig(theta=1e6)
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    # Target token ids the drafter may propose (its head is the target's restricted to these rows), or ()
    # for the whole vocabulary. Stored as the `draft_vocab` tensor beside the weights.
    draft_vocab: tuple[int, ...] = ()

    @property
    def is_sliding(self) -> tuple[bool, ...]:
        return tuple(t == "sliding_attention" for t in self.layer_types)

    def to_hf_dict(self) -> dict:
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": None
            if self.rope.rope_type == "default"
            else {
                "rope_type": self.rope.rope_type,
                "factor": self.rope.factor,
                "low_freq_factor": self.rope.low_freq_factor,
                "high_freq_factor": self.rope.high_freq_factor,
                "original_max_position_embeddings": self.rope.original_max_position_embeddings,
            },
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            **({"draft_vocab_size": len(self.draft_vocab)} if self.draft_vocab else {}),
        }


def drafter_config_from_dict(d: dict) -> DrafterConfig:
    """Parse a DFlash drafter config.json (z-lab layout); ConfigError for any field that is missing or cannot be
    read as what it holds."""
    if not isinstance(d, dict) or not isinstance(d.get("dflash_config") or {}, dict):
        raise ConfigError("a drafter config.json must be a JSON object with a dflash_config object (z-lab layout); "
                          "re-export the drafter")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "block_size", "num_target_layers", "max_position_embeddings",
                "draft_vocab_size"):
        v = d.get(key)  # int() would take 1.5, "64" and true as well
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ConfigError(f"drafter config.json is invalid: {key} is {v!r}, not an integer; re-export the drafter")
    try:
        cfg = _drafter_config(d)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        why = f"lacks {e}" if isinstance(e, KeyError) else f"has a field of the wrong type ({e})"
        raise ConfigError(f"drafter config.json {why}; re-export the drafter") from e
    check_values("drafter config.json", dict(  # hidden_size, num_attention_heads and num_hidden_layers: above
        intermediate_size=cfg.intermediate_size, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size, block_size=cfg.block_size, max_position_embeddings=cfg.max_position_embeddings),
        dict(rms_norm_eps=cfg.rms_norm_eps))
    return cfg


def _drafter_config(d: dict) -> DrafterConfig:
    dflash = d.get("dflash_config") or {}
    missing = [k for k in ("block_size",) if k not in d] + [k for k in ("mask_token_id",) if k not in dflash]
    if missing:
        raise ConfigError(
            f"drafter config.json lacks {', '.join(missing)}; a DFlash drafter needs block_size and "
            "dflash_config.mask_token_id (z-lab layout)"
        )
    H, nH = int(d["hidden_size"]), int(d["num_attention_heads"])
    L = int(d["num_hidden_layers"])
    # before H // nH and a list of L layer types
    check_values("drafter config.json", dict(hidden_size=H, num_attention_heads=nH, num_hidden_layers=L))
    n_target = int(d.get("num_target_layers", 0))
    taps = dflash.get("target_layer_ids")
    if taps is None:
        if not n_target:
            raise ConfigError("drafter config.json has neither dflash_config.target_layer_ids nor num_target_layers")
        taps = default_target_layer_ids(n_target, L)
    rp = d.get("rope_parameters") or {**(d.get("rope_scaling") or {}), "rope_theta": d.get("rope_theta", 1e6)}
    layer_types = tuple(d.get("layer_types") or ["full_attention"] * L)
    if len(layer_types) != L:
        raise ConfigError(f"drafter config.json has num_hidden_layers {L} but {len(layer_types)} layer_types; "
                          "set num_hidden_layers to the layers in its weights and give layer_types one entry per layer")
    return DrafterConfig(
        hidden_size=H,
        intermediate_size=int(d["intermediate_size"]),
        num_layers=L,
        num_heads=nH,
        num_kv_heads=int(d.get("num_key_value_heads") or nH),
        head_dim=int(d.get("head_dim") or H // nH),
        vocab_size=int(d["vocab_size"]),
        block_size=int(d["block_size"]),
        mask_token_id=int(dflash["mask_token_id"]),
        target_layer_ids=tuple(int(t) for t in taps),
        num_target_layers=n_target,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope=_rope(rp),
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        attention_bias=bool(d.get("attention_bias", False)),
        layer_types=layer_types,
        sliding_window=(int(d["sliding_window"]) if "sliding_attention" in layer_types and d.get("sliding_window")
                        else None),
    )


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """DFlash's tap placement: the middle layer for one tap, else evenly spread over [1, L-3]."""
    if num_taps == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_taps - 1))) for i in range(num_taps))
