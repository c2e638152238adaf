"""Continuous batching: many prompts through one batch of decode slots (AR or speculative), a new prompt entering
a slot as soon as its answer ends.

`generate(input_ids=[...], method="ar")` decodes a batch in lockstep, so every row pays for the longest
answer; self-distillation answers average well under half the 256-token cap, so most of a lockstep batch's
work is spent on finished rows. Here the host decodes `chunk` steps at a time, collects finished rows and
prefills waiting prompts into them (`Decoder.refill`). AR rows move in lockstep: each prompt is placed so that
it ends where the other rows' tokens end, and the cache slides its live rows to the front when it runs out of
slots (`Decoder.make_room`), so one fixed-size buffer (`Decoder.slots_for_queue`) serves the whole run.
Speculative rows each own their length: a new prompt starts at slot 0 of its row, and the buffer is sized for
the longest prompt and answer in the queue. Either way one compiled decode program serves the whole queue.

Every row decodes exactly as it would alone: its own positions, its own slots, the rest masked. Greedy
answers therefore equal `generate`'s; sampled ones are draws from the same distributions.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import jax

from jaxspec.decoder import Decoder, round_up
from jaxspec.drafter import Drafter
from jaxspec.model import Model
from jaxspec.sampling import SamplingParams
from jaxspec.sharding import to_host


def generate_many(model: Model, input_ids: list[list[int]], max_new_tokens: int | list[int], *, batch: int = 64,
                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, chunk: int = 16,
                  on_done: Callable[[int], None] | None = None, drafter: Drafter | None = None, method: str = "ar",
                  budget: int | None = None, lookup: bool = True) -> list[list[int]]:
    """The target's answers (token ids, EOS included when sampled) to every prompt in `input_ids`, in order.

    max_new_tokens: one limit, or one per prompt. batch: decode slots. chunk: tokens per row between refills
    (shorter wastes fewer finished-row steps, longer reads back less often). on_done(n) is called with the number
    of answers finished so far. method "dflash" / "ddtree" with a drafter (budget: ddtree's tree size, default
    block_size - 1) decodes every slot speculatively."""
    n = len(input_ids)
    limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != n:
        raise ValueError(f"{len(limits)} max_new_tokens for {n} prompts")
    if batch < 1 or chunk < 1:
        raise ValueError("batch and chunk must be >= 1")
    ctx = model.config.max_position_embeddings
    for i, (r, m) in enumerate(zip(input_ids, limits)):
        if not r or m < 1:
            raise ValueError(f"prompt {i}: needs at least one token and max_new_tokens >= 1")
        if len(r) + m > ctx:
            raise ValueError(f"prompt {i} ({len(r)} tokens) + max_new_tokens ({m}) exceeds the model's context of "
                             f"{ctx} tokens; shorten the prompt or lower max_new_tokens")
    if n == 0:
        return []
    B = min(batch, n)
    sampling = SamplingParams(float(temperature), int(top_k), float(top_p))
    if method != "ar":
        if drafter is None:
            raise ValueError(f"method={method!r} needs a drafter")
        budget = budget if method == "ddtree" and budget is not None else drafter.config.block_size - 1
    dec = Decoder(model, drafter, method=method, budget=budget, sampling=sampling, lookup=lookup)
    if method != "ar":
        return _spec_many(dec, input_ids, limits, B, seed, chunk, on_done)
    eos_set = set(dec.eos)
    max_len = Decoder.slots_for_queue(input_ids, limits, chunk)

    answers: list[list[int] | None] = [None] * n
    owner: list[int | None] = [None] * B  # prompt index decoding in each slot
    partial: list[list[int]] = [[] for _ in range(B)]
    waiting = deque(range(B, n))
    finished = 0

    def finish(b: int) -> None:
        nonlocal finished
        answers[owner[b]], owner[b] = partial[b], None
        finished += 1
        if on_done is not None:
            on_done(finished)

    def start_row(b: int, i: int, first: int) -> None:
        owner[b], partial[b] = i, [first]
        if first in eos_set or limits[i] <= 1:
            finish(b)

    key, refills = jax.random.key(seed), 0
    run = dec.prefill([input_ids[i] for i in range(B)], limits[:B], key, max_len=max_len, out_len=chunk)
    for b, t in enumerate(to_host(run.state.out)[:, 0].tolist()):
        start_row(b, b, t)

    while any(o is not None for o in owner) or waiting:
        free = [b for b in range(B) if owner[b] is None]
        take = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
        if take:
            refills += 1  # each refill's rows get streams of their own
            first = dec.refill(run, free[: len(take)], [input_ids[i] for i in take], [limits[i] for i in take],
                               jax.random.fold_in(key, refills))
            for b, i, t in zip(free, take, first):
                start_row(b, i, t)
        live = [b for b in range(B) if owner[b] is not None]
        if not live:
            continue
        dec.make_room(run, live, chunk)
        dec.start_chunk(run)
        before = to_host(run.state.emitted)
        run = dec.decode(run, chunk)
        out, emitted, done = to_host(run.state.out), to_host(run.state.emitted), to_host(run.state.done)
        for b in live:
            partial[b] += out[b, : emitted[b] - before[b]].tolist()
            if done[b]:
                finish(b)
    return answers


def _spec_many(dec: Decoder, prompts: list[list[int]], limits: list[int], B: int, seed: int, chunk: int,
               on_done) -> list[list[int]]:
    """generate_many's speculative loop: rows keep their whole answer in the state until they finish."""
    max_len = dec.spec_max_len(max(map(len, prompts)), max(limits))
    out_len = round_up(max(limits), 64) + dec.settings.round_tokens
    answers: list[list[int] | None] = [None] * len(prompts)
    owner: list[int | None] = list(range(B))
    waiting = deque(range(B, len(prompts)))
    key = jax.random.key(seed)
    run = dec.prefill(prompts[:B], limits[:B], key, max_len=max_len, out_len=out_len)
    refills = 0
    while True:
        done = to_host(run.state.done)
        finished = [b for b in range(B) if owner[b] is not None and done[b]]
        if finished:
            rows = dec.tokens(run)
            for b in finished:
                answers[owner[b]], owner[b] = rows[b], None
                if on_done is not None:
                    on_done(sum(a is not None for a in answers))
        free = [b for b in range(B) if owner[b] is None]
        take = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
        if take:
            refills += 1
            dec.refill(run, free[: len(take)], [prompts[i] for i in take], [limits[i] for i in take],
                       jax.random.fold_in(key, refills))
            for b, i in zip(free, take):
                owner[b] = i
            continue  # a refilled row may be done already (EOS first, or a limit of 1)
        if all(o is None for o in owner):
            return answers
        run = dec.decode(run, dec.count(run) + chunk, live=[b for b in range(B) if owner[b] is not None])
