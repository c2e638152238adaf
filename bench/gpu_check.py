"""One prepared check for a lent GPU (bench/gpu_check.sh runs it): random-weight targets shaped like
Qwen3.6-27B (hybrid GDN) and an 8B dense Llama, bf16, on one GPU, in one run:

  * HBM copy bandwidth (a 4 GiB bf16 read + write), the roofline every time below is compared with;
  * the KV and latent commit kernels (Pallas, Mosaic GPU) against their XLA references;
  * per target: one AR step behind 512 committed tokens (time, and weight bytes / bandwidth = the roofline);
    one tree verify at budgets 16 / 32 / 64 / 128 over the same cache, as a multiple of the AR step;
    AR and DDTree (budget 64, the oracle drafter proposing the target's greedy continuation, so deep paths are
    accepted) end to end: tokens/s, acceptance length, rounds/s.

Each section checks the remaining time first (`--minutes`, default 7.5) and is recorded as skipped rather than
overrunning. `--layers N` truncates each target to N layers (full width; times scale with depth) to fit the
budget; `--tiny` shrinks everything for a CPU dry run. Prints a table and writes
bench/results/gpu_check_<backend>.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxspec
from jaxspec.budget import timeit as timed
from jaxspec.config import dense_config_from_dict
from jaxspec.models.qwen3_next import hybrid_config_from_dict
from jaxspec.segment import Segment
from jaxspec.testing import oracle_drafter
from jaxspec.tree import build_tree, tree_segment
from pallas_kernels.kv_commit import kv_commit, latent_commit

RESULTS = Path(__file__).parent / "results"
QWEN36_27B = dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                  num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                  linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                  max_position_embeddings=262144, eos_token_id=None, bos_token_id=None,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
LLAMA_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, eos_token_id=None,
                bos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
            linear_value_head_dim=32)
BUDGETS = (16, 32, 64, 128)
PREFIX = 512  # committed tokens behind every timed forward


class Clock:
    def __init__(self, minutes: float):
        self.end = time.monotonic() + 60 * minutes

    def left(self) -> float:
        return self.end - time.monotonic()


def bandwidth(tiny: bool) -> dict:
    n = (1 << 20) if tiny else (2 << 30)  # bf16 elements: 2 MiB / 4 GiB
    x = jnp.ones((n,), jnp.bfloat16)
    t = timed(jax.jit(lambda a: a * 2), x)
    return dict(bytes=2 * x.nbytes, seconds=t, gb_per_s=2 * x.nbytes / t / 1e9)


def commits(tiny: bool) -> list[dict]:
    """The commit kernels vs XLA on a 32-token accepted path (the worst case of one round)."""
    T = 512 if tiny else 8192
    path, start, n = jnp.arange(0, 64, 2, dtype=jnp.int32), jnp.int32(T - 256), jnp.int32(32)
    rows = []
    for name, f, shape in (("kv [1, 8, T, 128]", kv_commit, (1, 8, T, 128)),
                           ("latent [1, T, 576]", latent_commit, (1, T, 576))):
        cache = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
        xla = jax.jit(lambda c: f(c, path, start, n, impl="xla"))
        pallas = jax.jit(lambda c: f(c, path, start, n, impl="pallas"))
        same = bool(jnp.array_equal(xla(cache), pallas(cache)))
        rows.append(dict(cache=name, T=T, same_as_xla=same, xla_us=timed(xla, cache) * 1e6,
                         pallas_us=timed(pallas, cache) * 1e6))
    return rows


def build(base: dict, layers: int | None, tiny: bool):
    d = dict(base, **(TINY if tiny else {}))
    if layers:
        d["num_hidden_layers"] = layers
    cfg = (dense_config_from_dict if d["model_type"] == "llama" else hybrid_config_from_dict)(d)
    m = jaxspec.random_model(cfg, seed=0, dtype="float32" if tiny else "bfloat16")
    # random weights at their init scale give flat logits; a larger scale makes greedy paths well defined
    m.params = jax.tree.map(lambda x: (x * 2).astype(x.dtype), m.params)
    return m


def forwards(m, clock: Clock) -> dict:
    """One AR step and one tree verify per budget behind PREFIX committed tokens (same cache, same weights)."""
    module = m.module
    graphdef, params = nnx.split(module)

    @jax.jit
    def step(params, tokens, segment, cache):
        logits, _, pending = nnx.merge(graphdef, params)(tokens, segment, cache)
        return logits, pending

    cache = module.init_cache(1, PREFIX + 256)
    cache = dataclasses.replace(cache, length=jnp.int32(PREFIX))
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    ar = timed(step, params, jnp.zeros((1, 1), jnp.int32), Segment.causal(jnp.full((1, 1), PREFIX, jnp.int32)), cache)
    out = dict(weight_bytes=weight_bytes, ar_step_ms=ar * 1e3, verify=[])
    draft = jax.random.normal(jax.random.key(1), (15, m.config.vocab_size)) * 3
    for b in BUDGETS:
        if clock.left() < 60:
            out["verify"].append(dict(budget=b, skipped="time"))
            continue
        tree = build_tree(draft, b)
        t = timed(step, params, tree.tokens[None], tree_segment(tree, jnp.int32(PREFIX)), cache)
        out["verify"].append(dict(budget=b, ms=t * 1e3, over_ar_step=t / ar))
    return out


def end_to_end(m, clock: Clock, new_tokens: int) -> dict:
    prompt = [int(t) for t in np.random.RandomState(0).randint(0, m.config.vocab_size, 64)]
    ar = jaxspec.generate(m, input_ids=prompt, method="ar", max_new_tokens=new_tokens)
    out = dict(ar_tokens_per_s=ar.stats["tokens_per_second"])
    if clock.left() < 90:
        return dict(out, ddtree="skipped (time)")
    d = oracle_drafter(m, prompt + ar.token_ids, noise=0.0, block_size=16)
    r = jaxspec.generate(m, input_ids=prompt, drafter=d, method="ddtree", budget=64, max_new_tokens=new_tokens)
    assert r.token_ids == ar.token_ids, "DDTree output differs from AR"
    return dict(out, ddtree_tokens_per_s=r.stats["tokens_per_second"], acceptance_length=r.stats["acceptance_length"],
                rounds_per_s=r.stats["rounds"] / r.stats["decode_s"],
                speedup=r.stats["tokens_per_second"] / out["ar_tokens_per_s"])


def section(report: dict, name: str, clock: Clock, need_s: float, f, *args):
    if clock.left() < need_s:
        report[name] = "skipped (time)"
        return
    t = time.monotonic()
    try:
        report[name] = f(*args)
    except Exception as e:  # one failing section must not lose the others' numbers
        report[name] = dict(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
    print(f"[{time.monotonic() - t:6.1f} s] {name}: {json.dumps(report[name], default=str)[:600]}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=7.5)
    ap.add_argument("--layers", type=int, default=None, help="truncate each target to N layers")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU dry run of the script")
    args = ap.parse_args()
    clock = Clock(args.minutes)
    report = dict(backend=jax.default_backend(), device=str(jax.devices()[0]), jax=jax.__version__,
                  layers=args.layers, tiny=args.tiny)
    section(report, "bandwidth", clock, 10, bandwidth, args.tiny)
    section(report, "commit_kernels", clock, 20, commits, args.tiny)
    for name, base in (("qwen3.6-27b", QWEN36_27B), ("llama-8b", LLAMA_8B)):
        if clock.left() < 120:
            report[name] = "skipped (time)"
            continue
        m = build(base, args.layers, args.tiny)
        section(report, f"{name}/forwards", clock, 60, forwards, m, clock)
        section(report, f"{name}/generate", clock, 120, end_to_end, m, clock, args.new_tokens)
        del m
    measured = report.get("bandwidth")
    bw = measured["gb_per_s"] if isinstance(measured, dict) and "gb_per_s" in measured else None
    print("\n| target | weights GB | AR step ms | roofline ms | verify/AR @16/32/64/128 | AR tok/s | DDTree tok/s "
          "| AL |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("qwen3.6-27b", "llama-8b"):
        f, g = report.get(f"{name}/forwards"), report.get(f"{name}/generate")
        if not isinstance(f, dict) or "ar_step_ms" not in f:
            print(f"| {name} | {f} |")
            continue
        roof = f["weight_bytes"] / (bw * 1e9) * 1e3 if bw else float("nan")
        f["roofline_ms"] = roof
        ratios = "/".join(f"{v['over_ar_step']:.2f}" if "ms" in v else "-" for v in f["verify"])
        g = g if isinstance(g, dict) else {}
        print(f"| {name} | {f['weight_bytes'] / 1e9:.1f} | {f['ar_step_ms']:.2f} | {roof:.2f} | {ratios} | "
              f"{g.get('ar_tokens_per_s', float('nan')):.1f} | {g.get('ddtree_tokens_per_s', float('nan')):.1f} | "
              f"{g.get('acceptance_length', float('nan')):.2f} |")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"gpu_check_{report['backend']}{'_tiny' if args.tiny else ''}.json"
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
