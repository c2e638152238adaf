"""`budget="auto"`: the DDTree budget with the most tokens per second on this machine.

A round with budget b emits AL(b) tokens on average and costs one draft plus one verify forward of 1 + b
nodes, so the rate is AL(b) / (draft + verify(1 + b)). The two factors come from different places:

  * AL(b) belongs to the drafter and its target: measured on held-out prompts and shipped beside the weights
    as `acceptance.json` (`bench/spec.py --save-acceptance` writes it);
  * the costs belong to the machine: the target's forward over 1 + b nodes and the drafter's forward are
    timed here, once per (target, drafter, backend), and kept in the user's cache directory.

The budget is the measured table's best entry. A drafter without a table keeps the plain default
(block_size - 1) and says so in the statistics.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

ACCEPTANCE_FILE = "acceptance.json"
COST_CONTEXT = 256  # cache slots the costs are timed over (a short chat turn)


def read_acceptance(path: Path) -> dict[int, float] | None:
    """A drafter dir's acceptance table {budget: acceptance length}, or None if it ships none."""
    f = Path(path) / ACCEPTANCE_FILE
    if not f.is_file():
        return None
    try:
        table = {int(b): float(al) for b, al in json.loads(f.read_text())["acceptance_length"].items()}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{f} is not an acceptance table ({e}); regenerate it with bench/spec.py --save-acceptance "
                         "or delete it") from e
    if not table or any(b < 1 or al < 1 for b, al in table.items()):
        raise ValueError(f"{f} holds no valid entries (budgets >= 1, acceptance lengths >= 1)")
    return table


def cache_dir() -> Path:
    env = os.environ.get("JAXSPEC_CACHE_DIR")
    return Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxspec"


def timeit(fn, *args, reps: int = 5) -> float:
    """Median seconds of `reps` calls after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def measure_costs(model, drafter, budgets) -> dict:
    """Seconds of one drafter forward and of one target forward over 1 + b nodes (b in budgets; b = 0 is an
    AR step), at COST_CONTEXT // 2 committed tokens. Causal masks: a tree mask costs the same."""
    from jaxspec.segment import Segment

    L = COST_CONTEXT // 2
    cache = model.module.init_cache(1, COST_CONTEXT).advance(L)
    target_def, drafter_def = model.graphdef, drafter.graphdef

    @jax.jit
    def verify(params, cache, tokens):
        positions = L + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        return nnx.merge(target_def, params)(tokens, Segment.causal(positions), cache)[0]

    @jax.jit
    def draft(tparams, dparams, dcache):
        return nnx.merge(drafter_def, dparams).draft_logits(nnx.merge(target_def, tparams), dcache, jnp.int32(0),
                                                            jnp.int32(L))

    dcache = drafter.module.init_cache(1, COST_CONTEXT)
    verify_s = {b: timeit(verify, model.params, cache, jnp.zeros((1, 1 + b), jnp.int32)) for b in sorted({0, *budgets})}
    return dict(draft_s=timeit(draft, model.params, drafter.params, dcache), verify_s=verify_s)


def _key(model, drafter, budgets) -> str:
    from jaxspec.models import cpu_kernel  # it imports this module

    dev = jax.devices()[0]
    params = [(str(x.shape), str(x.dtype)) for x in jax.tree.leaves(model.params)]
    kernels = cpu_kernel.build_key() if dev.platform == "cpu" and cpu_kernel.available() else None
    parts = [model.config, drafter.config, params, dev.platform, getattr(dev, "device_kind", ""), jax.__version__,
             jax.device_count(), sorted(budgets), COST_CONTEXT, kernels]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def costs(model, drafter, budgets) -> dict:
    """measure_costs, remembered on disk (the cost of one compile per budget, paid once per machine)."""
    path = cache_dir() / "costs.json"
    key = _key(model, drafter, budgets)
    try:
        known = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        known = {}
    if key in known:
        c = known[key]
        return dict(draft_s=c["draft_s"], verify_s={int(b): s for b, s in c["verify_s"].items()})
    logging.getLogger(__name__).warning(
        "jaxspec: timing verify forwards of %s nodes for budget='auto' (once per machine; kept in %s)",
        sorted(1 + b for b in budgets), path)
    c = measure_costs(model, drafter, budgets)
    known[key] = c
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: measure again next time
    return c


def best_budget(acceptance: dict[int, float], draft_s: float, verify_s: dict[int, float]) -> tuple[int, dict]:
    """argmax_b AL(b) / (draft + verify(1 + b)) over the table; also the predicted speed-up over AR per budget."""
    ar = verify_s[0]
    speedup = {b: acceptance[b] * ar / (draft_s + verify_s[b]) for b in acceptance}
    return max(speedup, key=lambda b: (speedup[b], -b)), speedup


def choose(model, drafter) -> tuple[int, dict]:
    """(budget, statistics) for budget="auto"."""
    table = drafter.acceptance
    if not table:
        return drafter.config.block_size - 1, {"budget_source": "default (the drafter ships no acceptance.json)"}
    c = costs(model, drafter, list(table))
    b, speedup = best_budget(table, c["draft_s"], c["verify_s"])
    return b, {"budget_source": "auto", "predicted_speedup": {str(k): round(v, 3) for k, v in sorted(speedup.items())}}
