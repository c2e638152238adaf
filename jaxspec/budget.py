"""`budget="auto"`: the DDTree budget with the most tokens per second on this machine.

A round with budget b emits AL(b) tokens per row on average and costs round(b) seconds (one draft, one verify
forward of 1 + b nodes per row and the bookkeeping around them), so its rate over AR is AL(b) x ar_step /
round(b), both timed at the batch size that runs. The factors come from different places:

  * AL(b) belongs to the drafter and its target: measured on held-out prompts and shipped beside the weights
    as `acceptance.json` (`bench/spec.py --save-acceptance` writes it);
  * the costs belong to the machine and the batch: an AR step and a round per budget are timed here in the
    decode loops themselves, per (target, drafter, backend, machine, batch size rounded up to a power of two;
    see _key), and kept in the user's cache directory (`costs.json`; in this process's memory alone where that
    cannot be written): every budget by the first run, the few that could be the best by the next runs, until
    COST_SAMPLES processes have timed them, and their median decides (see `costs`). A batch's verify reads the
    weights once for B x (1 + b) nodes, so where a larger tree is nearly free at batch 1 it is not at batch 16:
    the best budget falls as the batch grows.

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
# 5: the decode loops are waited for (4 and before timed their dispatch alone), a batch's AR in one buffer;
# 6: an entry holds the timings of up to COST_SAMPLES processes (`samples`), each with its rounds' spread
COST_FORMAT = 6
COST_REPS = 4  # measure_costs' passes over the budgets for the stored table
# Processes whose timings an entry keeps; the costs are their median. One process's timing moves with the spell of
# the machine's speed it ran in: two identical first runs once chose budgets 8 and 4 from one timing each.
COST_SAMPLES = 3
# The least relative noise of a round's timing (a round as a multiple of the AR step): timings of one budget that
# differ by less agree, whatever spread their chunks showed. Runs on the 2-core VM put a round within 2-9% of
# another run's (docs/design/budget.md).
COST_NOISE = 0.05
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
    budget after another, a slow spell can fall on one budget alone and mislead `auto`; docs/design/budget.md).
    Also returns each round's `spread`: the half-range of its chunks' ratios over their median, the noise of
    this timing (`costs` compares another process's timing with it)."""
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
    return dict(ar_step_s=ar_s, round_s={b: statistics.median(r) * ar_s for b, r in ratios.items()},
                spread={b: (max(r) - min(r)) / (2 * statistics.median(r)) for b, r in ratios.items()})


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


def _valid_sample(sample) -> dict | None:
    """One process's stored timing as {ar_step_s, round_s: {budget: s}, spread: {budget: relative}, reps,
    measured}, or None where it cannot be believed: missing fields, non-numbers, zero, negative or non-finite
    seconds, an empty round table, a round without a finite spread >= 0, or a round under a twentieth of an AR
    step (a round runs the target's forward over 1 + b tokens and the drafter's as well, so no real timing
    comes near that, while on a tiny target a round can time under half an AR step; a 1e-9 s round would make
    `auto` pick the largest budget). `reps` and `measured` (its passes and date) are kept as written, for a
    later format to decide which samples to trust."""
    if not isinstance(sample, dict):
        return None
    ar = _seconds(sample.get("ar_step_s"))
    rounds, spread = sample.get("round_s"), sample.get("spread")
    if ar is None or not isinstance(rounds, dict) or not rounds or not isinstance(spread, dict):
        return None
    out = dict(ar_step_s=ar, round_s={}, spread={}, reps=sample.get("reps"), measured=sample.get("measured"))
    for b, s in rounds.items():
        try:
            b = int(b)
        except (TypeError, ValueError):
            return None
        s, noise = _seconds(s), spread.get(str(b))
        if b < 1 or s is None or s < ar / 20 or isinstance(noise, bool) or not isinstance(noise, (int, float)) \
                or not 0 <= noise < math.inf:
            return None
        out["round_s"][b], out["spread"][b] = s, float(noise)
    return out


def _valid_entry(entry) -> dict | None:
    """A stored cost entry as {samples: [sample, ...], retimed}, or None where it is not one this version wrote
    (another format, no list of samples) or any of its samples cannot be believed (_valid_sample)."""
    if not isinstance(entry, dict) or entry.get("format") != COST_FORMAT:
        return None
    samples = entry.get("samples")
    if not isinstance(samples, list) or not samples:
        return None
    samples = [_valid_sample(s) for s in samples]
    return None if None in samples else dict(samples=samples, retimed=entry.get("retimed") is True)


def _on_disk(entry: dict) -> dict:
    """An entry as costs.json holds it (JSON's keys are strings)."""
    strings = lambda d: {str(b): x for b, x in d.items()}  # noqa: E731
    return dict(format=COST_FORMAT, retimed=entry["retimed"], samples=[
        dict(s, round_s=strings(s["round_s"]), spread=strings(s["spread"])) for s in entry["samples"]])


def _usable(stored, acceptance: dict[int, float]) -> dict | None:
    """A stored entry (_valid_entry) if valid and timed at budgets of the acceptance table alone, else None."""
    entry = _valid_entry(stored)
    if entry is None or not {b for s in entry["samples"] for b in s["round_s"]} <= set(acceptance):
        return None
    return entry


def _ratios(sample: dict) -> dict[int, float]:
    """A sample's rounds in AR steps: what the choice depends on (AL(b) x ar_step / round(b)), and steadier than
    the seconds, which move with the spell a process ran in."""
    return {b: s / sample["ar_step_s"] for b, s in sample["round_s"].items()}


def _median_costs(entry: dict) -> dict:
    """The costs an entry stands for ({ar_step_s, round_s: {budget: s}}): its samples' median AR step, and per
    budget the median of their rounds in AR steps, times that step."""
    samples = entry["samples"]
    ar = statistics.median(s["ar_step_s"] for s in samples)
    budgets = sorted({b for s in samples for b in s["round_s"]})
    return dict(ar_step_s=ar, round_s={b: statistics.median(_ratios(s)[b] for s in samples if b in s["round_s"]) * ar
                                       for b in budgets})


def _spread(samples: list[dict], b: int) -> float:
    """The noise of one process's timing of budget b's round: the largest spread its chunks showed in any of
    `samples`, at least COST_NOISE."""
    return max(COST_NOISE, *(s["spread"][b] for s in samples if b in s["spread"]))


def _contenders(acceptance: dict[int, float], entry: dict) -> list[int]:
    """The budgets a fresh timing could make the best: those whose rate AL(b) / round(b) comes within their noise
    and the best budget's of the best rate, the noise being a process's spread or the half-range of the stored
    processes' timings, whichever is larger."""
    def noise(b):
        rs = [_ratios(s)[b] for s in entry["samples"] if b in s["round_s"]]
        return max(_spread(entry["samples"], b), (max(rs) - min(rs)) / (max(rs) + min(rs)))

    rate = {b: acceptance[b] / s for b, s in _median_costs(entry)["round_s"].items()}
    best = max(rate, key=rate.get)
    return sorted(b for b in rate if rate[b] * (1 + noise(b) + noise(best)) >= rate[best])


def _agrees(entry: dict, fresh: dict) -> bool:
    """Whether every round of a fresh sample lies within the range of the entry's samples, widened by the noise of
    a process's timing (_spread, of the fresh sample or a stored one)."""
    for b, r in _ratios(fresh).items():
        rs = [_ratios(s)[b] for s in entry["samples"] if b in s["round_s"]]
        noise = _spread([*entry["samples"], fresh], b)
        if not min(rs) * (1 - noise) <= r <= max(rs) * (1 + noise):
            return False
    return True


def _joined(entry: dict, fresh: dict) -> dict:
    """The entry with a fresh sample added, unless it holds COST_SAMPLES already (a concurrent run added one)."""
    return entry if len(entry["samples"]) >= COST_SAMPLES else dict(entry, samples=[*entry["samples"], fresh])


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


def _write_table(path: Path, key: str, update) -> dict:
    """Put update(the entry stored under `key` now, or None) under `key` in costs.json and return it: under a
    lock, the file as it is now (another process may have added its own entries, or a sample to this one,
    since it was read) with this entry, written to a temporary file and renamed over it, so concurrent runs
    keep each other's keys and samples and no reader ever sees half a file. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        known = _read_table(path, quiet=True)
        entry = update(known.get(key))
        known[key] = _on_disk(entry)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps(known, indent=1))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return entry


# Costs this process measured or read, by (costs.json path, key): where the cache cannot be written, a process
# still times once.
_measured: dict[tuple[str, str], dict] = {}


def costs(model, drafter, acceptance: dict[int, float], lookup: bool = True, batch: int = 1) -> dict:
    """measure_costs at `batch` rows (a power of two: batch_bucket) as the median of COST_SAMPLES processes'
    timings, kept in the user's cache or, where it cannot be written, for this process.

    One process's timing is only as good as the spell of the machine's speed it ran in, and timing every budget
    in every run would cost each run a compile per budget. So the first run times every budget and stores that
    as the entry's first sample; each later run, until the entry holds COST_SAMPLES samples, times only the
    budgets that could be the best within the noise (_contenders, typically two or three) and adds them as a
    sample; from then on runs read the entry without timing. A sample that disagrees with the stored ones
    (_agrees) says they were timed in an unusual spell (or on a machine that has changed since), so every budget
    is timed again and that replaces the entry; once only: should a later sample disagree too, the machine is
    noisier than its chunks show, and samples join whatever they say, for the median to decide."""
    path = cache_dir() / "costs.json"
    key = _key(model, drafter, acceptance, lookup, batch)
    if (str(path), key) in _measured:
        return _measured[str(path), key]
    entry = _usable(_read_table(path).get(key), acceptance)
    if entry is None or len(entry["samples"]) < COST_SAMPLES:
        entry = _time(model, drafter, acceptance, lookup, batch, path, key, entry)
    _measured[str(path), key] = c = _median_costs(entry)
    return c


def _time(model, drafter, acceptance, lookup, batch, path, key, entry) -> dict:
    """costs' timing: `entry` (None: none stored) with this process's sample, as written to `path` (or, where it
    cannot be written, as this process keeps it)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(path.parent, os.W_OK)
    except OSError:
        writable = False
    kept = (f"kept in {path}" if writable
            else f"{path.parent} cannot be written: kept for this process only, timed again by the next")
    at = f" and batch {batch}" if batch > 1 else ""

    def sample(budgets) -> dict:
        c = measure_costs(model, drafter, {b: acceptance[b] for b in budgets}, lookup, reps=COST_REPS, batch=batch)
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return dict(ar_step_s=c["ar_step_s"], round_s=c["round_s"], spread=c["spread"], reps=COST_REPS, measured=now)

    if entry is None:
        _log.warning("jaxspec: timing speculative rounds at budgets %s%s for budget='auto' (run 1 of the %d that "
                     "time them; %s)", sorted(acceptance), at, COST_SAMPLES, kept)
        fresh = sample(acceptance)
        join = lambda cur: dict(samples=[fresh], retimed=False) if cur is None else _joined(cur, fresh)  # noqa: E731
    else:
        budgets = _contenders(acceptance, entry)
        _log.warning("jaxspec: timing speculative rounds at budgets %s%s again for budget='auto' (run %d of the %d "
                     "that time them; %s)", budgets, at, len(entry["samples"]) + 1, COST_SAMPLES, kept)
        fresh = sample(budgets)
        if _agrees(entry, fresh) or entry["retimed"]:
            join = lambda cur: _joined(cur or entry, fresh)  # noqa: E731
        else:
            _log.warning("jaxspec: these timings disagree with the ones kept by more than their noise; timing every "
                         "budget again")
            new = dict(samples=[sample(acceptance)], retimed=True)
            join = lambda cur: new  # noqa: E731
    try:  # joined with what is stored when the lock is held: a concurrent run may have added a sample
        return _write_table(path, key, lambda stored: join(_usable(stored, acceptance)))
    except OSError as e:
        if writable:  # said "kept in" above
            _log.warning("jaxspec: could not save the budget costs to %s (%s); kept for this process only", path, e)
        return join(entry)


def best_budget(acceptance: dict[int, float], ar_step_s: float, round_s: dict[int, float]) -> tuple[int, dict]:
    """argmax_b AL(b) / round(b) over the timed budgets, or 0 where none is predicted faster than AR (a batch large
    enough that its verify no longer rides on the weights' reads); also the predicted speed-up over AR of each."""
    speedup = {b: acceptance[b] * ar_step_s / round_s[b] for b in round_s}
    best = max(speedup, key=lambda b: (speedup[b], -b))
    return (best if speedup[best] > 1 else 0), speedup


def choose(model, drafter, lookup: bool = True, batch: int = 1) -> tuple[int, dict]:
    """(budget, statistics) for budget="auto" at a batch of `batch` rows (timed at batch_bucket(batch)); budget 0:
    AR is faster at this batch size."""
    table = drafter.acceptance
    if not table:
        return drafter.config.block_size - 1, {"budget_source": "default (the drafter ships no acceptance.json)"}
    c = costs(model, drafter, table, lookup, batch_bucket(batch))
    b, speedup = best_budget(table, c["ar_step_s"], c["round_s"])
    source = "auto" if b else f"auto: AR (no budget is predicted faster at a batch of {batch_bucket(batch)})"
    return b, {"budget_source": source, "predicted_speedup": {str(k): round(v, 3) for k, v in sorted(speedup.items())}}
