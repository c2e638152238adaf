"""Continuous batching: many prompts through one batch of AR decode slots, a new prompt entering a slot as
soon as its answer ends.

`generate(input_ids=[...], method="ar")` decodes a batch in lockstep, so every row pays for the longest
answer; self-distillation answers average well under half the 256-token cap, so most of a lockstep batch's
work is spent on finished rows. Here the host decodes `chunk` steps at a time, collects finished rows and
prefills waiting prompts into them (`engine.ar_refill`): each prompt is placed so that it ends where the
other rows' tokens end, and the cache slides its live rows to the front when it runs out of slots
(`engine.ar_reslot`), so one fixed-size buffer (and one compile) serves the whole run.

Every row decodes exactly as it would alone: its own positions, its own slots, the rest masked. Greedy
answers therefore equal `generate`'s; sampled ones are draws from the same distributions.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import replace
from typing import Callable

import jax
import jax.numpy as jnp

from jaxspec import engine
from jaxspec.decoder import left_pad, round_up
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
    eos = model.eos_token_ids or (-1,)
    eos_set = set(eos)
    kw = dict(sampling=sampling, eos=eos, layout=model.layout)
    # A row's prompt and answer never need more than `span` slots; a chunk past the newest token needs `chunk`.
    span = max(len(r) + m for r, m in zip(input_ids, limits))
    max_len = round_up(span + chunk, 32)  # attention reads every slot: no more than needed

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

    first_rows = [input_ids[i] for i in range(B)]
    P = round_up(max(map(len, first_rows)), 64)
    tokens, start = left_pad(first_rows, P)
    state = engine.ar_prefill(model.jit_def, model.params, jnp.asarray(tokens), jnp.asarray(start),
                              jax.random.key(seed), jnp.asarray(limits[:B], jnp.int32), max_len=max(max_len, P),
                              out_len=chunk, **kw)
    for b, t in enumerate(to_host(state.out)[:, 0].tolist()):
        start_row(b, b, t)
    state = replace(state, steps=jnp.int32(0))

    while any(o is not None for o in owner) or waiting:
        # refill free slots, a power-of-two group at a time (few distinct compiles)
        free = [b for b in range(B) if owner[b] is None]
        take = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
        if take:
            R = 1 << math.ceil(math.log2(len(take)))
            P = round_up(max(len(input_ids[i]) for i in take), 64)
            rows = free[: len(take)] + [B] * (R - len(take))  # index B: padding, dropped by ar_refill
            tokens, start = left_pad([input_ids[i] for i in take] + [input_ids[take[0]]] * (R - len(take)), P)
            length = int(to_host(state.cache.length))
            if length < P:  # the new prompts must end at `length`: slide everything right
                state = engine.ar_reslot(state, jnp.int32(length - P), max_len=state.cache.max_len, layout=model.layout)
            state, first = engine.ar_refill(model.jit_def, model.params, state, jnp.asarray(rows, jnp.int32),
                                            jnp.asarray(tokens), jnp.asarray(start),
                                            jnp.asarray([limits[i] for i in take] + [1] * (R - len(take)), jnp.int32),
                                            **kw)
            for b, i, t in zip(rows, take, to_host(first).tolist()):
                start_row(b, i, t)
        live = [b for b in range(B) if owner[b] is not None]
        if not live:
            continue
        # room for one chunk: slide the live rows' tokens to the front
        length = int(to_host(state.cache.length))
        if length + chunk > state.cache.max_len:
            shift = int(to_host(state.cache.start)[live].min())
            state = engine.ar_reslot(state, jnp.int32(shift), max_len=state.cache.max_len, layout=model.layout)
        before = to_host(state.emitted)
        state = engine.ar_decode(model.jit_def, model.params, state, jnp.int32(chunk), **kw)
        out, emitted, done = to_host(state.out), to_host(state.emitted), to_host(state.done)
        for b in live:
            partial[b] += out[b, : emitted[b] - before[b]].tolist()
            if done[b]:
                finish(b)
        state = replace(state, steps=jnp.int32(0))
    return answers
