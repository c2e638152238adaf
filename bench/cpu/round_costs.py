"""The cost table `budget="auto"` decides with, measured several times in one run.

    python bench/cpu/round_costs.py [--model M] [--drafter DIR] [--runs 3] [--lookup]

Each run is `jaxspec.budget.measure_costs` from scratch (the first one compiles): one AR step and one
DDTree round per budget of the drafter's acceptance table, timed in the decode loops `generate` runs. It
prints each round in AR steps, the predicted speed-up AL(b) x AR step / round(b) and the budget `auto` would
pick, so the spread between runs shows how far the machine's noise moves the choice. Nothing is cached.
--lookup times every run twice, without and with prompt lookup (what its bookkeeping adds to a round).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jaxspec  # noqa: E402
from jaxspec.budget import best_budget, measure_costs  # noqa: E402
from jaxspec.cli import BUNDLED_DRAFTER, bundled_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: the bundled SmolLM2)")
    ap.add_argument("--drafter", default=str(BUNDLED_DRAFTER), help="drafter dir with an acceptance.json")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--lookup", action="store_true", help="time rounds without and with prompt lookup")
    args = ap.parse_args(argv)
    model = jaxspec.load(args.model or bundled_model())
    drafter = jaxspec.load_drafter(args.drafter, model)
    if not drafter.acceptance:
        ap.error(f"{args.drafter} has no acceptance.json; write one with bench/spec.py --save-acceptance")
    for run, lookup in ((r, lk) for r in range(args.runs) for lk in ((False, True) if args.lookup else (True,))):
        t = time.perf_counter()
        c = measure_costs(model, drafter, drafter.acceptance, lookup)
        ar = c["ar_step_s"]
        pick, speedup = best_budget(drafter.acceptance, ar, c["round_s"])
        rounds = " ".join(f"{b}:{s / ar:.3f}" for b, s in c["round_s"].items())
        predicted = " ".join(f"{b}:{x:.2f}x" for b, x in speedup.items())
        print(f"run {run}{' lookup' if lookup else ''} ({time.perf_counter() - t:.0f} s): AR step {1e3 * ar:.1f} ms; "
              f"round / AR step {rounds}; "
              f"predicted {predicted}; auto picks {pick}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
