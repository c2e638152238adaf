"""The Gemma 4 family's name table: HF `gemma4_text` / `gemma4` tensor names -> `Gemma4LM` parameter paths.

Released checkpoints are multimodal (`Gemma4ForConditionalGeneration`): the language model sits under
`model.language_model.` beside vision and audio towers and their embedders, which the text target ignores;
a text-only export (`Gemma4ForCausalLM`) uses `model.`. The routed experts are stored fused as in the model,
`experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I], and transposed to [in, out] here.
KV-shared layers have no k/v projections or norms; a checkpoint that still carries them (transformers ignores
them on load) has them ignored too, through `optional` rules that every computing layer must still fill.
"""
from __future__ import annotations

from jaxspec.checkpoint.core import Rule, linear_kernel

_PREFIX = r"(?:model\.language_model\.|model\.)"
_LAYER = _PREFIX + r"layers\.(\d+)\."
_LINEAR = (r"self_attn\.[qo]_proj|mlp\.(?:gate|up|down)_proj|per_layer_input_gate|per_layer_projection"
           r"|router\.proj")
_NORMS = (r"input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm"
          r"|post_feedforward_layernorm_1|pre_feedforward_layernorm_2|post_feedforward_layernorm_2"
          r"|post_per_layer_input_norm|self_attn\.q_norm")


def _experts(w):
    """[E, out, in] (HF's per-expert Linear layout) -> [E, in, out]."""
    return w.transpose(0, 2, 1)


GEMMA4_HF_RULES = (
    Rule(r"model\.(?:vision_tower|audio_tower|embed_vision|embed_audio)\..*", None),
    Rule(_PREFIX + r"embed_tokens\.weight", "embed_tokens"),
    Rule(_PREFIX + r"embed_tokens_per_layer\.weight", "embed_tokens_per_layer"),
    Rule(_PREFIX + r"per_layer_model_projection\.weight", "per_layer_model_projection.kernel", linear_kernel),
    Rule(_PREFIX + r"(norm|per_layer_projection_norm)\.weight", "{0}.weight"),
    Rule(r"lm_head\.weight", "lm_head.kernel", linear_kernel, optional=True),  # tied: usually absent
    Rule(_LAYER + rf"({_LINEAR})\.weight", "layers.{0}.{1}.kernel", linear_kernel),
    Rule(_LAYER + rf"({_LINEAR})\.bias", "layers.{0}.{1}.bias"),
    Rule(_LAYER + rf"({_NORMS})\.weight", "layers.{0}.{1}.weight"),
    Rule(_LAYER + r"(self_attn\.[kv]_proj)\.weight", "layers.{0}.{1}.kernel", linear_kernel, optional=True),
    Rule(_LAYER + r"(self_attn\.[kv]_proj)\.bias", "layers.{0}.{1}.bias", optional=True),
    Rule(_LAYER + r"self_attn\.k_norm\.weight", "layers.{0}.self_attn.k_norm.weight", optional=True),
    Rule(_LAYER + r"layer_scalar", "layers.{0}.layer_scalar", lambda w: w.reshape(())),
    Rule(_LAYER + r"router\.(scale|per_expert_scale)", "layers.{0}.router.{1}"),
    Rule(_LAYER + r"experts\.(gate_up_proj|down_proj)", "layers.{0}.experts.{1}", _experts),
)
