"""Batched AR throughput, the speed of drafter self-distillation: SmolLM2-135M (bundled GGUF, float32) answers
the shipped training prompts, greedy, as `jaxspec.train` generates its data (prompt + answer <= --seq-len).

Two ways over the same prompts, each timed end to end (compiles included, as a data run pays them):
  lockstep    `generate(input_ids=batch)` per batch of B: every row runs until the batch's longest answer
  continuous  `batching.generate_many(batch=B)`: a finished row takes the next prompt (jaxspec/batching.py)
Throughput = answer tokens / seconds; both must produce the same answers (greedy).

    python bench/ar_batch.py --batches 32,64,128 --prompts 256
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxspec  # noqa: E402
from jaxspec.batching import generate_many  # noqa: E402
from jaxspec.cli import bundled_model  # noqa: E402
from jaxspec.model import encode_prompt  # noqa: E402
from jaxspec.train.data import read_prompts  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="64")
    ap.add_argument("--prompts", type=int, default=256, help="the first N training prompts")
    ap.add_argument("--seq-len", type=int, default=256, help="prompt + answer tokens per row, as in training")
    ap.add_argument("--chunk", type=int, default=16, help="continuous: decode steps between refills")
    ap.add_argument("--modes", default="lockstep,continuous")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    model = jaxspec.load(bundled_model())
    encoded = [encode_prompt(model, p, None)[: args.seq_len // 2] for p in read_prompts("train")[: args.prompts]]
    limits = [args.seq_len - len(p) for p in encoded]
    rows = []
    for B in map(int, args.batches.split(",")):
        answers = {}
        for mode in args.modes.split(","):
            t = time.perf_counter()
            if mode == "lockstep":
                out = []
                for i in range(0, len(encoded), B):
                    chunk = encoded[i: i + B]
                    out += jaxspec.generate(model, input_ids=chunk, method="ar",
                                            max_new_tokens=args.seq_len - max(map(len, chunk))).token_ids
            elif mode == "continuous":
                out = generate_many(model, encoded, limits, batch=B, chunk=args.chunk)
            else:
                raise SystemExit(f"unknown mode {mode!r}: lockstep or continuous")
            seconds = time.perf_counter() - t
            tokens = sum(map(len, out))
            answers[mode] = out
            rows.append(dict(batch=B, mode=mode, seconds=seconds, answer_tokens=tokens,
                             tokens_per_second=tokens / seconds))
            print(f"batch {B:>4} {mode:>10}: {tokens / seconds:7.1f} tok/s  "
                  f"({tokens} answer tokens in {seconds:.0f} s)", flush=True)
        if len(answers) == 2:
            a, b = answers.values()
            same = sum(x == y[: len(x)] or y == x[: len(y)] for x, y in zip(a, b))
            print(f"batch {B:>4}: {same}/{len(a)} answers agree (lockstep caps a batch at its longest prompt's room)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(seq_len=args.seq_len, prompts=len(encoded), chunk=args.chunk,
                                                   rows=rows), indent=2))


if __name__ == "__main__":
    main()
