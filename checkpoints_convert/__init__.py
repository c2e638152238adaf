"""Checkpoint converter: HF safetensors (sharded, compressed-tensors INT4) or GGUF -> a jaxspec model directory
(config.json, tokenizer files, Orbax parameters) that `jaxspec.load(OUT, mesh=...)` restores into its shards.

    python -m checkpoints_convert SRC OUT [--dtype float32|bfloat16] [--quantize int8|int4|native] [--force]
"""
from checkpoints_convert.convert import ConvertError, convert

__all__ = ["convert", "ConvertError"]
