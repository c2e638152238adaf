"""Checkpoint converter: HF safetensors / GGUF -> jaxspec parameters -> Orbax (not written yet)."""
