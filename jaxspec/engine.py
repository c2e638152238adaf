"""Generation on device: AR decoding and speculative rounds (DFlash chain, DDTree), each one jitted step
looped by `lax.while_loop`, so there is no host round trip per token or per round.

One speculative round (batch 1, all static shapes):
  1. draft: drafter.draft_logits: [bonus, MASK x (B-1)] at L..L+B-1 over its context -> B-1 distributions
  2. tree:  build_tree (top-budget prefixes) or build_chain (DFlash) -> N = nodes + 1 with root = bonus
  3. verify: one target forward over the N nodes at positions L + depth with the ancestor mask
  4. accept: walk the tree along the target's argmax (or one target sample per node)
  5. commit: compact the accepted K/V slots, append the accepted taps to the drafter context, L += k + 1
The target is reached only through its forward (`module(tokens, positions, cache, visible, taps=)`,
returning logits, taps and a pending cache) and `commit_kv`; a new family brings its own cache type and
these two functions, not a new round.

Generation runs in chunks of rounds (all of it unless streaming), read back between chunks.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.cache import KVCache
from jaxspec.drafter import MAX_BLOCK_SIZE, Drafter, check_fits
from jaxspec.model import Model
from jaxspec.sampling import SamplingParams, sample
from jaxspec.tree import ancestor_mask, build_chain, build_tree
from jaxspec.verify import accept_walk, commit_kv, node_targets

METHODS = ("ar", "dflash", "ddtree")
MAX_BUDGET = 1024


@dataclass
class GenerationResult:
    token_ids: list  # list[int] for one prompt, list[list[int]] for a batch
    text: Any  # str / list[str], or None without a tokenizer
    stats: dict = field(default_factory=dict)


def _round_up(n: int, m: int) -> int:
    return max(m, -(-n // m) * m)


# ------------------------------------------------------------------------------------------ AR


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "out_len", "sp", "eos"))
def _ar_prefill(graphdef, params, tokens, start, key, max_new, *, max_len, out_len, sp, eos):
    """Left-padded prompts tokens [B, P] (row b starts at start[b]) -> decode state with the first token."""
    m = nnx.merge(graphdef, params)
    B, P = tokens.shape
    slot = jnp.arange(P)
    pos = jnp.maximum(slot[None, :] - start[:, None], 0)
    vis = (slot[None, None, :] <= slot[None, :, None]) & (slot[None, None, :] >= start[:, None, None])
    cache = m.init_cache(B, max_len)
    cache = KVCache(cache.k, cache.v, cache.length, start)
    logits, _, cache = m(tokens, pos, cache, vis, logits_idx=jnp.full((B, 1), P - 1))
    key, sub = jax.random.split(key)
    tok = sample(logits[:, 0], sub, sp)
    out = jnp.zeros((B, out_len), jnp.int32).at[:, 0].set(tok)
    done = jnp.isin(tok, jnp.asarray(eos, jnp.int32)) | (max_new <= 1)
    return dict(cache=cache.advance(P), last=tok, out=out, n=jnp.ones((B,), jnp.int32), t=jnp.int32(1),
                done=done, key=key, max_new=max_new, steps=jnp.int32(1))


@functools.partial(jax.jit, static_argnames=("graphdef", "sp", "eos"), donate_argnames=("state",))
def _ar_decode(graphdef, params, state, stop_at, *, sp, eos):
    """Decode until every row is done or `stop_at` tokens exist (a chunk boundary for streaming)."""
    m = nnx.merge(graphdef, params)
    eos_arr = jnp.asarray(eos, jnp.int32)

    def cond(s):
        return ~jnp.all(s["done"]) & (s["t"] < jnp.minimum(s["max_new"], stop_at))

    def body(s):
        cache = s["cache"]
        B = s["last"].shape[0]
        pos = (cache.length - cache.start)[:, None]
        logits, _, cache = m(s["last"][:, None], pos, cache, jnp.ones((B, 1, 1), bool))
        key, sub = jax.random.split(s["key"])
        tok = sample(logits[:, 0], sub, sp)
        live = ~s["done"]
        out = jax.lax.dynamic_update_slice(s["out"], jnp.where(live, tok, 0)[:, None], (0, s["t"]))
        done = s["done"] | jnp.isin(tok, eos_arr) | (s["t"] + 1 >= s["max_new"])
        return dict(s, cache=cache.advance(1), last=tok, out=out, n=s["n"] + live, t=s["t"] + 1, done=done,
                    key=key, steps=s["steps"] + 1)

    return jax.lax.while_loop(cond, body, state)


# ------------------------------------------------------------------------------------ speculative


@dataclass(frozen=True)
class SpecSettings:
    """Everything static about a speculative run (one compile per distinct value)."""

    method: str  # dflash | ddtree
    budget: int  # non-root tree nodes (dflash: block_size - 1)
    block_size: int
    taps: tuple[int, ...]
    sp: SamplingParams
    eos: tuple[int, ...]
    kv_impl: str = "xla"

    @property
    def depth(self) -> int:
        return self.block_size - 1


@functools.partial(jax.jit, static_argnames=("tg", "dg", "max_len", "out_len", "st"))
def _spec_prefill(tg, tp, dg, dp, tokens, length, key, max_new, *, max_len, out_len, st: SpecSettings):
    """Right-padded prompt tokens [1, P] (real length `length`) -> round state with the first bonus."""
    target, drafter = nnx.merge(tg, tp), nnx.merge(dg, dp)
    P = tokens.shape[1]
    pos = jnp.arange(P, dtype=jnp.int32)[None]
    causal = jnp.tril(jnp.ones((P, P), bool))[None]
    cache = target.init_cache(1, max_len)
    logits, taps, cache = target(tokens, pos, cache, causal, taps=st.taps, logits_idx=jnp.reshape(length - 1, (1, 1)))
    cache = KVCache(cache.k, cache.v, length, cache.start)
    dcache = drafter.append_context(drafter.init_cache(1, max_len), taps, length)
    key, sub = jax.random.split(key)
    bonus = sample(logits[0, 0], sub, st.sp)
    D = st.depth
    return dict(
        cache=cache, dcache=dcache, bonus=bonus, key=key, max_new=max_new,
        out=jnp.zeros((out_len,), jnp.int32).at[0].set(bonus), n=jnp.int32(1),
        done=jnp.isin(bonus, jnp.asarray(st.eos, jnp.int32)) | (max_new <= 1),
        rounds=jnp.int32(0), accepted_hist=jnp.zeros((D + 1,), jnp.int32), tree_nodes=jnp.int32(0),
    )


def spec_round(target, drafter, s, st: SpecSettings):
    """One speculative round on state `s` (see the module docstring). Returns the next state."""
    D = st.depth
    cache, L = s["cache"], s["cache"].length
    key, k_verify = jax.random.split(s["key"])
    # 1-2. draft and build the tree (root = bonus)
    draft = drafter.draft_logits(target, s["dcache"], s["bonus"], L)
    tree = build_tree(draft, st.budget) if st.method == "ddtree" else build_chain(draft)
    tokens = tree.tokens.at[0].set(s["bonus"])
    # 3. verify all nodes in one forward: node i at position L + depth_i, seeing prefix + its ancestors
    pos = (L - cache.start[0] + tree.depths)[None]
    logits, taps, pending = target(tokens[None], pos, cache, ancestor_mask(tree)[None], taps=st.taps)
    # 4. accept
    post = node_targets(logits[0], k_verify, st.sp)
    path, k = accept_walk(tree, post, D)
    # 5. commit target K/V and drafter context, emit [accepted drafts..., new bonus]
    cache = commit_kv(pending, path, k + 1, impl=st.kv_impl)
    dcache = drafter.append_context(s["dcache"], taps[0][path][None], k + 1)
    bonus = post[path[k]]
    i = jnp.arange(D + 1)
    emitted = jnp.where(i < k, tokens[path[jnp.minimum(i + 1, D)]], jnp.where(i == k, bonus, 0))
    is_eos = jnp.isin(emitted, jnp.asarray(st.eos, jnp.int32)) & (i <= k)
    n_emit = jnp.where(is_eos.any(), jnp.argmax(is_eos) + 1, k + 1)
    n = jnp.minimum(s["n"] + n_emit, s["max_new"])
    out = jax.lax.dynamic_update_slice(s["out"], emitted, (s["n"],))
    return dict(
        s, cache=cache, dcache=dcache, bonus=bonus, key=key, out=out, n=n,
        done=is_eos.any() | (n >= s["max_new"]), rounds=s["rounds"] + 1,
        accepted_hist=s["accepted_hist"].at[k].add(1), tree_nodes=s["tree_nodes"] + tree.valid.sum() - 1,
    )


@functools.partial(jax.jit, static_argnames=("tg", "dg", "st"), donate_argnames=("state",))
def _spec_decode(tg, tp, dg, dp, state, stop_at, *, st: SpecSettings):
    """Run rounds until done or until `stop_at` tokens exist (a chunk boundary for streaming)."""
    target, drafter = nnx.merge(tg, tp), nnx.merge(dg, dp)
    cond = lambda s: ~s["done"] & (s["n"] < stop_at)  # noqa: E731
    return jax.lax.while_loop(cond, lambda s: spec_round(target, drafter, s, st), state)


# ------------------------------------------------------------------------------------------ API


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
    budget = drafter.config.block_size - 1 if budget is None else budget
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget must be an integer in [1, {MAX_BUDGET}], got {budget!r}")
    return method, int(budget)


def generate(model: Model, prompt=None, *, input_ids=None, drafter: Drafter | None = None, method: str = "auto",
             budget: int | None = None, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, chat: bool | None = None,
             on_tokens: Callable[[list[int]], None] | None = None, chunk_tokens: int = 16,
             kv_impl: str = "xla") -> GenerationResult:
    """Generate from `prompt` (str or list of str) or `input_ids` (list[int] or [B, T]).

    method: "ar", "dflash" or "ddtree" ("auto": ddtree when a drafter is given). Speculative methods are
    lossless: greedy output equals AR greedy token for token; sampled output has the target's distribution.
    on_tokens(new_ids) streams a single prompt's tokens, read back every `chunk_tokens` tokens.
    """
    sp = SamplingParams(float(temperature), int(top_k), float(top_p))
    method, budget = resolve_method(method, drafter, budget)
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
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
    if on_tokens is not None and not single:
        raise ValueError("streaming (on_tokens) needs a single prompt, not a batch")
    V, ctx = model.config.vocab_size, model.config.max_position_embeddings
    for r in rows:
        if not r:
            raise ValueError("empty prompt: give at least one token")
        if min(r) < 0 or max(r) >= V:
            raise ValueError(f"token ids must lie in [0, {V})")
    longest = max(map(len, rows))
    slack = (budget + 1) if method != "ar" else 0
    if longest + max_new_tokens + slack > ctx:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of {ctx} "
            "tokens; shorten the prompt or lower max_new_tokens"
        )
    eos = model.eos_token_ids or (-1,)
    key = jax.random.key(seed)
    stats: dict[str, Any] = {"method": method, "prompt_tokens": [len(r) for r in rows]}
    t0 = time.perf_counter()

    if method == "ar":
        B = len(rows)
        P = _round_up(longest, 64)
        tokens = np.zeros((B, P), np.int32)
        start = np.array([P - len(r) for r in rows], np.int32)
        for b, r in enumerate(rows):
            tokens[b, P - len(r):] = r
        max_len = _round_up(P + max_new_tokens, 256)
        out_len = _round_up(max_new_tokens, 64)
        state = _ar_prefill(model.graphdef, model.params, jnp.asarray(tokens), jnp.asarray(start), key,
                            jnp.int32(max_new_tokens), max_len=max_len, out_len=out_len, sp=sp, eos=eos)
        step = lambda s, stop: _ar_decode(model.graphdef, model.params, s, jnp.int32(stop), sp=sp, eos=eos)  # noqa: E731
        count = lambda s: int(np.asarray(s["t"]))  # noqa: E731
    else:
        if len(rows) != 1:
            raise ValueError("speculative decoding runs one prompt at a time; use method='ar' for batches")
        check_fits(drafter.config, model)
        dc = drafter.config
        st = SpecSettings(method, budget, dc.block_size, dc.target_layer_ids, sp, eos, kv_impl)
        (r,) = rows
        P = _round_up(len(r), 64)
        tokens = np.zeros((1, P), np.int32)
        tokens[0, : len(r)] = r
        max_len = _round_up(max(P, len(r) + max_new_tokens + budget + dc.block_size), 256)
        out_len = _round_up(max_new_tokens, 64) + dc.block_size
        state = _spec_prefill(model.graphdef, model.params, drafter.graphdef, drafter.params, jnp.asarray(tokens),
                              jnp.int32(len(r)), key, jnp.int32(max_new_tokens), max_len=max_len, out_len=out_len, st=st)
        step = lambda s, stop: _spec_decode(model.graphdef, model.params, drafter.graphdef, drafter.params, s,  # noqa: E731
                                            jnp.int32(stop), st=st)
        count = lambda s: int(np.asarray(s["n"]))  # noqa: E731

    state = step(state, count(state))  # compiles the decode loop without running a step
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    emitted = 0
    if on_tokens is not None and single:
        emitted = count(state)
        on_tokens(np.asarray(state["out"]).reshape(-1)[:emitted].tolist())
        while not bool(np.all(np.asarray(state["done"]))):
            state = step(state, count(state) + chunk_tokens)
            n = count(state)
            on_tokens(np.asarray(state["out"]).reshape(-1)[emitted:n].tolist())
            emitted = n
    else:
        state = step(state, max_new_tokens)
    jax.block_until_ready(state)
    t2 = time.perf_counter()

    out = np.asarray(state["out"])
    if method == "ar":
        n = np.asarray(state["n"])
        ids = [out[b, : n[b]].tolist() for b in range(out.shape[0])]
        forwards = int(state["steps"])
        stats["acceptance_length"] = 1.0
    else:
        ids = [out[: int(state["n"])].tolist()]
        rounds = int(state["rounds"])
        forwards = rounds + 1
        hist = np.asarray(state["accepted_hist"])
        reached = np.array([hist[d:].sum() for d in range(len(hist))])  # rounds that accepted >= d drafts
        stats.update(
            rounds=rounds,
            budget=budget,
            acceptance_length=float((hist * np.arange(1, len(hist) + 1)).sum() / max(rounds, 1)),
            accepted_length_histogram=hist.tolist(),
            per_depth_acceptance=[float(reached[d] / reached[d - 1]) if reached[d - 1] else 0.0 for d in range(1, len(hist))],
            budget_utilisation=float(int(state["tree_nodes"]) / max(rounds * budget, 1)),
        )
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
