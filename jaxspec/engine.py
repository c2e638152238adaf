"""Generation on device: AR decoding and speculative rounds (DFlash chain, DDTree), each one jitted step
looped by `lax.while_loop`, so there is no host round trip per token or per round.

One speculative round, for B rows at once (all static shapes; row b's committed length is L[b]):
  1. draft:  drafter.draft_logits: [bonus, MASK x (block_size-1)] at L[b].. over each row's context -> D
             distributions per row (over its draft vocabulary, `config.draft_vocab`, when it has one)
  2. tree:   per row, build_tree (top-budget prefixes) or build_chain (DFlash) -> N nodes with root = bonus,
             where (lookup) the continuation of the row's last n-gram before competes for the nodes
  3. verify: one target forward over B x N nodes, row b's at positions L[b] + depth with its ancestor mask
  4. accept: per row, walk the tree along the target's argmax (or one target sample per node)
  5. commit: each row's cache keeps its accepted path, its drafter context gets their taps, L[b] += k[b] + 1

The engine reaches a target only through its family-independent surface: `init_cache`, the forward
`target(tokens, segment, cache, tap_layers=, logits_idx=)` and the cache's `advance` / `commit`. A new
family brings a module and cache entries, never a new round.

Generation runs in chunks of rounds (all of it unless streaming), read back between chunks by `api.py`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.accept import accept_walk
from jaxspec.cache import Cache
from jaxspec.kernels import use
from jaxspec.lookup import MAX_DEPTH, chain_logprobs, lookup_chain
from jaxspec.sampling import RowSampling, SamplingParams, sample, sample_per_row
from jaxspec.segment import Segment
from jaxspec.sharding import Layout
from jaxspec.tree import Tree, add_chain, build_chain, build_tree, prune, root_only, tree_segment

# ------------------------------------------------------------------------------------------ AR


@jax.tree_util.register_dataclass
@dataclass
class ARState:
    cache: Cache
    last: jax.Array  # [B] the newest token of each row, not yet in the cache
    out: jax.Array  # [B, out_len] generated tokens
    emitted: jax.Array  # [B] tokens generated per row (a row stops counting once done)
    steps: jax.Array  # [] target forwards so far, the prefill included (= tokens per unfinished row)
    done: jax.Array  # [B] bool: EOS sampled or max_new reached
    key: jax.Array  # [B] one rng stream per row, so a row samples the same tokens whatever else runs
    max_new: jax.Array  # [B] int32: tokens each row may generate
    row_sampling: RowSampling | None = None  # each row's settings under SamplingParams(per_row=True)


def _on_kernels(step):
    """Trace an engine step under its target's kernel backend (the static `target_def.kernels`)."""

    @functools.wraps(step)
    def traced(target_def, *args, **kwargs):
        with use(target_def.kernels):
            return step(target_def, *args, **kwargs)

    return traced


def _pin(layout: Layout | None, cache: Cache) -> Cache:
    """Keep a cache sharded like the layers that write it (a no-op on one device)."""
    return cache if layout is None else layout.constrain(cache)


def _pin_state(state, layout: Layout | None, draft_layout: Layout | None = None):
    """Pin a whole decode state (ARState, SpecState) as every program that returns one leaves it: caches by
    their layers' rules, every other field by rows over dp. Left to XLA, the small fields' shardings differ
    between a prefill and the decode loop, so the loop would compile again on its second call."""
    if layout is None:
        return state
    rest = {f.name: getattr(state, f.name) for f in fields(state) if f.name not in ("cache", "draft_cache")}
    state = replace(state, cache=layout.constrain(state.cache), **layout.constrain_rows(rest))
    return replace(state, draft_cache=_pin(draft_layout, state.draft_cache)) if hasattr(state, "draft_cache") else state


def _sample_rows(logits, keys, sampling: SamplingParams, rows: RowSampling | None = None):
    """logits [B, ..., V] -> tokens [B, ...], row b drawn with keys[b] (greedy needs no key) and, per_row, with
    its own settings rows[b]."""
    if sampling.greedy:
        return sample(logits, None, sampling)
    if sampling.per_row:
        return sample_per_row(logits, keys, rows)
    return jax.vmap(lambda x, k: sample(x, k, sampling))(logits, keys)


def _split_rows(keys):
    """keys [B] -> (next keys [B], subkeys [B])."""
    pair = jax.vmap(jax.random.split)(keys)  # [B, 2]
    return pair[:, 0], pair[:, 1]


# Prompt tokens per prefill forward: a longer prompt is prefilled in chunks (prefill_forward), so the attention's
# temporaries grow with the prompt, not with its square (a 32k-token prompt's scores in one forward are ~100 GB).
PREFILL_CHUNK = 1024


def prefill_forward(target, tokens, positions, lengths, cache: Cache, *, chunk: int = PREFILL_CHUNK,
                    tap_layers=(), drafter=None, draft_cache=None):
    """Prompts tokens [B, P] at positions [B, P] through `cache`, row b's first lengths[b] tokens real (the rest
    right padding): -> (logits at each row's last real token [B, V], the cache advanced by lengths, the drafter
    context with their taps appended when a drafter is given).

    A prompt longer than `chunk` (P a multiple of it) goes through in chunks, one forward each inside a loop:
    each chunk attends to the cache its predecessors wrote and causally to itself. A row with fewer real tokens
    than a chunk folds only those (a GDN state) and writes the rest as scratch past its length, which the next
    chunk overwrites; every write stays below the chunk's end, so inside the buffer. The loop stops after the
    last chunk that holds a real token, so right padding costs no forward: a speculative refill pads every long
    prompt to one width and compiles one program for them all (Decoder.refill_width)."""
    B, P = tokens.shape
    lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), (B,))

    def one(tok, pos, n, at, cache, draft_cache):
        logits, taps, cache = target(tok, Segment.causal(pos, lengths=n), cache, tap_layers=tap_layers,
                                     logits_idx=jnp.clip(lengths - 1 - at, 0, tok.shape[1] - 1)[:, None])
        if drafter is not None:
            draft_cache = drafter.append_context(draft_cache, taps, n)
        return logits[:, 0], cache.advance(n), draft_cache

    if P <= chunk:
        return one(tokens, positions, lengths, 0, cache, draft_cache)
    assert P % chunk == 0, (P, chunk)

    def body(i, carry):
        last, cache, draft_cache = carry
        at = i * chunk
        tok, pos = (jax.lax.dynamic_slice_in_dim(x, at, chunk, axis=1) for x in (tokens, positions))
        logits, cache, draft_cache = one(tok, pos, jnp.clip(lengths - at, 0, chunk), at, cache, draft_cache)
        here = (lengths - 1 >= at) & (lengths - 1 < at + chunk)  # the row's last real token is in this chunk
        return jnp.where(here[:, None], logits, last), cache, draft_cache

    last = jnp.zeros((B, target.config.vocab_size), jnp.float32)
    used = jnp.clip((jnp.max(lengths) + chunk - 1) // chunk, 1, P // chunk)  # chunks with a real token
    return jax.lax.fori_loop(0, used, body, (last, cache, draft_cache))


@functools.partial(jax.jit, static_argnames=("target_def", "max_len", "out_len", "sampling", "eos", "layout",
                                             "chunk"))
@_on_kernels
def ar_prefill(target_def, target_params, tokens, start, key, max_new, row_sampling: RowSampling | None = None, *,
               max_len, out_len, sampling: SamplingParams, eos, layout: Layout | None = None,
               chunk: int = PREFILL_CHUNK) -> ARState:
    """Left-padded prompts tokens [B, P] (row b's first real slot is start[b]) -> state with the first token.
    key: one key (split per row) or [B] keys; row_sampling: each row's settings when sampling.per_row."""
    target = nnx.merge(target_def.graphdef, target_params)
    B, P = tokens.shape
    keys = key if key.shape == (B,) else jax.random.split(key, B)
    max_new = jnp.broadcast_to(jnp.asarray(max_new, jnp.int32), (B,))  # per row from the start: refills set rows
    cache, tok, key = _prefill(target, tokens, start, _pin(layout, target.init_cache(B, max_len).with_start(start)),
                               keys, sampling, chunk, row_sampling)
    return _pin_state(ARState(
        cache=cache, last=tok, out=jnp.zeros((B, out_len), jnp.int32).at[:, 0].set(tok),
        emitted=jnp.ones((B,), jnp.int32), steps=jnp.int32(1),
        done=jnp.isin(tok, jnp.asarray(eos, jnp.int32)) | (max_new <= 1), key=key, max_new=max_new,
        row_sampling=row_sampling,
    ), layout)


def _prefill(target, tokens, start, cache: Cache, key, sampling: SamplingParams, chunk: int = PREFILL_CHUNK,
             row_sampling: RowSampling | None = None):
    """Left-padded prompts tokens [B, P] through `cache` (its start = start) -> (cache advanced by P, each row's
    first token [B] drawn with its key of keys [B], the next keys). The pads' positions are clamped to 0: no real
    token ever attends to them."""
    B, P = tokens.shape
    positions = jnp.maximum(jnp.arange(P)[None, :] - start[:, None], 0)
    logits, cache, _ = prefill_forward(target, tokens, positions, P, cache, chunk=chunk)
    key, sub = _split_rows(key)
    return cache, _sample_rows(logits, sub, sampling, row_sampling), key


@functools.partial(jax.jit, static_argnames=("target_def", "sampling", "eos", "layout"), donate_argnames=("state",))
@_on_kernels
def ar_decode(target_def, target_params, state: ARState, stop_at, *, sampling: SamplingParams, eos,
              layout: Layout | None = None) -> ARState:
    """Decode until every row is done or `stop_at` tokens exist (a chunk boundary for streaming)."""
    target = nnx.merge(target_def.graphdef, target_params)
    eos_ids = jnp.asarray(eos, jnp.int32)

    def cond(s: ARState):  # a row is done once it has max_new tokens, so max_new needs no check here
        return ~jnp.all(s.done) & (s.steps < stop_at)

    def body(s: ARState):
        positions = (s.cache.length - s.cache.start)[:, None]  # [B, 1]
        logits, _, cache = target(s.last[:, None], Segment.causal(positions), s.cache)
        key, sub = _split_rows(s.key)
        tok = _sample_rows(logits[:, 0], sub, sampling, s.row_sampling)
        live = ~s.done
        out = jax.lax.dynamic_update_slice(s.out, jnp.where(live, tok, 0)[:, None], (0, s.steps))
        done = s.done | jnp.isin(tok, eos_ids) | (s.emitted + 1 >= s.max_new)
        return replace(s, cache=_pin(layout, cache.advance(1)), last=tok, out=out, emitted=s.emitted + live,
                       steps=s.steps + 1, done=done, key=key)

    return _pin_state(jax.lax.while_loop(cond, body, state), layout)


@functools.partial(jax.jit, static_argnames=("target_def", "sampling", "eos", "layout"), donate_argnames=("state",))
@_on_kernels
def ar_refill(target_def, target_params, state: ARState, rows, tokens, start, max_new, key,
              row_sampling: RowSampling | None = None, *, sampling: SamplingParams, eos,
              layout: Layout | None = None) -> tuple[ARState, jax.Array]:
    """Continuous batching: rows `rows` [R] (finished; indices >= B are padding and ignored) start new prompts.

    tokens [R, P] left-padded (row r's first real slot start[r]) are prefilled into a fresh P-slot cache that
    put_rows places so each prompt ends at the batch's `length`; the rows then decode on with the others,
    `max_new` [R] tokens each (and row_sampling [R] settings when sampling.per_row), each new row with its own rng
    stream (key: one key, split per row, or [R] keys). Returns the state and each new row's first token [R]."""
    target = nnx.merge(target_def.graphdef, target_params)
    R, P = tokens.shape
    keys = key if key.shape == (R,) else jax.random.split(key, R)
    fresh, tok, key = _prefill(target, tokens, start, target.init_cache(R, P).with_start(start), keys, sampling,
                               row_sampling=row_sampling)
    put = lambda x, y: x.at[rows].set(y, mode="drop")  # noqa: E731
    state = replace(
        state, cache=state.cache.put_rows(rows, fresh), last=put(state.last, tok),
        emitted=put(state.emitted, jnp.ones((R,), jnp.int32)),
        done=put(state.done, jnp.isin(tok, jnp.asarray(eos, jnp.int32)) | (max_new <= 1)),
        key=put(state.key, key), max_new=put(state.max_new, max_new),
        row_sampling=jax.tree.map(put, state.row_sampling, row_sampling))
    return _pin_state(state, layout), tok


@functools.partial(jax.jit, static_argnames=("max_len", "layout"))
def ar_reslot(state: ARState, shift, *, max_len: int, layout: Layout | None = None) -> ARState:
    """The same state with its cache moved `shift` slots left into `max_len` slots (Cache.reslot): the next
    window of a batched decode (shift 0), or continuous batching's slide of the live rows to the front."""
    return _pin_state(replace(state, cache=state.cache.reslot(shift, max_len)), layout)


# ------------------------------------------------------------------------------------ speculative


@dataclass(frozen=True)
class SpecSettings:
    """Everything static about a speculative run (one compile per distinct value)."""

    method: str  # dflash | ddtree
    budget: int  # non-root tree nodes (dflash: block_size - 1; ddtree 0: the bonus alone, an AR step)
    block_size: int
    tap_layers: tuple[int, ...]  # target layers whose outputs feed the drafter
    sampling: SamplingParams
    eos: tuple[int, ...]
    kv_impl: str = "xla"  # the KV commit: "xla" | "pallas"
    layout: Layout | None = None  # the target's mesh and sharding rules (None: one device)
    draft_layout: Layout | None = None  # the drafter's
    lookup: bool = False  # the context's continuation competes with the drafter's nodes (lookup.py)

    @property
    def depth(self) -> int:
        return self.block_size - 1

    @property
    def tree_depth(self) -> int:
        """The deepest node a round verifies, so the most draft tokens it accepts: the drafter's block, or with
        lookup a copied chain as deep as the budget allows (up to lookup.MAX_DEPTH)."""
        reach = min(self.budget, MAX_DEPTH) if self.lookup and self.method == "ddtree" else 0
        return max(self.depth, reach)

    @property
    def round_tokens(self) -> int:
        """The most tokens one round emits (accepted drafts and the bonus): the output's margin past max_new."""
        return self.tree_depth + 1

    @property
    def draft_depth(self) -> int:
        """Draft rows a round needs: a tree of `budget` nodes is at most `budget` deep."""
        return min(self.budget, self.depth) if self.method == "ddtree" else self.depth

    @property
    def nodes(self) -> int:
        """Tree slots a round verifies, the root included."""
        return (self.budget if self.method == "ddtree" else self.depth) + 1


@jax.tree_util.register_dataclass
@dataclass
class SpecState:
    """B rows of speculative decoding; every field is per row, so rows accept, emit and finish on their own."""

    cache: Cache  # target cache: each row's committed prefix (the bonus is not in it yet)
    draft_cache: Any  # the drafter's context of the committed tokens
    bonus: jax.Array  # [B] the target's token after each row's committed prefix
    out: jax.Array  # [B, out_len] generated tokens
    emitted: jax.Array  # [B] tokens generated (the first one by the prefill)
    done: jax.Array  # [B] bool
    key: jax.Array  # [B] one rng stream per row
    max_new: jax.Array  # [B] int32
    rounds: jax.Array  # [B] speculative rounds (target verify forwards) while the row was live
    accepted_hist: jax.Array  # [B, tree_depth + 1] rounds that accepted k draft tokens
    tree_nodes: jax.Array  # [B] valid non-root tree nodes verified, summed over rounds
    history: jax.Array  # [B, max_len] the prompt, the committed tokens and the bonus, at their positions
    row_sampling: RowSampling | None = None  # each row's settings under SamplingParams(per_row=True)


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "max_len", "out_len", "settings", "chunk"))
@_on_kernels
def spec_prefill(target_def, target_params, drafter_def, drafter_params, tokens, length, key, max_new,
                 row_sampling: RowSampling | None = None, *, max_len, out_len, settings: SpecSettings,
                 chunk: int = PREFILL_CHUNK) -> SpecState:
    """Right-padded prompts tokens [B, P] (row b's real length length[b]) -> round state with each row's first
    bonus. key: one key (split per row) or [B] keys; max_new: [] or [B]; row_sampling: [B] settings when
    settings.sampling.per_row."""
    target, drafter = nnx.merge(target_def.graphdef, target_params), nnx.merge(drafter_def.graphdef, drafter_params)
    return _spec_start(target, drafter, tokens, length, key, max_new, max_len, out_len, settings, chunk,
                       row_sampling)


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "settings"), donate_argnames=("state",))
@_on_kernels
def spec_refill(target_def, target_params, drafter_def, drafter_params, state: SpecState, rows, tokens, length, key,
                max_new, row_sampling: RowSampling | None = None, *, settings: SpecSettings) -> SpecState:
    """Continuous batching: rows `rows` [R] (finished; indices >= B are padding, dropped) start the right-padded
    prompts tokens [R, P] (real lengths length [R], max_new [R] tokens each). Each row owns its slots and its
    length, so a new prompt starts at slot 0 of its row whatever the others hold: every per-row buffer of the
    state (caches, drafter context, outputs, statistics, rng) is replaced by a fresh prefill's."""
    target, drafter = nnx.merge(target_def.graphdef, target_params), nnx.merge(drafter_def.graphdef, drafter_params)
    fresh = _spec_start(target, drafter, tokens, length, key, max_new, state.cache.max_len, state.out.shape[1],
                        settings, row_sampling=row_sampling)
    state = jax.tree.map(lambda x, y: x.at[rows].set(y, mode="drop"), state, fresh)
    return _pin_state(state, settings.layout, settings.draft_layout)


def _spec_start(target, drafter, tokens, length, key, max_new, max_len: int, out_len: int,
                settings: SpecSettings, chunk: int = PREFILL_CHUNK,
                row_sampling: RowSampling | None = None) -> SpecState:
    B, P = tokens.shape
    length = jnp.broadcast_to(jnp.asarray(length, jnp.int32), (B,))
    keys = key if key.shape == (B,) else jax.random.split(key, B)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    cache = _pin(settings.layout, target.init_cache(B, max_len))
    draft_cache = _pin(settings.draft_layout, drafter.init_cache(B, max_len))
    logits, cache, draft_cache = prefill_forward(target, tokens, positions, length, cache, chunk=chunk,
                                                 tap_layers=settings.tap_layers, drafter=drafter,
                                                 draft_cache=draft_cache)
    keys, sub = _split_rows(keys)
    bonus = _sample_rows(logits, sub, settings.sampling, row_sampling)
    rows = jnp.arange(B)
    history = jnp.zeros((B, max_len), jnp.int32).at[:, :P].set(tokens).at[rows, length].set(bonus)
    max_new = jnp.broadcast_to(jnp.asarray(max_new, jnp.int32), (B,))
    return _pin_state(SpecState(
        cache=cache, draft_cache=draft_cache, bonus=bonus,
        out=jnp.zeros((B, out_len), jnp.int32).at[:, 0].set(bonus), emitted=jnp.ones((B,), jnp.int32),
        done=jnp.isin(bonus, jnp.asarray(settings.eos, jnp.int32)) | (max_new <= 1), key=keys, max_new=max_new,
        rounds=jnp.zeros((B,), jnp.int32), accepted_hist=jnp.zeros((B, settings.round_tokens), jnp.int32),
        tree_nodes=jnp.zeros((B,), jnp.int32), history=history, row_sampling=row_sampling,
    ), settings.layout, settings.draft_layout)


def _row_tree(draft, history, pos, settings: SpecSettings, ids) -> Tree:
    """One row's draft tree from its draft logits [depth, K] (root token left 0), with its context's lookup
    chain competing for the nodes when settings.lookup."""
    tree = build_tree(draft, settings.budget, ids) if settings.method == "ddtree" else build_chain(draft, ids)
    if settings.lookup:
        D = settings.tree_depth
        chain, count, n = lookup_chain(history, pos + 1, D)
        tree = prune(add_chain(tree, chain, count, chain_logprobs(n, D)), tree.tokens.shape[0] - 1)
    return tree


def spec_round(target, drafter, s: SpecState, settings: SpecSettings) -> SpecState:
    """One speculative round for every row (see the module docstring). Rows already done go through the same
    shapes but keep everything: their commit keeps no token, and their outputs and statistics do not move."""
    D = settings.tree_depth
    L = s.cache.length  # [B]
    pos = L - s.cache.start  # [B] the bonus' position
    key, k_verify = _split_rows(s.key)
    live = ~s.done
    # 1-2. draft and build the trees (root = bonus); budget 0 drafts nothing and verifies the bonus alone
    if settings.nodes == 1:
        tree = root_only(L.shape[0])
    else:
        draft = drafter.draft_logits(target, s.draft_cache, s.bonus, L, settings.draft_depth)  # [B, depth, K]
        ids = drafter.config.draft_vocab or None  # the draft columns' token ids
        tree = jax.vmap(lambda d, h, p: _row_tree(d, h, p, settings, ids))(draft, s.history, pos)  # fields [B, N]
    tokens = tree.tokens.at[:, 0].set(s.bonus)
    # 3. verify all rows' nodes in one forward: node i of row b at position L[b] + depth_i, seeing its prefix
    #    and its own ancestors
    logits, taps, pending = target(tokens, tree_segment(tree, pos), s.cache, tap_layers=settings.tap_layers)
    # 4. accept, row by row
    target_tokens = _sample_rows(logits, k_verify, settings.sampling, s.row_sampling)  # [B, N]
    path, k = jax.vmap(lambda t, tt: accept_walk(t, tt, D))(tree, target_tokens)  # [B, D + 1], [B]
    # 5. commit each row's path in the target cache and the drafter context; a done row keeps nothing
    n = jnp.where(live, k + 1, 0)
    cache = _pin(settings.layout, pending.commit(path, n, impl=settings.kv_impl))
    kept = path[:, : min(D, settings.nodes - 1) + 1]  # the most a tree of these nodes can accept
    tapped = jnp.take_along_axis(taps, kept[:, :, None], axis=1)  # [B, <= D + 1, taps]
    draft_cache = _pin(settings.draft_layout, drafter.append_context(s.draft_cache, tapped, n))
    bonus = jnp.take_along_axis(target_tokens, jnp.take_along_axis(path, k[:, None], 1), 1)[:, 0]  # [B]
    # emit [accepted drafts..., new bonus] per row
    i = jnp.arange(D + 1)[None, :]
    drafted = jnp.take_along_axis(tokens, jnp.take_along_axis(path, jnp.minimum(i + 1, D), 1), 1)  # [B, D + 1]
    new = jnp.where(i < k[:, None], drafted, jnp.where(i == k[:, None], bonus[:, None], 0))
    is_eos = jnp.isin(new, jnp.asarray(settings.eos, jnp.int32)) & (i <= k[:, None])
    n_new = jnp.where(is_eos.any(1), jnp.argmax(is_eos, axis=1) + 1, k + 1)
    emitted = jnp.where(live, jnp.minimum(s.emitted + n_new, s.max_new), s.emitted)
    put = jax.vmap(lambda buf, x, at, ok: jnp.where(ok, jax.lax.dynamic_update_slice(buf, x, (at,)), buf))
    return replace(
        s, cache=cache, draft_cache=draft_cache, bonus=jnp.where(live, bonus, s.bonus), key=key, emitted=emitted,
        out=put(s.out, new, s.emitted, live),
        done=s.done | is_eos.any(1) | (emitted >= s.max_new), rounds=s.rounds + live,
        accepted_hist=s.accepted_hist.at[jnp.arange(k.shape[0]), k].add(live.astype(jnp.int32)),
        tree_nodes=s.tree_nodes + jnp.where(live, tree.valid.sum(1) - 1, 0),
        history=put(s.history, new, pos + 1, live),
    )


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "settings"), donate_argnames=("state",))
@_on_kernels
def spec_decode(target_def, target_params, drafter_def, drafter_params, state: SpecState, stop_at, *,
                settings: SpecSettings) -> SpecState:
    """Run rounds until every row is done or every live row has `stop_at` tokens (a chunk boundary for
    streaming)."""
    target, drafter = nnx.merge(target_def.graphdef, target_params), nnx.merge(drafter_def.graphdef, drafter_params)
    return _spec_loop(target, drafter, state, stop_at, settings)


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "settings"), donate_argnames=("state",))
@_on_kernels
def spec_decode_rows(target_def, target_params, drafter_def, drafter_params, state: SpecState, rows, stop_at, *,
                     settings: SpecSettings) -> SpecState:
    """spec_decode over the rows `rows` [R] (distinct) of the state alone, the others left as they are: a batch
    whose other rows are idle runs rounds of R rows, drafting R blocks and verifying R x (1 + budget) nodes
    instead of B x (1 + budget). The rows are gathered once and written back once per call."""
    target, drafter = nnx.merge(target_def.graphdef, target_params), nnx.merge(drafter_def.graphdef, drafter_params)
    sub = _spec_loop(target, drafter, jax.tree.map(lambda x: x[rows], state), stop_at, settings)
    state = jax.tree.map(lambda x, y: x.at[rows].set(y), state, sub)
    return _pin_state(state, settings.layout, settings.draft_layout)


def _spec_loop(target, drafter, state: SpecState, stop_at, settings: SpecSettings) -> SpecState:
    state = jax.lax.while_loop(lambda s: jnp.any(~s.done & (s.emitted < stop_at)),
                               lambda s: spec_round(target, drafter, s, settings), state)
    return _pin_state(state, settings.layout, settings.draft_layout)
