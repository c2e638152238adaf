"""Speculative decoding for a batch: total decode tokens/s and acceptance length of AR and DDTree at batch sizes
B = 1, 2, 4, ..., in one run, every row's output checked equal to AR's.

Targets: the bundled SmolLM2-135M with its shipped drafter on held-out prompts (never used in training), or
`--model qwen35` (a random Qwen3.5-shaped hybrid GDN target) with the oracle drafter. At each B the same
prompts run as ceil(prompts / B) batches of B rows (greedy, `max_new_tokens` each). Each method runs once to
compile, then `--repeats` timed AR / DDTree pairs alternate, so a slow spell of a shared VM slows a pair rather
than one method; the table gives the medians (the speed-up: the median of the pairs' ratios). Tokens/s = decoded
tokens (the prefill's first token aside) over the decode seconds summed over batches, as `generate`'s stats
count them.

    python bench/batch.py --batches 1,2,4,8,16 --prompts 16
    python bench/batch.py --model qwen35 --batches 1,4,16 --budget 8
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxspec  # noqa: E402
from jaxspec.cli import bundled_model, default_drafter  # noqa: E402
from jaxspec.model import encode_prompt  # noqa: E402
from jaxspec.models.qwen3_next import hybrid_config_from_dict  # noqa: E402
from jaxspec.testing import oracle_drafter  # noqa: E402
from jaxspec.train.data import read_prompts  # noqa: E402

QWEN35 = dict(model_type="qwen3_5_text", vocab_size=8192, hidden_size=512, intermediate_size=1536,
              num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
              linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64, full_attention_interval=4,
              max_position_embeddings=4096, eos_token_id=None, bos_token_id=None,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25})


def decode_rate(model, rows, B, max_new, drafter_for=None, **kw):
    """(token rows, decoded tokens, decode seconds, rounds, budgets used: 0 where auto chose AR) over batches of B
    rows, one pass. drafter_for(i, batch): the drafter for the batch starting at row i."""
    out, tokens, seconds, rounds, budgets = [], 0, 0.0, 0, set()
    for i in range(0, len(rows), B):
        batch = rows[i: i + B]
        drafter = drafter_for(i, batch) if drafter_for else None
        r = jaxspec.generate(model, input_ids=batch, max_new_tokens=max_new, drafter=drafter, **kw)
        out += r.token_ids
        tokens += r.stats.new_tokens - len(batch)
        seconds += r.stats.decode_s
        rounds += r.stats.rounds or 0
        budgets.add(r.stats.budget if r.stats.method != "ar" else 0)  # auto's 0: AR was predicted faster
    return out, tokens, seconds, rounds, sorted(b for b in budgets if b is not None)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "qwen35"))
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--budget", default="auto",
                    help="DDTree's tree size: auto (timed per batch size; needs the drafter's acceptance.json, so "
                         "smollm2 only) or one number for every batch size")
    ap.add_argument("--noise", type=float, default=0.1, help="oracle drafter (qwen35): chance a right token is demoted")
    ap.add_argument("--repeats", type=int, default=3, help="timed AR / DDTree pairs per batch size (medians)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1 (timed pairs per batch size), got {args.repeats}")
    batches = [int(b) for b in args.batches.split(",")]
    budget = args.budget if args.budget == "auto" else int(args.budget)

    if args.model == "smollm2":
        path = bundled_model()
        model = jaxspec.load(path)
        drafter = jaxspec.load_drafter(default_drafter(path), model)
        rows = [encode_prompt(model, p, None) for p in read_prompts("heldout")[: args.prompts]]
    else:
        drafter = None  # the oracle, per batch
        model = jaxspec.random_model(hybrid_config_from_dict(QWEN35), seed=0)
        model.params = jax.tree.map(lambda x: x * 2.0, model.params)
        rng = np.random.RandomState(0)
        rows = [rng.randint(0, QWEN35["vocab_size"], int(rng.randint(16, 64))).tolist() for _ in range(args.prompts)]
    results = []
    for B in batches:
        ar_rows = decode_rate(model, rows, B, args.max_new_tokens, method="ar")[0]  # compiles; each row's reference
        refs = [r + a for r, a in zip(rows, ar_rows)]

        def drafter_for(i, batch):
            return drafter if drafter is not None else oracle_drafter(model, refs[i: i + len(batch)], noise=args.noise)

        def ddtree():
            return decode_rate(model, rows, B, args.max_new_tokens, drafter_for, method="ddtree", budget=budget)

        ddtree()  # compiles (and times the round costs `auto` needs)
        ar_rates, dd_rates = [], []
        for _ in range(args.repeats):  # interleaved: a slow spell of the VM slows a pair, not one method
            _, ar_tokens, ar_s, _, _ = decode_rate(model, rows, B, args.max_new_tokens, method="ar")
            out, tokens, s, rounds, used = ddtree()
            assert out == ar_rows, f"B={B}: DDTree rows differ from AR's"
            ar_rates.append(ar_tokens / ar_s)
            dd_rates.append(tokens / s)
        al = tokens / rounds if rounds else 0.0
        ratios = [d / a for a, d in zip(ar_rates, dd_rates)]
        row = dict(batch=B, ar_tokens_per_s=statistics.median(ar_rates),
                   ddtree_tokens_per_s=statistics.median(dd_rates), speedup=statistics.median(ratios),
                   acceptance_length=al, budgets=used, ar_runs=ar_rates, ddtree_runs=dd_rates)
        results.append(row)
        spread = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"B={B:>3}  AR {row['ar_tokens_per_s']:8.1f} tok/s  DDTree@{','.join(map(str, used))} "
              f"{row['ddtree_tokens_per_s']:8.1f} tok/s  x{row['speedup']:.2f} ({spread})  AL {al:.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(model=args.model, prompts=len(rows), budget=args.budget,
                                                   max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                                                   rows=results), indent=2))


if __name__ == "__main__":
    main()
