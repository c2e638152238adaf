"""Compile time of the decode programs against depth: AR prefill, the AR decode loop and the DDTree decode loop
(budget 16, a 1-layer random drafter), for random targets of 16 / 32 / 64 layers at small width (compile time
grows with the number of ops, which the unrolled layer loop multiplies by depth, not with the width): dense
(Qwen3) or hybrid (Qwen3.6's pattern, 3 Gated DeltaNet layers to 1 attention layer). Each program is lowered
and compiled once, timed apart.

    python bench/compile.py [--family dense|hybrid] [--layers 16,32,64] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxspec  # noqa: E402
from jaxspec import engine  # noqa: E402
from jaxspec.config import dense_config_from_dict  # noqa: E402
from jaxspec.decoder import Decoder  # noqa: E402
from jaxspec.models.qwen3_next import hybrid_config_from_dict  # noqa: E402
from jaxspec.sampling import SamplingParams  # noqa: E402


def seconds(jitted, *args, **kw) -> tuple[float, float]:
    """(lower s, compile s) of one program."""
    t = time.perf_counter()
    lowered = jitted.lower(*args, **kw)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t, time.perf_counter() - t1


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=("dense", "hybrid"), default="dense")
    ap.add_argument("--layers", default="16,32,64")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    print("| layers | program | lower s | compile s |\n|---|---|---|---|")
    for n in map(int, args.layers.split(",")):
        shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=n,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
        if args.family == "dense":
            cfg = dense_config_from_dict(dict(shape, model_type="qwen3"))
        else:
            cfg = hybrid_config_from_dict(dict(shape, model_type="qwen3_5_text", full_attention_interval=4,
                                               linear_num_key_heads=2, linear_num_value_heads=4,
                                               linear_key_head_dim=64, linear_value_head_dim=64))
        m = jaxspec.random_model(cfg, seed=0)
        d = jaxspec.init_drafter(m, num_layers=1, block_size=16, seed=0)
        ar, spec = Decoder(m), Decoder(m, d, method="ddtree", budget=16)
        prompt = [[5] * 100]
        run = ar.prefill(prompt, 64)
        srun = spec.prefill(prompt, 64)
        kw = dict(sampling=SamplingParams(), eos=(-1,))
        progs = {
            "ar_prefill": (engine.ar_prefill, (m.jit_def, m.params, jnp.zeros((1, 128), jnp.int32),
                                               jnp.zeros((1,), jnp.int32), jax.random.key(0), jnp.int32(64)),
                           dict(max_len=256, out_len=64, **kw)),
            "ar_decode": (engine.ar_decode, (m.jit_def, m.params, run.state, jnp.int32(64)), kw),
            "ddtree_decode": (engine.spec_decode, (m.jit_def, m.params, d.jit_def, d.params, srun.state,
                                                   jnp.int32(64)), dict(settings=spec.settings)),
        }
        for name, (fn, a, k) in progs.items():
            lower_s, compile_s = seconds(fn, *a, **k)
            rows.append(dict(layers=n, program=name, lower_s=lower_s, compile_s=compile_s))
            print(f"| {n} | {name} | {lower_s:.1f} | {compile_s:.1f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(backend=jax.default_backend(), family=args.family, rows=rows),
                                              indent=2))


if __name__ == "__main__":
    main()
