"""bench/slot_accuracy.py's offline DDTree replay against brute force: a greedy round accepts 1 + the longest
prefix of the true continuation that is among the `budget` most likely draft paths (all paths enumerated)."""
import importlib.util
import itertools
from pathlib import Path

import numpy as np

_spec = importlib.util.spec_from_file_location(
    "slot_accuracy", Path(__file__).resolve().parents[1] / "bench" / "slot_accuracy.py")
slot_accuracy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(slot_accuracy)


def accepted_by_enumeration(logits: np.ndarray, labels: np.ndarray, budget: int) -> int:
    D, V = logits.shape
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    paths = [p for d in range(1, D + 1) for p in itertools.product(range(V), repeat=d)]
    score = {p: sum(logp[i, t] for i, t in enumerate(p)) for p in paths}
    kept = set(sorted(paths, key=score.get, reverse=True)[:budget])
    depth = 0
    while depth < D and tuple(labels[: depth + 1]) in kept:
        depth += 1
    return 1 + depth


def test_tree_acceptance_matches_enumeration():
    rng = np.random.default_rng(0)
    A, D, V = 48, 3, 5
    logits = (rng.standard_normal((A, D, V)) * 2).astype(np.float32)
    # continuations drawn from the draft itself reach every depth; -1 (no draft-vocabulary row) never matches
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    labels = np.array([[rng.choice(V, p=p[a, d]) for d in range(D)] for a in range(A)])
    labels[::7, 1] = -1
    for budget in (1, 3, 8, 20):
        want = [accepted_by_enumeration(logits[a], labels[a], budget) for a in range(A)]
        got = np.asarray(slot_accuracy.tree_acceptance(logits, labels, budget))
        np.testing.assert_array_equal(got, want, err_msg=f"budget {budget}")
        assert len(set(want)) > 1
