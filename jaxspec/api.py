"""`jaxspec.generate`: input checks, then the decoder (jaxspec/decoder.py), streaming and the statistics."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np

from jaxspec.budget import choose as choose_budget
from jaxspec.decoder import Decoder, Stats
from jaxspec.drafter import MAX_BUDGET, Drafter, check_fits
from jaxspec.model import Model, encode_prompt
from jaxspec.sampling import SamplingParams
from pallas_kernels.kv_commit import effective_impl

METHODS = ("ar", "dflash", "ddtree")


@dataclass
class GenerationResult:
    token_ids: list  # list[int] for one prompt, list[list[int]] for a batch
    text: Any  # str / list[str], or None without a tokenizer
    stats: Stats | dict = field(default_factory=dict)  # decoder.Stats (reads as a dict too)


def resolve_method(method: str, drafter: Drafter | None, budget: int | None) -> tuple[str, int | None]:
    if method == "auto":
        method = "ddtree" if drafter is not None else "ar"
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use one of: auto, {', '.join(METHODS)}")
    if method == "ar":
        if budget is not None:
            raise ValueError("budget applies to method ddtree only")
        return method, None
    if drafter is None:
        raise ValueError(f"method {method!r} needs a drafter (--drafter DIR, or jaxspec.init_drafter for a random one)")
    if method == "dflash":
        if budget is not None:
            raise ValueError("budget applies to method ddtree only; dflash verifies a chain of block_size - 1 tokens")
        return method, drafter.config.block_size - 1
    if budget == "auto":
        return method, budget
    budget = drafter.config.block_size - 1 if budget is None else budget
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget must be an integer in [1, {MAX_BUDGET}] or 'auto', got {budget!r}")
    return method, int(budget)


def prompt_rows(model: Model, prompt, input_ids, chat) -> tuple[bool, list[list[int]]]:
    """(single prompt?, token rows) from a prompt (str or list of str) or input_ids ([T] or [B, T])."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("pass exactly one of prompt or input_ids")
    if prompt is not None:
        single = isinstance(prompt, str)
        rows = [encode_prompt(model, p, chat) for p in ([prompt] if single else list(prompt))]
    elif isinstance(input_ids, (list, tuple)) and input_ids and not np.isscalar(input_ids[0]):
        single, rows = False, [[int(t) for t in r] for r in input_ids]
    else:
        arr = np.asarray(input_ids)
        if arr.ndim not in (1, 2):
            raise ValueError(f"input_ids must be [T] or [B, T], got shape {arr.shape}")
        single, rows = arr.ndim == 1, [r.tolist() for r in np.atleast_2d(arr)]
    V = model.config.vocab_size
    if not rows:
        raise ValueError("no prompts: give at least one")
    where = (lambda b: "") if single else (lambda b: f" (row {b} of the batch)")  # noqa: E731
    for b, r in enumerate(rows):
        if not r:
            raise ValueError(f"empty prompt{where(b)}: give at least one token")
        if min(r) < 0 or max(r) >= V:
            raise ValueError(f"token ids must lie in [0, {V}){where(b)}")
    return single, rows


def generate(model: Model, prompt=None, *, input_ids=None, drafter: Drafter | None = None, method: str = "auto",
             budget: int | str | None = None, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, chat: bool | None = None,
             on_tokens: Callable[[list[int]], None] | None = None, chunk_tokens: int = 16,
             kv_impl: str = "xla", lookup: bool = True) -> GenerationResult:
    """Generate from `prompt` (str or list of str) or `input_ids` (list[int] or [B, T]).

    method: "ar", "dflash" or "ddtree" ("auto": ddtree when a drafter is given). Speculative methods are
    lossless: greedy output equals AR greedy token for token; sampled output has the target's distribution.
    A batch runs its rows together: AR in lockstep, speculative methods with one tree per row verified in one
    forward, each row accepting its own tokens.
    on_tokens(new_ids) streams a single prompt's tokens, read back every `chunk_tokens` tokens.
    kv_impl: the KV commit of speculative rounds, "xla" or "pallas"; stats["kv_commit"] says what ran.
    lookup: speculative rounds also consider the tokens that followed the context's last few tokens where they
    occurred before (prompt lookup, jaxspec.lookup); they compete with the drafter's for the same tree nodes, so
    the verify costs the same. False drafts from the drafter alone.
    res.stats is a `decoder.Stats`.
    """
    start = time.perf_counter()
    sampling = SamplingParams(float(temperature), int(top_k), float(top_p))
    method, budget = resolve_method(method, drafter, budget)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if on_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, (int, np.integer))
                                  or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be a positive integer when streaming, got {chunk_tokens!r}")
    effective_impl(kv_impl)  # an unknown name is refused here
    if not isinstance(lookup, (bool, np.bool_)):
        raise ValueError(f"lookup must be True or False, got {lookup!r}")
    if kv_impl != "xla" and model.layout is not None:
        raise ValueError(f"kv_impl={kv_impl!r} runs on one device; a sharded model commits with kv_impl='xla' "
                         "(the default), which XLA partitions with the cache")
    single, rows = prompt_rows(model, prompt, input_ids, chat)
    if on_tokens is not None and not single:
        raise ValueError("streaming (on_tokens) needs a single prompt, not a batch")
    ctx, longest = model.config.max_position_embeddings, max(map(len, rows))
    if longest + max_new_tokens > ctx:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
                         f"of {ctx} tokens; shorten the prompt or lower max_new_tokens")
    chosen = {}
    if method != "ar":
        check_fits(drafter.config, model)
        check_placement(drafter, model)
        if budget == "auto":
            budget, chosen = choose_budget(model, drafter, lookup, batch=len(rows))
            if budget == 0:  # no tree is predicted to beat AR at this batch size
                method, budget = "ar", None
    dec = Decoder(model, drafter, method=method, budget=budget, sampling=sampling, kv_impl=kv_impl, lookup=lookup)

    t0 = time.perf_counter()
    run = dec.prefill(rows, max_new_tokens, jax.random.key(seed))
    run.extra.update(chosen)
    run = dec.decode(run, dec.count(run))  # compiles the decode loop without running a step
    jax.block_until_ready(run.state)
    t1 = time.perf_counter()
    if on_tokens is not None:
        shown = dec.count(run)
        on_tokens(dec.tokens(run)[0][:shown])
        while not dec.finished(run):
            run = dec.decode(run, dec.count(run) + chunk_tokens)
            ids = dec.tokens(run)[0]
            on_tokens(ids[shown:])
            shown = len(ids)
    else:
        run = dec.decode(run, max_new_tokens)
    jax.block_until_ready(run.state)
    t2 = time.perf_counter()

    ids = dec.tokens(run)
    stats = dataclasses.replace(dec.stats(run, t1 - t0, t2 - t1), wall_s=time.perf_counter() - start)
    tok = model.tokenizer
    texts = [tok.decode(i, skip_special_tokens=True) for i in ids] if tok is not None else None
    if single:
        return GenerationResult(ids[0], texts[0] if texts else None, stats)
    return GenerationResult(ids, texts, stats)


def check_placement(drafter: Drafter, model: Model) -> None:
    """Drafter and target must live on the same devices (the drafter is placed when loaded for a model)."""
    mesh = lambda h: None if h.layout is None else h.layout.mesh  # noqa: E731
    if drafter.layout is not None and mesh(drafter) != mesh(model) or \
            drafter.layout is None and model.layout is not None and jax.tree.leaves(drafter.params):
        raise ValueError("the drafter and the target are on different devices; load or init the drafter after "
                         "sharding the target (jaxspec.load_drafter(path, model) places it on the model's mesh)")
