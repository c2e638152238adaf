"""`budget="auto"`: the DDTree budget with the most tokens per second on this machine.

A round with budget b emits AL(b) tokens per row on average and costs round(b) seconds (one draft, one verify
forward of 1 + b nodes per row and the bookkeeping around them), so its rate over AR is AL(b) x ar_step /
round(b), both timed at the batch size that runs. The factors come from different places:

  * AL(b) belongs to the drafter and its target: measured on held-out prompts and shipped beside the weights
    as `acceptance.json` (`bench/spec.py --save-acceptance` writes it);
  * the costs belong to the machine and the batch: an AR step and a round per budget are timed here in the
    decode loops themselves, once per (target, drafter, backend, machine, batch size rounded up to a power of
    two; see _key), and kept in the user's cache directory (`costs.json`; in this process's memory alone where
    that cannot be written). A batch's verify reads the weights once for B x (1 + b) nodes, so where a larger
    tree is nearly free at batch 1 it is not at batch 16: the best budget falls as the batch grows.

The budget is the measured table's best entry. A drafter without a table keeps the plain default
(block_size - 1) and says so in the statistics.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoder import CACHE_BUCKET, Decoder, Run, prompt_width, round_up
from jaxspec.kernels import cpu
from jaxspec.model import encode_prompt
from jaxspec.sampling import SamplingParams
from jaxspec.usercache import cache_dir

try:
    import fcntl
except ImportError:  # no POSIX locks (Windows): costs.json is still replaced whole, by a rename
    fcntl = None

_log = logging.getLogger(__name__)

COST_CONTEXT = 256  # twice the prompt the costs are timed after (a short chat turn)
# 1: isolated forwards; 2: decode loops after random tokens; 3: the same after COST_PROMPT; 4: entries also record
# their format, measurement count (reps) and date, and the key names the core count, XLA_FLAGS and jaxspec's version;
# 5: the decode loops are waited for (4 and before timed their dispatch alone), a batch's AR in one buffer
COST_FORMAT = 5
COST_REPS = 4  # measure_costs' passes over the budgets for the stored table
# What the rounds are timed after, where the model has a tokenizer: a user's question, so the rounds accept what
# they do in use. After random tokens a small target repeats itself and a round accepts far more than in use, so
# a chunk of `tokens` was one round carrying a whole call's dispatch and read-back, which inflated the round's
# cost and made `auto` choose too small a budget (docs/design/budget.md).
COST_PROMPT = ("I am planning a small vegetable garden behind my house. The plot gets about six hours of sun in the "
               "morning, the soil is heavy clay, and we often have dry spells in late summer. I would like to grow "
               "tomatoes, beans, lettuce and a few herbs, and I do not want to spend much money on tools or "
               "fertiliser. My neighbour says I should build raised beds, but my brother thinks I can simply dig in "
               "compost every spring. Which approach would you recommend for a beginner, how should I prepare the "
               "soil this autumn, and what should I plant first next year? Please explain your reasoning.")


def timeit(fn, *args, reps: int = 5) -> float:
    """Median seconds of `reps` calls after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def cost_prompt(model, length: int) -> list[int]:
    """The last `length` tokens of COST_PROMPT as `generate` would encode it (in the chat form where the tokenizer
    has one), or `length` random tokens for a model without a tokenizer."""
    if model.tokenizer is None:
        return np.random.RandomState(0).randint(0, model.config.vocab_size, length).tolist()
    return encode_prompt(model, COST_PROMPT, None)[-length:]


def measure_costs(model, drafter, acceptance: dict[int, float], lookup: bool = True, tokens: int = 8,
                  reps: int = 4, batch: int = 1) -> dict:
    """Seconds of one AR decode step and of one speculative round per budget of the `acceptance` table, timed
    inside the jitted decode loops `generate` runs, for `batch` rows each after a prompt of up to
    COST_CONTEXT // 2 tokens (cost_prompt).

    A round is everything `generate` pays for: the draft, the tree build (with `lookup`, the prompt lookup and
    its merge), the verify of 1 + b nodes, the acceptance walk and the commit; timing isolated forwards instead
    left the bookkeeping out and paid a dispatch per call. Each budget is first compiled and timed twice, in
    increasing order, stopping at the first budget whose round costs more than even the table's best acceptance
    length could repay at the best rate found so far (rounds only grow with the tree). Then `reps` - 2 passes go
    over every kept budget in turn, `tokens` tokens each, each chunk of rounds right after as many AR steps. A
    round costs the median of its chunks' ratios to the AR chunk before them, times the fastest AR step. A VM's
    speed moves in spells of seconds, and not by the same factor for AR steps and rounds: the ratio of two
    neighbouring chunks shares their spell, and interleaving gives every budget the same spells (timed one
    budget after another, a slow spell can fall on one budget alone and mislead `auto`; docs/design/budget.md)."""
    ids = cost_prompt(model, COST_CONTEXT // 2)
    rows = [ids] * batch
    chunks = max(reps, 2)  # timed chunks per budget
    greedy, no_eos = SamplingParams(), (-1,)
    ar_dec = Decoder(model, sampling=greedy, eos=no_eos)
    spec_decs = {b: Decoder(model, drafter, method="ddtree", budget=b, sampling=greedy, eos=no_eos, lookup=lookup)
                 for b in acceptance}
    most = max(d.settings.round_tokens for d in spec_decs.values())  # a call of rounds may overshoot by one round
    ar_len, spec_len = chunks * tokens, (chunks + 1) * (tokens + most)

    def copy(run: Run) -> Run:  # decoding consumes (donates) a state
        return dataclasses.replace(run, state=jax.tree.map(jnp.copy, run.state))

    def forwards(dec: Decoder, run: Run) -> int:
        return int(jnp.max(run.state.steps if dec.method == "ar" else run.state.rounds))

    def timed(dec: Decoder, run: Run) -> tuple[Run, float]:  # `tokens` more tokens -> (run, seconds per forward)
        before = forwards(dec, run)
        t = time.perf_counter()
        run = dec.decode(run, dec.count(run) + tokens)
        jax.block_until_ready(run.state)  # the call returns once the loop is queued; the loop itself is the cost
        return run, (time.perf_counter() - t) / (forwards(dec, run) - before)

    def sample(b):  # one chunk of budget b's rounds right after one AR chunk: their ratio, and the AR step
        ar_run, ar_t = timed(ar_dec, runs[b][0])
        spec_run, round_t = timed(spec_decs[b], runs[b][1])
        runs[b] = (ar_run, spec_run)
        ratios[b].append(round_t / ar_t)
        return ar_t

    # one buffer for the whole AR run, as the rounds have: a batch's AR would otherwise grow its cache by windows,
    # and each new window's compile would be timed as steps
    ar0 = ar_dec.prefill(rows, ar_len + 2, max_len=round_up(prompt_width(len(ids)) + ar_len + 2, CACHE_BUCKET))
    timed(ar_dec, copy(ar0))  # compiles
    # Per budget an AR run beside its round run, so both decode over contexts of the same length.
    ar_s, ratios, runs, prefilled = float("inf"), {}, {}, {}
    for b in sorted(acceptance):  # compile each budget and time it twice, while a larger one may still win
        dec = spec_decs[b]
        max_len = dec.spec_max_len(len(ids), spec_len + 1)
        if max_len not in prefilled:  # the prefill's state does not depend on the budget: one per buffer size
            prefilled[max_len] = dec.prefill(rows, spec_len + 1)
        spec_run, _ = timed(dec, copy(prefilled[max_len]))  # compiles
        runs[b], ratios[b] = (copy(ar0), spec_run), []
        for _ in range(2):
            ar_s = min(ar_s, sample(b))
        if not larger_can_win(acceptance, {c: statistics.median(r) for c, r in ratios.items()}):
            break
    for _ in range(reps - 2):
        for b in ratios:
            ar_s = min(ar_s, sample(b))
    return dict(ar_step_s=ar_s, round_s={b: statistics.median(r) * ar_s for b, r in ratios.items()})


def larger_can_win(acceptance: dict[int, float], round_s: dict[int, float]) -> bool:
    """Whether a budget above the largest timed one could beat the best timed rate AL(b) / round(b): its round
    costs at least the largest timed one's, and its acceptance length is at most the table's largest."""
    best_rate = max(acceptance[b] / s for b, s in round_s.items())
    return max(acceptance.values()) / round_s[max(round_s)] >= best_rate


@functools.cache
def _jaxspec_version() -> str:
    """The installed jaxspec's version (read from its metadata: importing the package here would be a cycle)."""
    try:
        return importlib.metadata.version("jaxspec")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def batch_bucket(batch: int) -> int:
    """The batch size costs are timed at for a batch of `batch` rows: the power of two at or above it."""
    return 1 << max(0, math.ceil(math.log2(batch)))


def _key(model, drafter, acceptance, lookup, batch: int = 1) -> str:
    """Everything that changes a round's timing: the models and their dtypes, the backend, device kind and count,
    the host's core count, XLA_FLAGS, the jax and jaxspec versions, the kernels, the table, lookup and the batch
    size (named only past 1, so batch-1 entries keep their keys)."""
    dev = jax.devices()[0]
    params = [(str(x.shape), str(x.dtype)) for x in jax.tree.leaves(model.params)]
    kernels = (model.kernels, cpu.build_key() if model.kernels == "cpu" else None)
    parts = [model.config, drafter.config, params, dev.platform, getattr(dev, "device_kind", ""), jax.__version__,
             jax.device_count(), sorted(acceptance.items()), lookup, COST_CONTEXT, COST_FORMAT, kernels,
             os.cpu_count(), os.environ.get("XLA_FLAGS", ""), _jaxspec_version()] + ([batch] if batch > 1 else [])
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def _seconds(x) -> float | None:
    """x as a positive finite number of seconds, else None (JSON's true/false are not numbers here)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        return None
    return float(x)


def _valid_entry(entry) -> dict | None:
    """A stored cost entry as costs() returns it ({ar_step_s, round_s: {budget: s}}), or None where it is not one
    this version wrote or cannot be believed: missing fields, another format, non-numbers, zero, negative or
    non-finite seconds, an empty round table, or a round under a twentieth of an AR step (a round runs the
    target's forward over 1 + b tokens and the drafter's as well, so no real timing comes near that, while on a
    tiny target a round can time under half an AR step; a 1e-9 s round would make `auto` pick the largest
    budget)."""
    if not isinstance(entry, dict) or entry.get("format") != COST_FORMAT:
        return None
    ar = _seconds(entry.get("ar_step_s"))
    rounds = entry.get("round_s")
    if ar is None or not isinstance(rounds, dict) or not rounds:
        return None
    out = {}
    for b, s in rounds.items():
        try:
            b = int(b)
        except (TypeError, ValueError):
            return None
        s = _seconds(s)
        if b < 1 or s is None or s < ar / 20:
            return None
        out[b] = s
    return dict(ar_step_s=ar, round_s=out)


def _read_table(path: Path, quiet: bool = False) -> dict:
    """costs.json's valid entries {key: stored entry}; a missing, unreadable or malformed file reads as empty and
    a malformed entry as absent (each noticed once in the log), so they are timed again and rewritten."""
    try:
        known = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or bad UTF-8
        if not quiet:
            _log.warning("jaxspec: ignoring the budget cost table %s (%s); it will be timed again and rewritten",
                         path, e)
        return {}
    if not isinstance(known, dict):
        if not quiet:
            _log.warning("jaxspec: ignoring the budget cost table %s (a JSON %s, not an object); it will be "
                         "timed again and rewritten", path, type(known).__name__)
        return {}
    good = {k: v for k, v in known.items() if _valid_entry(v) is not None}
    if len(good) < len(known) and not quiet:
        _log.info("jaxspec: dropping %d stale or malformed entries of %s", len(known) - len(good), path)
    return good


def _write_table(path: Path, key: str, entry: dict) -> None:
    """Add `entry` under `key` to costs.json: under a lock, the file as it is now (another process may have added
    its own entries since it was read) plus this entry, written to a temporary file and renamed over it, so
    concurrent first runs keep each other's keys and no reader ever sees half a file. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        known = _read_table(path, quiet=True)
        known[key] = entry
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps(known, indent=1))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


# Costs this process measured or read, by (costs.json path, key): where the cache cannot be written, a process
# still times once.
_measured: dict[tuple[str, str], dict] = {}


def costs(model, drafter, acceptance: dict[int, float], lookup: bool = True, batch: int = 1) -> dict:
    """measure_costs at `batch` rows (a power of two: batch_bucket), remembered in the user's cache (the cost of
    one compile per budget, paid once per machine) or, where it cannot be written, for this process.

    An entry records its format, its measurement count and its date, and is used as long as COST_FORMAT is its
    format: a timing is the median of COST_REPS interleaved passes (measure_costs), and timing again on every
    disagreement would cost each run a compile per budget, so a noisy entry is kept until the format changes
    (which re-times every entry) or the user deletes costs.json; the count and the date let a later format
    decide which entries to trust."""
    path = cache_dir() / "costs.json"
    key = _key(model, drafter, acceptance, lookup, batch)
    if (str(path), key) in _measured:
        return _measured[str(path), key]
    stored = _valid_entry(_read_table(path).get(key))
    if stored is not None and set(stored["round_s"]) <= set(acceptance):
        _measured[str(path), key] = stored
        return stored
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(path.parent, os.W_OK)
    except OSError:
        writable = False
    _log.warning("jaxspec: timing speculative rounds at budgets %s%s for budget='auto' (%s)", sorted(acceptance),
                 f" and batch {batch}" if batch > 1 else "", f"once per machine; kept in {path}" if writable
                 else f"{path.parent} cannot be written: kept for this process only, timed again by the next")
    c = measure_costs(model, drafter, acceptance, lookup, reps=COST_REPS, batch=batch)
    _measured[str(path), key] = c
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    entry = dict(ar_step_s=c["ar_step_s"], round_s={str(b): s for b, s in c["round_s"].items()},
                 format=COST_FORMAT, reps=COST_REPS, measured=now)
    try:
        _write_table(path, key, entry)
    except OSError as e:
        if writable:  # said "kept in" above
            _log.warning("jaxspec: could not save the budget costs to %s (%s); kept for this process only", path, e)
    return c


def best_budget(acceptance: dict[int, float], ar_step_s: float, round_s: dict[int, float]) -> tuple[int, dict]:
    """argmax_b AL(b) / round(b) over the timed budgets; also the predicted speed-up over AR of each."""
    speedup = {b: acceptance[b] * ar_step_s / round_s[b] for b in round_s}
    return max(speedup, key=lambda b: (speedup[b], -b)), speedup


def choose(model, drafter, lookup: bool = True, batch: int = 1) -> tuple[int, dict]:
    """(budget, statistics) for budget="auto" at a batch of `batch` rows (timed at batch_bucket(batch))."""
    table = drafter.acceptance
    if not table:
        return drafter.config.block_size - 1, {"budget_source": "default (the drafter ships no acceptance.json)"}
    c = costs(model, drafter, table, lookup, batch_bucket(batch))
    b, speedup = best_budget(table, c["ar_step_s"], c["round_s"])
    return b, {"budget_source": "auto", "predicted_speedup": {str(k): round(v, 3) for k, v in sorted(speedup.items())}}
