"""Teacher-forced accuracy of a drafter per block slot, and its DDTree acceptance simulated offline, on rows of
a training cache it did or did not see.

    python bench/slot_accuracy.py --drafter jaxspec/drafters/smollm2-135m-instruct --work RUN \
        --rows seen=0:1656 unseen=1656:3183 [--budgets 2,4,8,16 --temperatures 1,0.7,1.3,2]

RUN is a `python -m jaxspec.train --work` directory (its data.npz and taps.npy, which must be of the
drafter's tap layers). For each named row range: random rows, up to 32 random answer anchors each, the block
[x_a, MASK...] exactly as in training, and the fraction of slot k's top-1 proposals equal to x_{a+k}. On
greedy answers slot 1 is the chance that depth 1 is accepted by a chain draft. Rows the drafter trained on
against rows it never saw tell whether it underfits (both low: more steps or capacity) or overfits (a gap:
more data).

With --budgets (needs the cache's soft labels, i.e. a run with --soft-weight) the same blocks, on the rows that
are the target's greedy answers (each token its top-1 after the row's prefix), go through `build_tree` at each
budget, with the drafter's logits divided by each temperature, and the acceptance length is 1 + the depth of
the deepest tree node whose path is the row's continuation: what a greedy DDTree round anchored there accepts,
in seconds instead of a decoding run. Temperature 1 is what jaxspec drafts with; the others ask whether the
drafter's scores rank the tree's nodes well (a temperature that accepts more would mean they do not).
"""
from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxspec  # noqa: E402
from jaxspec.cli import bundled_model  # noqa: E402
from jaxspec.train.data import Dataset  # noqa: E402
from jaxspec.tree import build_tree  # noqa: E402


def draft_blocks(model, drafter, data: Dataset, taps, i: int, anchors: np.ndarray):
    """Draft-vocabulary logits of slots 1..B-1 [A, B-1, V'] for blocks [x_a, MASK...] of row i, and
    x_{a..a+B-1} [A, B]."""
    d, t, Bk = drafter.module, model.module, drafter.config.block_size
    S = data.tokens.shape[1]
    labels = data.tokens[i][np.minimum(anchors[:, None] + np.arange(Bk), S - 1)]
    block = jnp.where(jnp.arange(Bk) == 0, jnp.asarray(labels[:, :1]), drafter.config.mask_token_id)[None]
    h = d.train_forward(jnp.asarray(taps[i : i + 1]), t.embed(block), jnp.asarray(anchors[None], jnp.int32))
    return d.head(t, h[0, :, 1:]), labels


def slot_accuracy(model, drafter, data: Dataset, taps, rows, anchors: int, rng) -> np.ndarray:
    """Top-1 accuracy of slots 1..B-1 [B-1] over `anchors` random answer anchors of each row."""
    Bk = drafter.config.block_size
    vocab = np.asarray(drafter.config.draft_vocab) if drafter.config.draft_vocab else None
    S = data.tokens.shape[1]
    hits, n = np.zeros(Bk - 1), np.zeros(Bk - 1)
    for i in rows:
        cand = np.flatnonzero(data.loss_mask[i, 1:] & (np.arange(1, S) < data.lengths[i]))
        a = np.sort(rng.choice(cand, size=min(anchors, len(cand)), replace=False))
        logits, labels = draft_blocks(model, drafter, data, taps, i, a)
        idx = a[:, None] + np.arange(Bk)  # [A, Bk]
        valid = (idx < data.lengths[i]) & data.loss_mask[i][np.minimum(idx, S - 1)]
        pred = np.asarray(jnp.argmax(logits, -1))  # [A, Bk-1] draft-vocabulary rows
        pred = vocab[pred] if vocab is not None else pred
        hits += ((pred == labels[:, 1:]) & valid[:, 1:]).sum(0)
        n += valid[:, 1:].sum(0)
    return hits / np.maximum(n, 1)


@partial(jax.jit, static_argnums=2)
def tree_acceptance(logits: jax.Array, labels: jax.Array, budget: int) -> jax.Array:
    """Tokens a greedy DDTree round accepts [A] (bonus included): logits [A, D, V'], labels [A, D] the true
    continuation in the logits' vocabulary (-1 where it has no row, so it never matches)."""
    D = logits.shape[1]

    def one(lg, lab):
        tree = build_tree(lg, budget)
        hit = (tree.valid & (tree.tokens == lab[jnp.maximum(tree.depths - 1, 0)])).at[0].set(True)
        on_path = hit
        for _ in range(D):  # a node is on the true path iff it and every ancestor match
            on_path = hit & on_path[tree.parents]
        return 1 + jnp.max(jnp.where(on_path, tree.depths, 0))

    return jax.vmap(one)(logits, labels)


def greedy_rows(data: Dataset, top1: np.ndarray, rows) -> list[int]:
    """The rows whose every answer token (but 1%, for near-ties) is the target's top-1 after its prefix."""
    S = data.tokens.shape[1]
    keep = []
    for i in rows:
        m = data.loss_mask[i, 1:] & (np.arange(1, S) < data.lengths[i])
        if m.any() and (data.tokens[i, 1:] == top1[i, :-1])[m].mean() >= 0.99:
            keep.append(int(i))
    return keep


def simulated_acceptance(model, drafter, data, taps, rows, anchors, budgets, temperatures, rng) -> np.ndarray:
    """Mean acceptance length [len(temperatures), len(budgets)] of DDTree rounds anchored at random answer
    positions of `rows` (each with a full block of answer ahead)."""
    Bk, V = drafter.config.block_size, model.config.vocab_size
    vocab = np.arange(V) if drafter.config.draft_vocab is None else np.asarray(drafter.config.draft_vocab)
    to_row = np.full(V, -1)
    to_row[vocab] = np.arange(len(vocab))
    S = data.tokens.shape[1]
    total, n = np.zeros((len(temperatures), len(budgets))), 0
    for i in rows:
        # a + B-1 in the row
        cand = np.flatnonzero(data.loss_mask[i, 1:] & (np.arange(S - 1) + Bk - 1 < data.lengths[i]))
        if not len(cand):
            continue
        a = np.sort(rng.choice(cand, size=min(anchors, len(cand)), replace=False))
        logits, labels = draft_blocks(model, drafter, data, taps, i, a)
        lab = jnp.asarray(to_row[labels[:, 1:]], jnp.int32)
        for ti, T in enumerate(temperatures):
            for bi, b in enumerate(budgets):
                total[ti, bi] += float(tree_acceptance(logits / T, lab, b).sum())
        n += len(a)
    return total / max(n, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--model", default=None, help="target (default: the bundled SmolLM2)")
    ap.add_argument("--work", required=True, help="a `python -m jaxspec.train --work` directory")
    ap.add_argument("--rows", nargs="+", required=True, help="NAME=LO:HI row ranges of the cache")
    ap.add_argument("--samples", type=int, default=48, help="rows drawn from each range")
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--budgets", default=None, help="e.g. 2,4,8,16: also simulate DDTree on the greedy rows")
    ap.add_argument("--temperatures", default="1", help="drafter logit temperatures for --budgets, e.g. 1,0.7,1.3,2")
    args = ap.parse_args()
    model = jaxspec.load(args.model or bundled_model())
    drafter = jaxspec.load_drafter(args.drafter, model)
    work = Path(args.work)
    if json.loads((work / "taps.json").read_text()) != list(drafter.config.target_layer_ids):
        sys.exit(f"error: {work} caches taps of other layers than the drafter's "
                 f"{list(drafter.config.target_layer_ids)}")
    data = Dataset.load(work / "data.npz")
    taps = np.load(work / "taps.npy", mmap_mode="r")
    top1 = None
    if args.budgets:
        try:
            budgets = [int(b) for b in args.budgets.split(",")]
            temps = [float(x) for x in args.temperatures.split(",")]
        except ValueError:
            sys.exit("error: --budgets takes integers and --temperatures numbers, comma-separated "
                     f"(got {args.budgets!r}, {args.temperatures!r})")
        if min(budgets) < 1 or min(temps) <= 0:
            sys.exit("error: budgets must be >= 1 and temperatures > 0")
        if not (work / "soft.npz").exists():
            sys.exit(f"error: --budgets needs {work}/soft.npz (the target's top tokens); "
                     "use a cache made with --soft-weight")
        with np.load(work / "soft.npz") as z:
            top1 = z["ids"][..., 0]
    rng = np.random.default_rng(0)
    for spec in args.rows:
        name, span = spec.split("=")
        lo, hi = map(int, span.split(":"))
        rows = rng.choice(np.arange(lo, hi), size=min(args.samples, hi - lo), replace=False)
        acc = slot_accuracy(model, drafter, data, taps, rows, args.anchors, rng)
        print(f"{name}: slots 1-{len(acc)} top-1 accuracy " + " ".join(f"{x:.3f}" for x in acc), flush=True)
        if args.budgets:
            greedy = greedy_rows(data, top1, range(lo, hi))
            pick = rng.choice(greedy, size=min(args.samples, len(greedy)), replace=False) if greedy else []
            al = simulated_acceptance(model, drafter, data, taps, pick, args.anchors, budgets, temps, rng)
            print(f"{name}: {len(greedy)} greedy rows, {len(pick)} drawn; "
                  f"simulated DDTree acceptance length at budgets {args.budgets}:")
            for T, row in zip(temps, al):
                print(f"  temperature {T:g}: " + " ".join(f"{x:.3f}" for x in row), flush=True)


if __name__ == "__main__":
    main()
