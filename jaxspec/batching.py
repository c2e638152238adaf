"""Continuous batching: many prompts through one batch of AR decode slots, a new prompt entering a slot as
soon as its answer ends.

`generate(input_ids=[...], method="ar")` decodes a batch in lockstep, so every row pays for the longest
answer; self-distillation answers average well under half the 256-token cap, so most of a lockstep batch's
work is spent on finished rows. Here the host decodes `chunk` steps at a time, collects finished rows and
prefills waiting prompts into them (`Decoder.refill`): each prompt is placed so that it ends where the
other rows' tokens end, and the cache slides its live rows to the front when it runs out of slots
(`Decoder.make_room`), so one fixed-size buffer (`Decoder.slots_for_queue`) serves the whole run.

Every row decodes exactly as it would alone: its own positions, its own slots, the rest masked. Greedy
answers therefore equal `generate`'s; sampled ones are draws from the same distributions.
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Callable

import jax
import jax.numpy as jnp

from jaxspec.decoder import Decoder
from jaxspec.model import Model
from jaxspec.sampling import SamplingParams
from jaxspec.sharding import to_host


def generate_many(model: Model, input_ids: list[list[int]], max_new_tokens: int | list[int], *, batch: int = 64,
                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, chunk: int = 16,
                  on_done: Callable[[int], None] | None = None) -> list[list[int]]:
    """The target's answers (token ids, EOS included when sampled) to every prompt in `input_ids`, in order.

    max_new_tokens: one limit, or one per prompt. batch: decode slots. chunk: steps between refills (shorter
    wastes fewer finished-row steps, longer reads back less often). on_done(n) is called with the number of
    answers finished so far."""
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
    dec = Decoder(model, sampling=sampling)
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

    run = dec.prefill([input_ids[i] for i in range(B)], limits[:B], jax.random.key(seed), max_len=max_len,
                      out_len=chunk)
    for b, t in enumerate(to_host(run.state.out)[:, 0].tolist()):
        start_row(b, b, t)

    while any(o is not None for o in owner) or waiting:
        free = [b for b in range(B) if owner[b] is None]
        take = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
        if take:
            first = dec.refill(run, free[: len(take)], [input_ids[i] for i in take], [limits[i] for i in take])
            for b, i, t in zip(free, take, first):
                start_row(b, i, t)
        live = [b for b in range(B) if owner[b] is not None]
        if not live:
            continue
        dec.make_room(run, live, chunk)
        run.state = replace(run.state, steps=jnp.int32(0))  # a chunk counts its own steps
        before = to_host(run.state.emitted)
        run = dec.decode(run, chunk)
        out, emitted, done = to_host(run.state.out), to_host(run.state.emitted), to_host(run.state.done)
        for b in live:
            partial[b] += out[b, : emitted[b] - before[b]].tolist()
            if done[b]:
                finish(b)
    return answers
