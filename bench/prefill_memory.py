"""Peak temporary memory of a prefill, in one forward against in chunks (engine.prefill_forward), from the compiled
program (`compiled.memory_analysis()`; compiled for this host, nothing runs): a Qwen3.6-27B-shaped target (its
widths, 4 of its 64 layers: 3 GDN + 1 attention) or a DeepSeek-V3-shaped one (its widths, 2 of its 61 layers,
both with a dense MLP: XLA:CPU runs the MoE's ragged_dot as a product over every expert, whose temporaries would
hide the attention's; MLA prefills in its expanded form), prompts of 2k / 8k / 32k tokens into a
buffer 256 slots longer, on the GPU path's attention ("gpu") and the references' ("xla"). Float32 weights:
XLA:CPU converts bf16 weights to float32 for its products, and those copies would hide the activations in the
figure.

    python bench/prefill_memory.py [--family qwen3_6|deepseek_v3] [--prompts 2048,8192,32768] [--chunk 1024]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxspec import engine, kernels, testing  # noqa: E402
from jaxspec.models.deepseek import DeepseekLM, deepseek_config_from_dict  # noqa: E402
from jaxspec.models.qwen3_next import HybridLM, hybrid_config_from_dict  # noqa: E402

QWEN36 = dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
              num_hidden_layers=4, num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
              linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, full_attention_interval=4,
              max_position_embeddings=262144,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
DEEPSEEK_V3 = {**testing.DEEPSEEK_V3, "num_hidden_layers": 2, "first_k_dense_replace": 2, "n_routed_experts": 16}


def module_of(family: str):
    if family == "qwen3_6":
        cfg = hybrid_config_from_dict(QWEN36)
        return nnx.eval_shape(lambda: HybridLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    cfg = deepseek_config_from_dict(DEEPSEEK_V3)
    return nnx.eval_shape(lambda: DeepseekLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))


def temp_gb(family: str, backend: str, P: int, chunk: int) -> float:
    graphdef, params = nnx.split(module_of(family))

    def prefill(params, tokens):
        with kernels.use(backend):
            target = nnx.merge(graphdef, params)
            positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (1, P))
            logits, cache, _ = engine.prefill_forward(target, tokens, positions, P, target.init_cache(1, P + 256),
                                                      chunk=chunk)
            return logits, cache

    compiled = jax.jit(prefill).lower(params, jax.ShapeDtypeStruct((1, P), jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 1e9


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=("qwen3_6", "deepseek_v3"), default="qwen3_6")
    ap.add_argument("--prompts", default="2048,8192,32768")
    ap.add_argument("--chunk", type=int, default=engine.PREFILL_CHUNK)
    ap.add_argument("--backends", default="gpu,xla")
    args = ap.parse_args(argv)
    print(f"| prompt | attention | one forward (GB) | chunks of {args.chunk} (GB) |\n|---|---|---|---|")
    for P in map(int, args.prompts.split(",")):
        for backend in args.backends.split(","):
            one, chunked = temp_gb(args.family, backend, P, P), temp_gb(args.family, backend, P, args.chunk)
            print(f"| {P} | {backend} | {one:.2f} | {chunked:.2f} |", flush=True)


if __name__ == "__main__":
    main()
