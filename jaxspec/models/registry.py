"""Target families by `model_type`: the one place that knows which families exist.

A family is added by registering it here, never by editing the engine: its config parser, its module
(which brings `init_cache`, the forward over a `Segment`, `embed` and `head`), its HF name table (GGUF
architectures are rows of `checkpoint.gguf.GGUF_ARCHS`, which rename tensors to HF names and say which
model_type they become), and the attention geometry a new DFlash drafter takes from the target. Everything
else reads a target's config through the `TargetConfig` protocol only.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from jaxspec.checkpoint import DEEPSEEK_HF_RULES, DENSE_HF_RULES, GEMMA4_HF_RULES, HYBRID_HF_RULES, Rule
from jaxspec.config import (
    DENSE_TYPES,
    ConfigError,
    DenseConfig,
    RopeConfig,
    TargetConfig,
    dense_config_from_dict,
    eos_ids,
    read_config_json,
)
from jaxspec.models import deepseek, gemma4
from jaxspec.models.dense import DenseLM
from jaxspec.models.qwen3_next import HYBRID_TYPES, HybridConfig, HybridLM, hybrid_config_from_dict
from jaxspec.sharding import Layout


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # HF model_type values it reads (multimodal wrappers included)
    parse_config: Callable[[dict], TargetConfig]  # a config.json dict -> the family's config
    module: Callable[..., Any]  # module(config, dtype=, rngs=) -> the target's nnx.Module
    hf_rules: tuple[Rule, ...]  # HF tensor name -> parameter path (GGUF files are renamed to HF names first)
    drafter_geometry: Callable[[Any], dict]  # config -> DrafterConfig fields a new drafter copies
    head_counts: Callable[[Any], dict]  # config -> heads along each head axis (sharding never splits a head)


def _dense_drafter_geometry(c: DenseConfig) -> dict:
    return dict(intermediate_size=c.intermediate_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope=c.rope_global,
                max_position_embeddings=c.max_position_embeddings)


def _hybrid_drafter_geometry(c: HybridConfig) -> dict:
    """The target's full-attention geometry; a DFlash drafter rotates every head dim (no partial RoPE)."""
    return dict(intermediate_size=c.intermediate_size or 4 * c.hidden_size, num_heads=c.num_heads,
                num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                rope=RopeConfig(theta=c.rope.theta), max_position_embeddings=c.max_position_embeddings)


def _attention_heads(c) -> dict:
    return {"q_heads": c.num_heads, "kv_heads": c.num_kv_heads}


def _hybrid_heads(c: HybridConfig) -> dict:
    return dict(_attention_heads(c), gdn_heads=c.linear_num_value_heads, gdn_key_heads=c.linear_num_key_heads)


FAMILIES: tuple[Family, ...] = (
    Family("dense", DENSE_TYPES, dense_config_from_dict, DenseLM, DENSE_HF_RULES, _dense_drafter_geometry,
           _attention_heads),
    Family("deepseek", deepseek.DEEPSEEK_TYPES, deepseek.deepseek_config_from_dict, deepseek.DeepseekLM,
           DEEPSEEK_HF_RULES, deepseek.drafter_geometry, lambda c: {"q_heads": c.num_heads}),
    Family("hybrid_gdn", HYBRID_TYPES, hybrid_config_from_dict, HybridLM, HYBRID_HF_RULES, _hybrid_drafter_geometry,
           _hybrid_heads),
    Family("gemma4", gemma4.GEMMA4_TYPES, gemma4.gemma4_config_from_dict, gemma4.Gemma4LM, GEMMA4_HF_RULES,
           gemma4.drafter_geometry, lambda c: {"q_heads": c.num_heads, "kv_heads": math.gcd(*c.kv_heads)}),
)


def layout(config: TargetConfig, mesh) -> Layout:
    """How a target of `config` lies on `mesh` (a Mesh, or an AbstractMesh for planning)."""
    family = family_of(config.model_type)
    return Layout.of(family.name, mesh, family.head_counts(config))


def supported_types() -> tuple[str, ...]:
    return tuple(t for f in FAMILIES for t in f.model_types)


def family_of(model_type: str | None) -> Family:
    for f in FAMILIES:
        if model_type in f.model_types:
            return f
    raise ConfigError(f"unsupported model_type {model_type!r}; jaxspec supports: {', '.join(supported_types())}")


def config_from_dict(d: dict) -> TargetConfig:
    """Parse a HF config dict with the parser of its model_type's family."""
    return family_of(d.get("model_type")).parse_config(d)


def load_config(model_dir: str | Path) -> TargetConfig:
    """Read `<model_dir>/config.json` (and generation_config.json's EOS ids, if present)."""
    model_dir = Path(model_dir)
    cfg = config_from_dict(read_config_json(model_dir / "config.json"))
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            g = json.loads(gen.read_text())
            cfg = cfg.replace(eos_token_ids=eos_ids(cfg.eos_token_ids, g.get("eos_token_id")))
        except json.JSONDecodeError:
            pass  # generation_config is optional; config.json's EOS stands
    return cfg
