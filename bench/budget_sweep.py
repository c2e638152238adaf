"""Acceptance vs DDTree budget on a hybrid GDN target: exact tree verification vs the seed's leaky scan.

    python bench/budget_sweep.py [--budgets 1 4 16 64] [--new 64] [--noise 0.5]

A random Qwen3.5-shaped target (GDN, GDN, GDN, attention) and the oracle drafter (jaxspec.testing), which
proposes the target's own greedy continuation with the right token demoted to rank 2..max_rank at a
`noise` fraction of depths, so only wider trees recover it. For each budget and mode: acceptance length
(tokens per target forward) and whether the output equals the target's AR greedy output. The exact mode
must be lossless at every budget; the leaky mode (one flat causal scan over the BFS-ordered tree, sibling
writes leaking into each other's GDN state) is what the seed ran, and loses both.

Also prints the extra memory a GDN layer holds between verify and commit (per-node state snapshots vs the
block form's per-node k, u, decay and conv input), for a Qwen3.6-27B-shaped layer.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxspec  # noqa: E402
from jaxspec.model import Model  # noqa: E402
from jaxspec.models.qwen3_next import hybrid_config_from_dict  # noqa: E402
from jaxspec.testing import oracle_drafter  # noqa: E402

RESULTS = Path(__file__).parent / "results"
QWEN36_27B = dict(Hk=16, Hv=48, dk=128, dv=128, C=2 * 16 * 128 + 48 * 128, gdn_layers=48)  # architectures.md §2.8


def target(mode: str, seed: int = 0) -> Model:
    cfg = hybrid_config_from_dict(dict(
        model_type="qwen3_5_text", vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, full_attention_interval=4, max_position_embeddings=2048,
        eos_token_id=None, bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})).replace(gdn_mode=mode)
    m = jaxspec.random_model(cfg, seed=seed)
    m.params = jax.tree.map(lambda x: x * 2.0, m.params)  # peaked logits: no greedy near-ties
    return m


def with_mode(model: Model, mode: str) -> Model:
    cfg = model.config.replace(gdn_mode=mode)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: type(model.module)(cfg, rngs=nnx.Rngs(0))))
    return Model(cfg, graphdef, model.params)


def memory_per_layer(budget: int, dtype_bytes: int = 2, s=QWEN36_27B) -> dict:
    """Bytes one GDN layer keeps from verify to commit, batch 1, N = budget + 1 nodes (states float32)."""
    N = budget + 1
    snapshots = N * s["Hv"] * s["dk"] * s["dv"] * 4
    block = N * (s["C"] * dtype_bytes + s["Hk"] * s["dk"] * 4 + s["Hv"] * s["dv"] * 4 + s["Hv"] * 4)
    transient = N * N * s["Hv"] * 4  # one [N, N, Hv] array of the block (a few live at once), inside verify only
    return dict(budget=budget, nodes=N, snapshots=snapshots, block=block, block_transient=transient)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--new", type=int, default=64, help="tokens to generate per run")
    ap.add_argument("--noise", type=float, default=0.5)
    ap.add_argument("--max-rank", type=int, default=4)
    args = ap.parse_args()

    print("extra memory per GDN layer between verify and commit (Qwen3.6-27B shapes, bf16 activations):")
    print(f"{'budget':>6} {'snapshots':>12} {'block form':>12} {'(transient)':>12} {'x 48 layers':>24}")
    mem = [memory_per_layer(b) for b in (16, 64, 256)]
    for r in mem:
        mib = lambda x: f"{x / 2**20:.1f} MiB"  # noqa: E731
        print(f"{r['budget']:>6} {mib(r['snapshots']):>12} {mib(r['block']):>12} {mib(r['block_transient']):>12} "
              f"{r['snapshots'] * 48 / 2**30:>8.2f} GiB vs {r['block'] * 48 / 2**20:.0f} MiB")

    exact = target("exact")
    prompt = [int(t) for t in np.random.RandomState(0).randint(0, 1024, 24)]
    ref = jaxspec.generate(exact, input_ids=prompt, method="ar", max_new_tokens=args.new).token_ids
    drafter = oracle_drafter(exact, prompt + ref, noise=args.noise, max_rank=args.max_rank)
    rows = []
    print(f"\nacceptance length (tokens per target forward), oracle drafter noise {args.noise}, {args.new} new tokens:")
    print(f"{'budget':>6} {'exact':>8} {'lossless':>9} {'leaky':>8} {'lossless':>9}")
    for budget in args.budgets:
        row = dict(budget=budget)
        for mode in ("exact", "leaky"):
            res = jaxspec.generate(with_mode(exact, mode), input_ids=prompt, drafter=drafter, method="ddtree",
                                   budget=budget, max_new_tokens=args.new)
            row[mode] = dict(acceptance_length=round(float(res.stats["acceptance_length"]), 3),
                             lossless=res.token_ids == ref)
        rows.append(row)
        print(f"{budget:>6} {row['exact']['acceptance_length']:>8.2f} {str(row['exact']['lossless']):>9} "
              f"{row['leaky']['acceptance_length']:>8.2f} {str(row['leaky']['lossless']):>9}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "budget_sweep_gdn.json"
    out.write_text(json.dumps(dict(args=vars(args), sweep=rows, memory_qwen36_27b=mem), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
