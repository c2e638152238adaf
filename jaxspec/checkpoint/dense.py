"""The dense family's name table: HF Llama / Qwen3 / Gemma 3 tensor names -> `DenseLM` parameter paths.

One rule per kind of tensor, no catch-all, so a tensor the model has no place for is reported rather than
dropped. Multimodal checkpoints (Gemma 3 4B+) nest the language model under a prefix and carry a vision
tower and projector, which the text model ignores.
"""
from __future__ import annotations

from jaxspec.checkpoint.core import Rule, linear_kernel

# the language model's prefix in text-only and multimodal checkpoints (no capture: groups are layer ids)
_PREFIX = r"(?:model\.language_model\.|language_model\.model\.|language_model\.|model\.)"


def decoder_layer_rules(prefix: str) -> tuple[Rule, ...]:
    """Rules for `{prefix}layers.{i}.*`: attention, gated MLP and norms under their HF names, which are
    also ours (Linear `.weight` [out, in] -> `.kernel` [in, out]). Shared with the DFlash drafter's layers."""
    layer = prefix + r"layers\.(\d+)\."
    attn, mlp = r"self_attn\.[qkvo]_proj", r"mlp\.(?:gate|up|down)_proj"
    norms = r"input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm"
    return (
        Rule(layer + rf"({attn})\.weight", "layers.{0}.{1}.kernel", linear_kernel),
        Rule(layer + rf"({attn})\.bias", "layers.{0}.{1}.bias"),
        Rule(layer + rf"({mlp})\.weight", "layers.{0}.{1}.kernel", linear_kernel),
        Rule(layer + rf"({mlp})\.bias", "layers.{0}.{1}.bias"),
        Rule(layer + rf"({norms})\.weight", "layers.{0}.{1}.weight"),
        Rule(layer + r"(self_attn\.[qk]_norm)\.weight", "layers.{0}.{1}.weight"),
        Rule(layer + r"self_attn\.rotary_emb\.inv_freq", None),  # old exports save RoPE's buffer
    )


DENSE_HF_RULES = (
    Rule(r"(?:model\.)?(?:vision_tower|multi_modal_projector)\..*", None),
    Rule(_PREFIX + r"embed_tokens\.weight", "embed_tokens"),
    Rule(_PREFIX + r"norm\.weight", "norm.weight"),
    # tied models have no lm_head, yet some exporters still write one
    Rule(r"(?:language_model\.)?lm_head\.weight", "lm_head.kernel", linear_kernel, optional=True),
    Rule(_PREFIX + r"rotary_emb\.inv_freq", None),
    *decoder_layer_rules(_PREFIX),
)
