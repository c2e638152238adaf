"""The MLA + MoE family's name table: HF DeepSeek-V3 / Kimi K2 / Kimi K2.5 tensor names -> `DeepseekLM` paths.

HF checkpoints store each routed expert as its own 2-D tensors (`mlp.experts.{e}.gate_proj.weight` [I, H]);
the `stack=` rules put expert e at slice e of the stacked parameter (`mlp.experts.gate_proj` [E, H, I]).
Kimi K2.5 / K2.6 (VLM) nest the language model under `language_model.` beside a vision tower and projector,
which are ignored.

DeepSeek-V3 checkpoints also carry the multi-token-prediction module as one extra layer
(`model.layers.{num_hidden_layers}.*`, with enorm / hnorm / eh_proj / shared_head), which transformers drops
on load too. A static table cannot tell that layer's index from the config, so the layer rules are
`optional`: a tensor of a layer the model does not have is ignored, while every parameter the model does
have must still be filled (a truncated checkpoint is still reported).
"""
from __future__ import annotations

from jaxspec.checkpoint.core import Rule, linear_kernel

_PREFIX = r"(?:model\.language_model\.|language_model\.model\.|model\.)"
_LAYER = _PREFIX + r"layers\.(\d+)\."
_ATTN = r"self_attn\.(?:q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
_MLP = r"mlp\.(?:shared_experts\.)?(?:gate|up|down)_proj"

DEEPSEEK_HF_RULES = (
    Rule(r"(?:model\.)?(?:vision_tower|mm_projector|multi_modal_projector)\..*", None),
    Rule(_PREFIX + r"embed_tokens\.weight", "embed_tokens"),
    Rule(_PREFIX + r"norm\.weight", "norm.weight"),
    Rule(r"(?:language_model\.)?lm_head\.weight", "lm_head.kernel", linear_kernel, optional=True),
    Rule(_PREFIX + r"rotary_emb\.inv_freq", None),
    Rule(_LAYER + r"(?:enorm|hnorm|eh_proj|shared_head)\..*", None),  # the MTP layer's own tensors
    Rule(_LAYER + rf"({_ATTN})\.weight", "layers.{0}.{1}.kernel", linear_kernel, optional=True),
    Rule(_LAYER + rf"({_ATTN})\.bias", "layers.{0}.{1}.bias", optional=True),
    Rule(_LAYER + r"(self_attn\.(?:q_a|kv_a)_layernorm|input_layernorm|post_attention_layernorm)\.weight",
         "layers.{0}.{1}.weight", optional=True),
    Rule(_LAYER + rf"({_MLP})\.weight", "layers.{0}.{1}.kernel", linear_kernel, optional=True),
    Rule(_LAYER + r"mlp\.gate\.weight", "layers.{0}.mlp.gate.weight", linear_kernel, optional=True),
    Rule(_LAYER + r"mlp\.gate\.e_score_correction_bias", "layers.{0}.mlp.gate.e_score_correction_bias", optional=True),
    Rule(_LAYER + r"mlp\.experts\.(\d+)\.((?:gate|up|down)_proj)\.weight", "layers.{0}.mlp.experts.{2}",
         linear_kernel, stack=1, optional=True),
    Rule(_LAYER + r"self_attn\.rotary_emb\.inv_freq", None),
)
