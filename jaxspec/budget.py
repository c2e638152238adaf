"""`budget="auto"`: the DDTree budget with the most tokens per second on this machine.

A round with budget b emits AL(b) tokens on average and costs round(b) seconds (one draft, one verify forward
of 1 + b nodes and the bookkeeping around them), so its rate over AR is AL(b) x ar_step / round(b). The
factors come from different places:

  * AL(b) belongs to the drafter and its target: measured on held-out prompts and shipped beside the weights
    as `acceptance.json` (`bench/spec.py --save-acceptance` writes it);
  * the costs belong to the machine: an AR step and a round per budget are timed here in the decode loops
    themselves, once per (target, drafter, backend), and kept in the user's cache directory.

The budget is the measured table's best entry. A drafter without a table keeps the plain default
(block_size - 1) and says so in the statistics.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels import cpu
from jaxspec.usercache import cache_dir

ACCEPTANCE_FILE = "acceptance.json"
COST_CONTEXT = 256  # twice the prompt the costs are timed after (a short chat turn)
COST_FORMAT = 3  # 1: isolated forwards; 2: decode loops after random tokens; 3: the same after COST_PROMPT
# What the rounds are timed after, where the model has a tokenizer: a user's question, so the rounds accept what
# they do in use. After random tokens SmolLM2 repeats itself and a budget-8 round accepted about 8 tokens (200
# tokens in 23 rounds, against 107 after this prompt), so a chunk of `tokens` was one round carrying a whole
# call's dispatch and read-back (2-4 ms): budget 8's round read 20.8 ms there and 17.8 ms here (the same ops,
# 18.2 ms, in a profile of both), and `auto` chose budget 4 where 8 decoded fastest in the same benchmark.
COST_PROMPT = ("I am planning a small vegetable garden behind my house. The plot gets about six hours of sun in the "
               "morning, the soil is heavy clay, and we often have dry spells in late summer. I would like to grow "
               "tomatoes, beans, lettuce and a few herbs, and I do not want to spend much money on tools or "
               "fertiliser. My neighbour says I should build raised beds, but my brother thinks I can simply dig in "
               "compost every spring. Which approach would you recommend for a beginner, how should I prepare the "
               "soil this autumn, and what should I plant first next year? Please explain your reasoning.")


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
    from jaxspec.api import encode_prompt

    return encode_prompt(model, COST_PROMPT, None)[-length:]


def measure_costs(model, drafter, acceptance: dict[int, float], lookup: bool = True, tokens: int = 8,
                  reps: int = 4) -> dict:
    """Seconds of one AR decode step and of one speculative round per budget of the `acceptance` table, timed
    inside the jitted decode loops `generate` runs, after a prompt of up to COST_CONTEXT // 2 tokens (cost_prompt).

    A round is everything `generate` pays for: the draft, the tree build (with `lookup`, the prompt lookup and
    its merge), the verify of 1 + b nodes, the acceptance walk and the commit; timing isolated forwards instead
    left the bookkeeping out and paid a dispatch per call. Each budget is first compiled and timed twice, in
    increasing order, stopping at the first budget whose round costs more than even the table's best acceptance
    length could repay at the best rate found so far (rounds only grow with the tree). Then `reps` - 2 passes go
    over every kept budget in turn, `tokens` tokens each, each chunk of rounds right after as many AR steps. A
    round costs the median of its chunks' ratios to the AR chunk before them, times the fastest AR step. A VM's
    speed moves in spells of seconds, and not by the same factor for AR steps and rounds (on the 2-core EPYC VM
    AR steps took 12 or 16 ms, budget-8 rounds 17 to 21): the ratio of two neighbouring chunks shares their
    spell, and interleaving gives every budget the same spells (timed one budget after another, a slow spell
    fell on budget 8 alone and made `auto` pick 4, which decoded 1.3x slower in the same benchmark run)."""
    from jaxspec import engine
    from jaxspec.api import round_up
    from jaxspec.sampling import SamplingParams

    dc = drafter.config
    ids = cost_prompt(model, COST_CONTEXT // 2)
    L = len(ids)
    chunks = max(reps, 2)  # timed chunks per budget
    key, greedy, no_eos = jax.random.key(0), SamplingParams(), (-1,)
    settings_of = {b: engine.SpecSettings("ddtree", b, dc.block_size, dc.target_layer_ids, greedy, no_eos,
                                          layout=model.layout, draft_layout=drafter.layout, lookup=lookup)
                   for b in acceptance}
    most = max(s.round_tokens for s in settings_of.values())  # a call of rounds may overshoot by one round
    ar_len, spec_len = chunks * tokens, (chunks + 1) * (tokens + most)
    prompt = jnp.asarray([ids], jnp.int32)

    def ar(s, n):  # decode n more tokens -> (state, target forwards made)
        steps = int(s.steps)
        s = engine.ar_decode(model.jit_def, model.params, s, jnp.int32(steps + n), sampling=greedy, eos=no_eos,
                             layout=model.layout)
        return s, int(s.steps) - steps

    def spec(s, n, settings):  # the same for DDTree rounds
        rounds = int(s.rounds)
        s = engine.spec_decode(model.jit_def, model.params, drafter.jit_def, drafter.params, s,
                               jnp.int32(int(s.emitted) + n), settings=settings)
        return s, int(s.rounds) - rounds

    def timed(decode, state):  # -> (state, seconds per forward)
        t = time.perf_counter()
        state, forwards = decode(state, tokens)
        return state, (time.perf_counter() - t) / forwards

    def sample(b):  # one chunk of budget b's rounds right after one AR chunk: their ratio, and the AR step
        ar_state, ar_t = timed(ar, states[b][0])
        spec_state, round_t = timed(decoders[b], states[b][1])
        states[b] = (ar_state, spec_state)
        ratios[b].append(round_t / ar_t)
        return ar_t

    ar0 = engine.ar_prefill(model.jit_def, model.params, prompt, jnp.zeros((1,), jnp.int32), key, jnp.int32(10**6),
                            max_len=round_up(L + ar_len, 256), out_len=ar_len + 1, sampling=greedy, eos=no_eos,
                            layout=model.layout)
    timed(ar, jax.tree.map(jnp.copy, ar0))  # compiles (decoding consumes a state: copies)
    # Per budget an AR state beside its round state, so both decode over contexts of the same length.
    ar_s, ratios, decoders, states, prefilled = float("inf"), {}, {}, {}, {}
    for b in sorted(acceptance):  # compile each budget and time it twice, while a larger one may still win
        settings = settings_of[b]
        max_len = round_up(L + spec_len + settings.nodes + dc.block_size, 256)  # as generate sizes it
        if max_len not in prefilled:  # the prefill does not depend on the budget: one per buffer size
            prefilled[max_len] = engine.spec_prefill(
                model.jit_def, model.params, drafter.jit_def, drafter.params, prompt, jnp.int32(L), key,
                jnp.int32(10**6), max_len=max_len, out_len=spec_len + 1, settings=settings)
        decoders[b] = functools.partial(spec, settings=settings)
        spec_state, _ = timed(decoders[b], jax.tree.map(jnp.copy, prefilled[max_len]))  # compiles
        states[b], ratios[b] = (jax.tree.map(jnp.copy, ar0), spec_state), []
        for _ in range(2):
            ar_s = min(ar_s, sample(b))
        if not larger_can_win(acceptance, {c: statistics.median(r) for c, r in ratios.items()}):
            break
    for _ in range(reps - 2):
        for b in decoders:
            ar_s = min(ar_s, sample(b))
    return dict(ar_step_s=ar_s, round_s={b: statistics.median(r) * ar_s for b, r in ratios.items()})


def larger_can_win(acceptance: dict[int, float], round_s: dict[int, float]) -> bool:
    """Whether a budget above the largest timed one could beat the best timed rate AL(b) / round(b): its round
    costs at least the largest timed one's, and its acceptance length is at most the table's largest."""
    best_rate = max(acceptance[b] / s for b, s in round_s.items())
    return max(acceptance.values()) / round_s[max(round_s)] >= best_rate


def _key(model, drafter, acceptance, lookup) -> str:
    dev = jax.devices()[0]
    params = [(str(x.shape), str(x.dtype)) for x in jax.tree.leaves(model.params)]
    kernels = (model.kernels, cpu.build_key() if model.kernels == "cpu" else None)
    parts = [model.config, drafter.config, params, dev.platform, getattr(dev, "device_kind", ""), jax.__version__,
             jax.device_count(), sorted(acceptance.items()), lookup, COST_CONTEXT, COST_FORMAT, kernels]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def costs(model, drafter, acceptance: dict[int, float], lookup: bool = True) -> dict:
    """measure_costs, remembered on disk (the cost of one compile per budget, paid once per machine)."""
    path = cache_dir() / "costs.json"
    key = _key(model, drafter, acceptance, lookup)
    try:
        known = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        known = {}
    if key in known:
        c = known[key]
        return dict(ar_step_s=c["ar_step_s"], round_s={int(b): s for b, s in c["round_s"].items()})
    logging.getLogger(__name__).warning(
        "jaxspec: timing speculative rounds at budgets %s for budget='auto' (once per machine; kept in %s)",
        sorted(acceptance), path)
    c = measure_costs(model, drafter, acceptance, lookup)
    known[key] = c
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: measure again next time
    return c


def best_budget(acceptance: dict[int, float], ar_step_s: float, round_s: dict[int, float]) -> tuple[int, dict]:
    """argmax_b AL(b) / round(b) over the timed budgets; also the predicted speed-up over AR of each."""
    speedup = {b: acceptance[b] * ar_step_s / round_s[b] for b in round_s}
    return max(speedup, key=lambda b: (speedup[b], -b)), speedup


def choose(model, drafter, lookup: bool = True) -> tuple[int, dict]:
    """(budget, statistics) for budget="auto"."""
    table = drafter.acceptance
    if not table:
        return drafter.config.block_size - 1, {"budget_source": "default (the drafter ships no acceptance.json)"}
    c = costs(model, drafter, table, lookup)
    b, speedup = best_budget(table, c["ar_step_s"], c["round_s"])
    return b, {"budget_source": "auto", "predicted_speedup": {str(k): round(v, 3) for k, v in sorted(speedup.items())}}
