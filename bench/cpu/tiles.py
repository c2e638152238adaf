"""What the column tiles buy: the same loaded weights decoded with their float kernels in column tiles (how
`jaxspec.load` and `load_drafter` keep them on one CPU device) and as plain [in, out] matrices, interleaved
prompt by prompt in one process, so the VM's slow and fast spells fall on both alike.

    python bench/cpu/tiles.py [--runs 2] [--budget 8] [--bf16-checkpoint]

Bundled SmolLM2 and its drafter, four chat prompts outside every prompt set, greedy, 128 new tokens, after a
warm-up run; prints each form's median decode tokens/s for AR and DDTree, the per-prompt ratios, and checks
that the two forms decode the same tokens.

--bf16-checkpoint asks what a bfloat16 checkpoint gains from tiles kept in bfloat16: the target's Linear kernels
are rounded to bfloat16 first (as a bfloat16 safetensors checkpoint loaded in float32 holds them; the bundled
GGUF's are not), then decoded with float32 tiles ("plain" below) and with bfloat16 tiles ("tiled"), which give
the same products from half the bytes. The drafter (saved in bfloat16) keeps its bfloat16 tiles in both.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jaxspec  # noqa: E402
from jaxspec import kernels  # noqa: E402
from jaxspec.cli import BUNDLED_DRAFTER, bundled_model  # noqa: E402
from jaxspec.kernels import cpu  # noqa: E402
from jaxspec.models.layers import Linear  # noqa: E402

PROMPTS = ["Explain why the sky is blue in a few sentences.",
           "Write a JavaScript function that converts a string to title case.",
           "A train travels 240 km in 3 hours. What is its average speed?",
           "List five ways to save energy at home."]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--bf16-checkpoint", action="store_true",
                    help="round the target's kernels to bfloat16, then float32 tiles against bfloat16 tiles")
    args = ap.parse_args(argv)
    tiled = jaxspec.load(bundled_model())
    tiled_drafter = jaxspec.load_drafter(str(BUNDLED_DRAFTER), tiled)
    if args.bf16_checkpoint:
        module = nnx.merge(tiled.graphdef, tiled.plain_params())
        for _, node in nnx.iter_graph(module):
            if isinstance(node, Linear):
                node.kernel[...] = node.kernel[...].astype(jnp.bfloat16).astype(jnp.float32)
        params = nnx.state(module)
        plain = dataclasses.replace(tiled, params=cpu.to_layout(params, compact=False))
        tiled = dataclasses.replace(tiled, params=cpu.to_layout(params))
        plain_drafter = tiled_drafter
    else:
        plain = dataclasses.replace(tiled, params=tiled.plain_params())
        plain_drafter = dataclasses.replace(tiled_drafter, params=kernels.plain(tiled_drafter.params))
    forms = {"plain": (plain, plain_drafter), "tiled": (tiled, tiled_drafter)}
    speed: dict[tuple[str, str], list[float]] = {}
    tokens: dict[tuple[str, str], list[list[int]]] = {}
    for run in range(args.runs + 1):  # run 0 compiles
        for prompt in PROMPTS:
            for form, (model, drafter) in forms.items():
                for method in ("ar", "ddtree"):
                    kw = {} if method == "ar" else dict(drafter=drafter, budget=args.budget)
                    res = jaxspec.generate(model, prompt, method=method, max_new_tokens=128, **kw)
                    if run:
                        speed.setdefault((form, method), []).append(res.stats["tokens_per_second"])
                        tokens.setdefault((form, method), []).append(res.token_ids)
    same = all(tokens[("plain", m)] == tokens[("tiled", m)] for m in ("ar", "ddtree"))
    print(f"{len(PROMPTS)} prompts x {args.runs} runs, DDTree budget {args.budget}; decode tokens/s, median")
    for method in ("ar", "ddtree"):
        p, t = np.array(speed[("plain", method)]), np.array(speed[("tiled", method)])
        r = t / p
        print(f"{method:>7}: plain {np.median(p):6.1f}  tiled {np.median(t):6.1f}  tiled / plain {np.median(r):.2f}x "
              f"[{r.min():.2f}, {r.max():.2f}]")
    for form in forms:
        ratio = np.array(speed[(form, "ddtree")]) / np.array(speed[(form, "ar")])
        print(f"DDTree / AR, {form}: {np.median(ratio):.2f}x")
    print("same tokens in both forms:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
