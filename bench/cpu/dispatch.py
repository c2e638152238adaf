"""What one decode call costs beyond its rounds: `spec_decode` and `ar_decode` called with nothing left to do.

    python bench/cpu/dispatch.py [--model M] [--drafter DIR] [--calls 200]

Every streamed chunk of the CLI, every chunk `--budget auto` times and every `generate` call pays this once:
flattening the parameters, jit's cache lookup (which hashes the static arguments), launching the while loop
and reading the state back. Prints the mean milliseconds per call over `--calls` calls after three warm-ups.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxspec  # noqa: E402
from jaxspec import engine  # noqa: E402
from jaxspec.cli import BUNDLED_DRAFTER, bundled_model  # noqa: E402
from jaxspec.sampling import SamplingParams  # noqa: E402


def per_call(step, state, calls: int) -> float:
    """Mean seconds of `state = step(state)` (the step donates its state)."""
    for _ in range(3):
        state = jax.block_until_ready(step(state))
    t = time.perf_counter()
    for _ in range(calls):
        state = jax.block_until_ready(step(state))
    return (time.perf_counter() - t) / calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: the bundled SmolLM2)")
    ap.add_argument("--drafter", default=str(BUNDLED_DRAFTER))
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    model = jaxspec.load(args.model or bundled_model())
    drafter = jaxspec.load_drafter(args.drafter, model)
    dc, greedy, eos = drafter.config, SamplingParams(), (-1,)
    settings = engine.SpecSettings("ddtree", 8, dc.block_size, dc.target_layer_ids, greedy, eos, lookup=True)
    prompt, key, n = jnp.zeros((1, 64), jnp.int32), jax.random.key(0), jnp.int32(100)
    spec = engine.spec_prefill(model.jit_def, model.params, drafter.jit_def, drafter.params, prompt, jnp.int32(10),
                               key, n, max_len=512, out_len=128, settings=settings)
    stop = jnp.int32(int(spec.emitted.max()))  # already reached: the loop runs no round
    ar = engine.ar_prefill(model.jit_def, model.params, prompt, jnp.zeros((1,), jnp.int32), key, n, max_len=512,
                           out_len=128, sampling=greedy, eos=eos)
    t_spec = per_call(lambda s: engine.spec_decode(model.jit_def, model.params, drafter.jit_def, drafter.params, s,
                                                   stop, settings=settings), spec, args.calls)
    t_ar = per_call(lambda s: engine.ar_decode(model.jit_def, model.params, s, jnp.int32(1), sampling=greedy,
                                               eos=eos), ar, args.calls)
    print(f"backend={jax.default_backend()} parameters={len(jax.tree.leaves(model.params))} arrays (target) + "
          f"{len(jax.tree.leaves(drafter.params))} (drafter); ms per call, mean of {args.calls}")
    print(f"spec_decode {1e3 * t_spec:.3f}  ar_decode {1e3 * t_ar:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
