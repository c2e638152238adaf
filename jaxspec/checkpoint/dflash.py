"""The DFlash drafter's name table: z-lab's released layout -> `DFlashDrafter` parameter paths.

Tensors are unprefixed or `model.`-prefixed. The drafter uses the target's embedding and head, so copies
of them in the checkpoint are ignored, and `draft_vocab` (token ids, read by `load_drafter`) is no
parameter.
"""
from __future__ import annotations

from jaxspec.checkpoint.core import Rule, linear_kernel
from jaxspec.checkpoint.dense import decoder_layer_rules

_PREFIX = r"(?:model\.)?"

DFLASH_ZLAB_RULES = (
    Rule(_PREFIX + r"(?:embed_tokens|lm_head)\.weight", None),
    Rule(r"draft_vocab", None),
    Rule(_PREFIX + r"fc\.weight", "fc.kernel", linear_kernel),
    Rule(_PREFIX + r"(hidden_norm|norm)\.weight", "{0}.weight"),
    Rule(_PREFIX + r"rotary_emb\.inv_freq", None),
    *decoder_layer_rules(_PREFIX),
)
