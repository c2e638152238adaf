"""Compile time of the decode programs against depth: AR prefill, the AR decode loop and the DDTree decode loop
(budget 16, a 1-layer random drafter), for random targets of 16 / 32 / 64 layers at small width (compile time
grows with the number of ops, which the unrolled layer loop multiplies by depth, not with the width): dense
(Qwen3) or hybrid (Qwen3.6's pattern, 3 Gated DeltaNet layers to 1 attention layer). Each program is lowered
and compiled once, timed apart.

With --server CTX it times a server's start instead (`Scheduler._build`, 4 rows, DDTree at budget 4 with 1-, 2- and
4-row loops, AR with --method ar) at that context: every program it compiles (a refill per prompt width, the decode
loops) and the seconds the start takes, compiles and warm-up calls included. Run it with
JAXSPEC_COMPILATION_CACHE=0 to time cold compiles.

    python bench/compile.py [--family dense|hybrid] [--layers 16,32,64] [--json FILE]
    python bench/compile.py --server 8192 [--method ar|ddtree] [--layers 8]
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
from jaxspec.scheduler import Scheduler  # noqa: E402


def seconds(jitted, *args, **kw) -> tuple[float, float]:
    """(lower s, compile s) of one program."""
    t = time.perf_counter()
    lowered = jitted.lower(*args, **kw)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t, time.perf_counter() - t1


def target(family: str, layers: int, context: int = 4096):
    shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=context)
    if family == "dense":
        return jaxspec.random_model(dense_config_from_dict(dict(shape, model_type="qwen3")), seed=0)
    cfg = hybrid_config_from_dict(dict(shape, model_type="qwen3_5_text", full_attention_interval=4,
                                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                                       linear_value_head_dim=64))
    return jaxspec.random_model(cfg, seed=0)


def server_start(args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from compiles import compiles, engine_compiles

    layers = int(args.layers.split(",")[0])
    m = target(args.family, layers, args.server)
    spec = args.method != "ar"
    d = jaxspec.init_drafter(m, num_layers=1, block_size=8, seed=0) if spec else None
    dec = Decoder(m, d, method=args.method, budget=4 if spec else None, sampling=SamplingParams(per_row=True))
    sched = Scheduler(dec, max_batch=4, max_model_len=args.server, budgets={1: 2, 2: 4, 4: 4} if spec else None)
    t = time.perf_counter()
    with compiles() as counted:
        sched._build()
    programs = engine_compiles(counted)
    print(f"{args.family} {layers} layers, {args.method}, context {args.server}: {sum(programs.values())} programs, "
          f"start {time.perf_counter() - t:.1f} s; {programs}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=("dense", "hybrid"), default="dense")
    ap.add_argument("--layers", default="16,32,64")
    ap.add_argument("--json")
    ap.add_argument("--server", type=int, metavar="CTX", help="time a server's start at this context instead")
    ap.add_argument("--method", choices=("ar", "ddtree"), default="ddtree")
    args = ap.parse_args(argv)
    if args.server:
        return server_start(args)
    rows = []
    print("| layers | program | lower s | compile s |\n|---|---|---|---|")
    for n in map(int, args.layers.split(",")):
        m = target(args.family, n)
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
