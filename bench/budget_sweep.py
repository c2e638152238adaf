"""Acceptance and speed vs DDTree budget on a hybrid GDN target: exact tree verification vs the seed's leaky scan.

    python bench/budget_sweep.py                                    # random target, oracle drafter
    python bench/budget_sweep.py --pair bench/models/qwen3_5-stdlib # the trained pair (scripts/train_hybrid_pair.sh)

Random mode: a random Qwen3.5-shaped target (GDN, GDN, GDN, attention) and the oracle drafter
(jaxspec.testing), which proposes the target's own greedy continuation with the right token demoted to rank
2..max_rank at a `noise` fraction of depths, so only wider trees recover it. Pair mode: a hybrid target and
DFlash drafter trained by the project, on held-out prompts that neither saw in training.

For each budget and mode, in one run: acceptance length (tokens per target forward), decode tokens/s
against jaxspec AR on the same target, and whether the output equals AR greedy. The exact mode must be
lossless at every budget; the leaky mode (one flat causal scan over the BFS-ordered tree, sibling writes
leaking into each other's GDN state) is what the seed ran, and loses both. Also: one tree verify of 1 +
budget nodes as a multiple of one AR step (same cache length), and the extra memory a GDN layer holds
between verify and commit (per-node state snapshots vs the block form), for a Qwen3.6-27B-shaped layer.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jaxspec  # noqa: E402
from jaxspec.model import Model, encode_prompt  # noqa: E402
from jaxspec.models.qwen3_next import hybrid_config_from_dict  # noqa: E402
from jaxspec.testing import oracle_drafter  # noqa: E402
from jaxspec.train.data import read_prompts  # noqa: E402
from spec import component_times  # noqa: E402

RESULTS = Path(__file__).parent / "results"
QWEN36_27B = dict(Hk=16, Hv=48, dk=128, dv=128, C=2 * 16 * 128 + 48 * 128, gdn_layers=48)  # architectures.md §2.8
MODES = ("exact", "leaky")


def random_target(seed: int = 0) -> Model:
    cfg = hybrid_config_from_dict(dict(
        model_type="qwen3_5_text", vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, full_attention_interval=4, max_position_embeddings=2048,
        eos_token_id=None, bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}))
    m = jaxspec.random_model(cfg, seed=seed)
    m.params = jax.tree.map(lambda x: x * 2.0, m.params)  # peaked logits: no greedy near-ties
    return m


def with_mode(model: Model, mode: str) -> Model:
    cfg = model.config.replace(gdn_mode=mode)
    return model.with_config(cfg)


def memory_per_layer(budget: int, dtype_bytes: int = 2, s=QWEN36_27B) -> dict:
    """Bytes one GDN layer keeps from verify to commit, batch 1, N = budget + 1 nodes (states float32)."""
    N = budget + 1
    snapshots = N * s["Hv"] * s["dk"] * s["dv"] * 4
    block = N * (s["C"] * dtype_bytes + s["Hk"] * s["dk"] * 4 + s["Hv"] * s["dv"] * 4 + s["Hv"] * 4)
    transient = N * N * s["Hv"] * 4  # one [N, N, Hv] array of the block (a few live at once), inside verify only
    return dict(budget=budget, nodes=N, snapshots=snapshots, block=block, block_transient=transient)


def print_memory() -> list[dict]:
    print("extra memory per GDN layer between verify and commit (Qwen3.6-27B shapes, bf16 activations):")
    print(f"{'budget':>6} {'snapshots':>12} {'block form':>12} {'(transient)':>12} {'x 48 layers':>24}")
    mem = [memory_per_layer(b) for b in (16, 64, 256)]
    for r in mem:
        mib = lambda x: f"{x / 2**20:.1f} MiB"  # noqa: E731
        print(f"{r['budget']:>6} {mib(r['snapshots']):>12} {mib(r['block']):>12} {mib(r['block_transient']):>12} "
              f"{r['snapshots'] * 48 / 2**30:>8.2f} GiB vs {r['block'] * 48 / 2**20:.0f} MiB "
              f"({r['snapshots'] / r['block']:.0f}x less)")
    return mem


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", help="a directory holding target/ and drafter/ (default: random target + oracle)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128])
    ap.add_argument("--new", type=int, default=64, help="tokens to generate per prompt")
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts (pair mode) or random prompts")
    ap.add_argument("--noise", type=float, default=0.5, help="oracle drafter: fraction of depths demoted")
    ap.add_argument("--max-rank", type=int, default=4)
    ap.add_argument("--verify-reps", type=int, default=10, help="timing repetitions of verify / AR step")
    args = ap.parse_args(argv)
    mem = print_memory()

    if args.pair:
        pair = Path(args.pair)
        model = jaxspec.load(pair / "target")
        drafter = jaxspec.load_drafter(pair / "drafter", model)
        prompts = read_prompts(pair / "target" / "heldout.jsonl")[: args.prompts]
        inputs = [encode_prompt(model, p, None) for p in prompts]
    else:
        model, drafter = random_target(), None
        rng = np.random.RandomState(0)
        inputs = [rng.randint(0, model.config.vocab_size, 24).tolist() for _ in range(args.prompts)]
    models = {mode: with_mode(model, mode) for mode in MODES}

    ar, drafters = [], []
    for ids in inputs:
        for _ in range(2):  # the first run compiles
            r = jaxspec.generate(model, input_ids=ids, method="ar", max_new_tokens=args.new)
        ar.append(r)
        drafters.append(drafter or oracle_drafter(model, ids + r.token_ids, noise=args.noise, max_rank=args.max_rank))
    ar_tps = statistics.mean(r.stats["tokens_per_second"] for r in ar)
    kind = f"trained pair {args.pair}" if args.pair else f"random target, oracle drafter (noise {args.noise})"
    print(f"\n{kind}; {len(inputs)} prompts, {args.new} new tokens, greedy; backend {jax.default_backend()}")
    print(f"jaxspec AR: {ar_tps:.1f} tok/s")
    print(f"{'budget':>6} {'verify/AR':>9} | {'exact AL':>8} {'tok/s':>7} {'vs AR':>6} {'lossless':>8} | "
          f"{'leaky AL':>8} {'tok/s':>7} {'vs AR':>6} {'lossless':>8}")
    rows = []
    for budget in args.budgets:
        row = dict(budget=budget)
        for mode in MODES:
            runs = []
            for ids, d, ref in zip(inputs, drafters, ar):
                res = jaxspec.generate(models[mode], input_ids=ids, drafter=d, method="ddtree", budget=budget,
                                       max_new_tokens=args.new)
                runs.append(dict(acceptance_length=res.stats["acceptance_length"],
                                 tokens_per_second=res.stats["tokens_per_second"],
                                 lossless=res.token_ids == ref.token_ids))
            tps = statistics.mean(r["tokens_per_second"] for r in runs)
            row[mode] = dict(acceptance_length=round(statistics.mean(r["acceptance_length"] for r in runs), 3),
                             tokens_per_second=round(tps, 2), speedup=round(tps / ar_tps, 3),
                             lossless=all(r["lossless"] for r in runs), per_prompt=runs)
        # as generate runs
        c = component_times(model, drafters[0], budget, "ddtree", lookup=True, reps=args.verify_reps)
        row["verify_over_ar_step"] = round(c["verify_s"] / c["ar_step_s"], 3)
        row["components_s"] = c
        rows.append(row)
        e, lk = row["exact"], row["leaky"]
        print(f"{budget:>6} {row['verify_over_ar_step']:>9.2f} | "
              f"{e['acceptance_length']:>8.2f} {e['tokens_per_second']:>7.1f} "
              f"{e['speedup']:>5.2f}x {str(e['lossless']):>8} | {lk['acceptance_length']:>8.2f} "
              f"{lk['tokens_per_second']:>7.1f} {lk['speedup']:>5.2f}x {str(lk['lossless']):>8}", flush=True)

    RESULTS.mkdir(exist_ok=True)
    tag = f"budget_sweep_{Path(args.pair).name}" if args.pair else "budget_sweep_gdn"
    out = RESULTS / f"{tag}.json"
    out.write_text(json.dumps(dict(date=datetime.datetime.now().isoformat(timespec="seconds"), args=vars(args),
                                   backend=jax.default_backend(), ar_tokens_per_second=ar_tps, sweep=rows,
                                   memory_qwen36_27b=mem), indent=2))
    print(f"wrote {out}")
    plot(rows, ar_tps, out.with_suffix(".png"), kind)


def plot(rows, ar_tps, path, title):
    """Acceptance length and decode tokens/s against the budget, exact vs leaky, AR as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    budgets = [r["budget"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("exact", "o-"), ("leaky", "s--")):
        a.plot(budgets, [r[mode]["acceptance_length"] for r in rows], style, label=f"{mode} verification")
        b.plot(budgets, [r[mode]["tokens_per_second"] for r in rows], style, label=f"{mode} verification")
    b.axhline(ar_tps, color="C2", ls=":", label="jaxspec AR")
    a.set(ylabel="acceptance length (tokens / target forward)", title=title)
    b.set(ylabel="decode tokens/s")
    for ax in (a, b):
        ax.set(xscale="log", xlabel="DDTree budget (tree nodes)")
        ax.set_xticks(budgets, [str(k) for k in budgets])
        ax.minorticks_off()
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
