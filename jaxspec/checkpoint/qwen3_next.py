"""The hybrid GDN family's name table: HF Qwen3-Next / Qwen3.5 / Qwen3.6 tensor names -> `HybridLM` paths.

Qwen3.5 checkpoints are multimodal (`model.language_model.*`, a vision tower `model.visual.*`); both
families carry an MTP head (`mtp.*`), which the text target ignores. Experts are stored one tensor per
expert and stacked into [E, in, out] parameters. A GDN layer's conv1d over [q | k | v] channels, and Qwen3.5's
in_proj_qkv producing them, are split into one parameter each for q, k and v (models/gated_deltanet.py).
"""
from __future__ import annotations

from jaxspec.checkpoint.core import Rule, linear_kernel

_PREFIX = r"(?:model\.language_model\.|model\.)"
_LAYER = _PREFIX + r"layers\.(\d+)\."
_GDN_LINEAR = r"linear_attn\.(?:in_proj_qkvz|in_proj_ba|in_proj_z|in_proj_b|in_proj_a|out_proj)"
_GDN = "layers.{0}.linear_attn."
_LINEAR = (_GDN_LINEAR + r"|self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj|mlp\.shared_expert\.(?:gate|up|down)_proj"
           r"|mlp\.shared_expert_gate|mlp\.gate")
_NORMS = r"input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm|linear_attn\.norm"

HYBRID_HF_RULES = (
    Rule(r"(?:model\.visual|mtp)\..*", None),
    Rule(_PREFIX + r"embed_tokens\.weight", "embed_tokens"),
    Rule(_PREFIX + r"norm\.weight", "norm.weight"),
    Rule(r"lm_head\.weight", "lm_head.kernel", linear_kernel, optional=True),
    Rule(_LAYER + rf"({_LINEAR})\.weight", "layers.{0}.{1}.kernel", linear_kernel),
    Rule(_LAYER + rf"({_LINEAR})\.bias", "layers.{0}.{1}.bias"),
    Rule(_LAYER + rf"({_NORMS})\.weight", "layers.{0}.{1}.weight"),
    Rule(_LAYER + r"linear_attn\.in_proj_qkv\.weight", tuple(_GDN + f"in_proj_{p}.kernel" for p in "qkv"),
         linear_kernel),
    Rule(_LAYER + r"linear_attn\.conv1d\.weight", tuple(_GDN + f"conv_{p}" for p in "qkv"),
         lambda w: w[:, 0, :]),  # [C, 1, K]
    Rule(_LAYER + r"linear_attn\.(A_log|dt_bias)", "layers.{0}.linear_attn.{1}"),
    Rule(_LAYER + r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", "layers.{0}.mlp.experts.{2}",
         linear_kernel, stack=1),
)
