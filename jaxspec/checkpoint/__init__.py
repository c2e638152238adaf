"""Checkpoint loading: readers yield `(name, array)` one tensor at a time (safetensors, GGUF), a family's rule
table maps each name to a parameter (`Rule`), and `load_params` streams them into an abstractly built module."""
from jaxspec.checkpoint.core import Rule, WeightsError, linear_kernel, load_params
from jaxspec.checkpoint.deepseek import DEEPSEEK_HF_RULES
from jaxspec.checkpoint.dense import DENSE_HF_RULES
from jaxspec.checkpoint.dflash import DFLASH_ZLAB_RULES
from jaxspec.checkpoint.gemma4 import GEMMA4_HF_RULES
from jaxspec.checkpoint.gguf import GGUF_ARCHS, gguf_config, read_gguf
from jaxspec.checkpoint.qwen3_next import HYBRID_HF_RULES
from jaxspec.checkpoint.safetensors import read_safetensors, safetensors_files

__all__ = ["Rule", "WeightsError", "linear_kernel", "load_params", "DEEPSEEK_HF_RULES", "DENSE_HF_RULES",
           "DFLASH_ZLAB_RULES", "GEMMA4_HF_RULES", "HYBRID_HF_RULES", "GGUF_ARCHS", "gguf_config", "read_gguf",
           "read_safetensors", "safetensors_files"]
