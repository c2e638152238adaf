"""`jaxspec.generate`: input checks, prompt layout, the streaming driver and the statistics around the
jitted loops of `engine.py`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import engine
from jaxspec.budget import choose as choose_budget
from jaxspec.drafter import Drafter, check_fits
from jaxspec.model import Model
from jaxspec.sampling import SamplingParams
from jaxspec.sharding import to_host
from pallas_kernels.kv_commit import effective_impl

METHODS = ("ar", "dflash", "ddtree")
MAX_BUDGET = 1024


@dataclass
class GenerationResult:
    token_ids: list  # list[int] for one prompt, list[list[int]] for a batch
    text: Any  # str / list[str], or None without a tokenizer
    stats: dict = field(default_factory=dict)


def round_up(n: int, m: int) -> int:
    """The multiple of m at or above n (at least m): buffer sizes from a few compiled shapes."""
    return max(m, -(-n // m) * m)


def left_pad(rows: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts -> tokens [B, width] with every row's last token at slot width - 1, and each row's first real
    slot [B] (the engine's `start`)."""
    tokens = np.zeros((len(rows), width), np.int32)
    for b, r in enumerate(rows):
        tokens[b, width - len(r):] = r
    return tokens, np.array([width - len(r) for r in rows], np.int32)


def encode_prompt(model: Model, prompt, chat: bool | None) -> list[int]:
    tok = model.tokenizer
    if tok is None:
        raise ValueError("this model has no tokenizer; pass input_ids instead of a prompt")
    if chat is None:
        chat = bool(getattr(tok, "chat_template", None))
    if chat:
        if not getattr(tok, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; run without chat mode")
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return tok.encode(prompt)


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
    for r in rows:
        if not r:
            raise ValueError("empty prompt: give at least one token")
        if min(r) < 0 or max(r) >= V:
            raise ValueError(f"token ids must lie in [0, {V})")
    return single, rows


def generate(model: Model, prompt=None, *, input_ids=None, drafter: Drafter | None = None, method: str = "auto",
             budget: int | str | None = None, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, chat: bool | None = None,
             on_tokens: Callable[[list[int]], None] | None = None, chunk_tokens: int = 16,
             kv_impl: str = "xla", lookup: bool = True) -> GenerationResult:
    """Generate from `prompt` (str or list of str) or `input_ids` (list[int] or [B, T]).

    method: "ar", "dflash" or "ddtree" ("auto": ddtree when a drafter is given). Speculative methods are
    lossless: greedy output equals AR greedy token for token; sampled output has the target's distribution.
    on_tokens(new_ids) streams a single prompt's tokens, read back every `chunk_tokens` tokens.
    kv_impl: the KV commit of speculative rounds, "xla" or "pallas"; stats["kv_commit"] says what ran.
    lookup: speculative rounds also consider the tokens that followed the context's last few tokens where they
    occurred before (prompt lookup, jaxspec.lookup); they compete with the drafter's for the same tree nodes, so
    the verify costs the same. False drafts from the drafter alone.
    """
    sampling = SamplingParams(float(temperature), int(top_k), float(top_p))
    method, budget = resolve_method(method, drafter, budget)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if on_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, (int, np.integer))
                                  or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be a positive integer when streaming, got {chunk_tokens!r}")
    kv_commit = effective_impl(kv_impl)
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
    eos = model.eos_token_ids or (-1,)
    key = jax.random.key(seed)
    stats: dict[str, Any] = {"method": method, "prompt_tokens": [len(r) for r in rows]}
    t0 = time.perf_counter()

    if method == "ar":
        B, P = len(rows), round_up(longest, 64)
        tokens, start = left_pad(rows, P)
        full = round_up(P + max_new_tokens, 256)
        window = ar_window(model, B, full)
        state = engine.ar_prefill(model.jit_def, model.params, jnp.asarray(tokens), jnp.asarray(start), key,
                                  jnp.int32(max_new_tokens), max_len=min(full, P + window),
                                  out_len=round_up(max_new_tokens, 64), sampling=sampling, eos=eos,
                                  layout=model.layout)
        count = lambda s: int(to_host(s.steps))  # noqa: E731

        def step(s, stop):
            """Decode to `stop` tokens, growing the cache by windows: token n is written at slot P + n - 1."""
            while True:
                room = s.cache.max_len - P + 1
                s = engine.ar_decode(model.jit_def, model.params, s, jnp.int32(min(stop, room)), sampling=sampling,
                                     eos=eos, layout=model.layout)
                if s.cache.max_len == full or count(s) >= stop or bool(np.all(to_host(s.done))):
                    return s
                s = engine.ar_reslot(s, jnp.int32(0), max_len=min(full, s.cache.max_len + window), layout=model.layout)
    else:
        if len(rows) != 1:
            raise ValueError("speculative decoding runs one prompt at a time; use method='ar' for batches")
        check_fits(drafter.config, model)
        check_placement(drafter, model)
        dc = drafter.config
        if budget == "auto":
            budget, chosen = choose_budget(model, drafter, lookup)
            stats.update(chosen)
            t0 = time.perf_counter()  # a first-time cost measurement is not prefill
        settings = engine.SpecSettings(method, budget, dc.block_size, dc.target_layer_ids, sampling, eos, kv_impl,
                                       model.layout, drafter.layout, bool(lookup))
        (r,) = rows
        P = round_up(len(r), 64)
        tokens = np.zeros((1, P), np.int32)  # right-padded; the forward is told the real length
        tokens[0, : len(r)] = r
        # The last round starts at L <= len + max_new - 2 and writes 1 + budget tree slots (target) and
        # round_tokens <= max(1 + budget, block_size) context rows (drafter) from there: scratch slots past the
        # context length are fine.
        max_len = round_up(max(P, len(r) + max_new_tokens + settings.nodes + dc.block_size), 256)
        out_len = round_up(max_new_tokens, 64) + settings.round_tokens
        state = engine.spec_prefill(model.jit_def, model.params, drafter.jit_def, drafter.params,
                                    jnp.asarray(tokens), jnp.int32(len(r)), key, jnp.int32(max_new_tokens),
                                    max_len=max_len, out_len=out_len, settings=settings)
        step = lambda s, stop: engine.spec_decode(model.jit_def, model.params, drafter.jit_def,  # noqa: E731
                                                  drafter.params, s, jnp.int32(stop), settings=settings)
        count = lambda s: int(to_host(s.emitted))  # noqa: E731

    state = step(state, count(state))  # compiles the decode loop without running a step
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    if on_tokens is not None:
        shown = count(state)
        on_tokens(to_host(state.out).reshape(-1)[:shown].tolist())
        while not bool(np.all(to_host(state.done))):
            state = step(state, count(state) + chunk_tokens)
            n = count(state)
            on_tokens(to_host(state.out).reshape(-1)[shown:n].tolist())
            shown = n
    else:
        state = step(state, max_new_tokens)
    jax.block_until_ready(state)
    t2 = time.perf_counter()

    out = to_host(state.out)
    if method == "ar":
        n = to_host(state.emitted)
        ids = [out[b, : n[b]].tolist() for b in range(out.shape[0])]
        forwards = int(to_host(state.steps))
        stats["acceptance_length"] = 1.0
    else:
        ids = [out[: int(to_host(state.emitted))].tolist()]
        rounds = int(to_host(state.rounds))
        forwards = rounds + 1
        stats.update(spec_stats(to_host(state.accepted_hist), rounds, len(ids[0]), budget, int(to_host(state.tree_nodes))),
                     kv_commit=kv_commit, lookup=settings.lookup)
    new_tokens = sum(map(len, ids))
    decode_tokens = new_tokens - len(ids)  # the first token of each row comes from the prefill
    stats.update(
        new_tokens=new_tokens,
        steps=forwards,  # target forwards, the prefill included
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        tokens_per_second=decode_tokens / (t2 - t1) if t2 > t1 else 0.0,
    )
    tok = model.tokenizer
    texts = [tok.decode(i, skip_special_tokens=True) for i in ids] if tok is not None else None
    if single:
        return GenerationResult(ids[0], texts[0] if texts else None, stats)
    return GenerationResult(ids, texts, stats)


def ar_window(model: Model, batch: int, max_len: int) -> int:
    """Cache slots a batched AR decode grows by (max_len: no growth).

    Attention reads every slot of the cache each step. At batch 1 the full buffer is small next to the weights
    and one compile is worth more; in a batch it is not (SmolLM2 at batch 64: 755 MB of K/V at 256 slots
    against 538 MB of weights), so the cache starts with the prompt and grows by 64 slots (one compile per
    window size, reused across batches)."""
    cache = jax.eval_shape(lambda: model.module.init_cache(batch, max_len))
    kv_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    return 64 if kv_bytes > weight_bytes / 8 else max_len


def check_placement(drafter: Drafter, model: Model) -> None:
    """Drafter and target must live on the same devices (the drafter is placed when loaded for a model)."""
    mesh = lambda h: None if h.layout is None else h.layout.mesh  # noqa: E731
    if drafter.layout is not None and mesh(drafter) != mesh(model) or \
            drafter.layout is None and model.layout is not None and jax.tree.leaves(drafter.params):
        raise ValueError("the drafter and the target are on different devices; load or init the drafter after "
                         "sharding the target (jaxspec.load_drafter(path, model) places it on the model's mesh)")


def spec_stats(hist: np.ndarray, rounds: int, emitted: int, budget: int, tree_nodes: int) -> dict:
    """Acceptance statistics of a speculative run.

    acceptance_length counts the tokens really emitted per round (EOS or max_new_tokens may cut the last
    round short of its k + 1); the histogram and per-depth rates describe what verification accepted.
    """
    reached = np.array([hist[d:].sum() for d in range(len(hist))])  # rounds that accepted >= d drafts
    return dict(
        rounds=rounds,
        budget=budget,
        acceptance_length=float((emitted - 1) / rounds) if rounds else 0.0,
        accepted_length_histogram=hist.tolist(),
        per_depth_acceptance=[float(reached[d] / reached[d - 1]) if reached[d - 1] else 0.0 for d in range(1, len(hist))],
        budget_utilisation=float(tree_nodes / max(rounds * budget, 1)),
    )
