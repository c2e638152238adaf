"""Batched AR throughput, the speed of drafter self-distillation: SmolLM2-135M (bundled GGUF, float32) answers
the shipped training prompts in batches, greedy, exactly as `jaxspec.train` generates its data.

For each batch size: total generated tokens / decode time (prefill and compile excluded), the median over
`--reps` batches of different prompts after one warm-up batch.

    python bench/ar_batch.py --batches 32,64,128 --seq-len 256
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxspec  # noqa: E402
from jaxspec.api import encode_prompt  # noqa: E402
from jaxspec.generate import bundled_model  # noqa: E402
from jaxspec.train.data import read_prompts  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="32,64,128")
    ap.add_argument("--seq-len", type=int, default=256, help="prompt + answer tokens per row, as in training")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    model = jaxspec.load(bundled_model())
    encoded = [encode_prompt(model, p, None)[: args.seq_len // 2] for p in read_prompts("train")]
    rows = []
    for B in map(int, args.batches.split(",")):
        tps, prefill = [], []
        for r in range(args.reps + 1):
            chunk = encoded[r * B: (r + 1) * B]
            res = jaxspec.generate(model, input_ids=chunk, method="ar",
                                   max_new_tokens=args.seq_len - max(map(len, chunk)))
            if r:  # the first batch compiles
                tps.append((res.stats["new_tokens"] - B) / res.stats["decode_s"])
                prefill.append(res.stats["prefill_s"])
        rows.append(dict(batch=B, tokens_per_second=statistics.median(tps), runs=tps))
        print(f"batch {B:>4}: {statistics.median(tps):8.1f} tok/s  (runs {', '.join(f'{t:.0f}' for t in tps)})",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(seq_len=args.seq_len, rows=rows), indent=2))


if __name__ == "__main__":
    main()
