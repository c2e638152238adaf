"""Teacher-forced accuracy of a drafter per block slot, on rows of a training cache it did or did not see.

    python bench/slot_accuracy.py --drafter jaxspec/drafters/smollm2-135m-instruct --work RUN \
        --rows seen=0:1656 unseen=1656:3183

RUN is a `python -m jaxspec.train --work` directory (its data.npz and taps.npy, which must be of the
drafter's tap layers). For each named row range: random rows, up to 32 random answer anchors each, the block
[x_a, MASK...] exactly as in training, and the fraction of slot k's top-1 proposals equal to x_{a+k}. On
greedy answers slot 1 is the chance that depth 1 is accepted by a chain draft. Rows the drafter trained on
against rows it never saw tell whether it underfits (both low: more steps or capacity) or overfits (a gap:
more data).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxspec  # noqa: E402
from jaxspec.generate import bundled_model  # noqa: E402
from jaxspec.train.data import Dataset  # noqa: E402


def slot_accuracy(model, drafter, data: Dataset, taps, rows, anchors: int, rng) -> np.ndarray:
    """Top-1 accuracy of slots 1..B-1 [B-1] over `anchors` random answer anchors of each row."""
    d, t, Bk = drafter.module, model.module, drafter.config.block_size
    vocab = np.asarray(drafter.config.draft_vocab) if drafter.config.draft_vocab else None
    S = data.tokens.shape[1]
    hits, n = np.zeros(Bk - 1), np.zeros(Bk - 1)
    for i in rows:
        cand = np.flatnonzero(data.loss_mask[i, 1:] & (np.arange(1, S) < data.lengths[i]))
        a = np.sort(rng.choice(cand, size=min(anchors, len(cand)), replace=False))
        idx = np.minimum(a[:, None] + np.arange(Bk), S - 1)  # [A, Bk]
        labels = data.tokens[i][idx]
        valid = ((a[:, None] + np.arange(Bk)) < data.lengths[i]) & data.loss_mask[i][idx]
        block = jnp.where(jnp.arange(Bk) == 0, jnp.asarray(labels[:, :1]), drafter.config.mask_token_id)[None]
        h = d.train_forward(jnp.asarray(taps[i : i + 1]), t.embed(block), jnp.asarray(a[None], jnp.int32))
        pred = np.asarray(jnp.argmax(d.head(t, h[0, :, 1:]), -1))  # [A, Bk-1] draft-vocabulary rows
        pred = vocab[pred] if vocab is not None else pred
        hits += ((pred == labels[:, 1:]) & valid[:, 1:]).sum(0)
        n += valid[:, 1:].sum(0)
    return hits / np.maximum(n, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--model", default=None, help="target (default: the bundled SmolLM2)")
    ap.add_argument("--work", required=True, help="a `python -m jaxspec.train --work` directory")
    ap.add_argument("--rows", nargs="+", required=True, help="NAME=LO:HI row ranges of the cache")
    ap.add_argument("--samples", type=int, default=48, help="rows drawn from each range")
    ap.add_argument("--anchors", type=int, default=32)
    args = ap.parse_args()
    model = jaxspec.load(args.model or bundled_model())
    drafter = jaxspec.load_drafter(args.drafter, model)
    work = Path(args.work)
    if json.loads((work / "taps.json").read_text()) != list(drafter.config.target_layer_ids):
        sys.exit(f"error: {work} caches taps of other layers than the drafter's {list(drafter.config.target_layer_ids)}")
    data = Dataset.load(work / "data.npz")
    taps = np.load(work / "taps.npy", mmap_mode="r")
    rng = np.random.default_rng(0)
    for spec in args.rows:
        name, span = spec.split("=")
        lo, hi = map(int, span.split(":"))
        rows = rng.choice(np.arange(lo, hi), size=min(args.samples, hi - lo), replace=False)
        acc = slot_accuracy(model, drafter, data, taps, rows, args.anchors, rng)
        print(f"{name}: slots 1-{len(acc)} top-1 accuracy " + " ".join(f"{x:.3f}" for x in acc))


if __name__ == "__main__":
    main()
