"""The decoder: one (model, drafter, settings) and everything between prompt tokens and answer tokens on the
device: buffer sizing, prefill, the decode loop in chunks (read back between chunks for streaming) and the
statistics. `jaxspec.generate`, `budget="auto"`'s timing, continuous batching and the benchmarks all decode
through it, so the engine's calling convention and the buffer sizes are written once.

    dec = Decoder(model, drafter, method="ddtree", budget=8)
    run = dec.prefill(rows, max_new_tokens=128)        # rows: token lists; compiles once per shape
    while not dec.finished(run):
        run = dec.decode(run, dec.count(run) + 16)     # 16 more tokens (per row), then read back
    dec.tokens(run), dec.stats(run)

AR runs a batch of left-padded rows in lockstep; speculative methods run a batch of right-padded rows, each with
its own tree, acceptance and length. Buffers come in a few rounded sizes, so a handful of compiled programs serve
every prompt.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import engine
from jaxspec.drafter import Drafter
from jaxspec.model import Model
from jaxspec.sampling import RowSampling, SamplingParams
from jaxspec.sharding import to_host
from pallas_kernels.kv_commit import effective_impl

PROMPT_BUCKET = 64  # prompts are padded to a multiple of this (one prefill program per bucket)
CACHE_BUCKET = 256  # cache buffers are a multiple of this


def round_up(n: int, m: int) -> int:
    """The multiple of m at or above n (at least m): buffer sizes from a few compiled shapes."""
    return max(m, -(-n // m) * m)


def prompt_width(n: int) -> int:
    """The padded width of an n-token prompt: a multiple of PROMPT_BUCKET, or past one prefill chunk a multiple of
    the chunk (engine.prefill_forward)."""
    return round_up(n, PROMPT_BUCKET if n <= engine.PREFILL_CHUNK else engine.PREFILL_CHUNK)


def left_pad(rows: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts -> tokens [B, width] with every row's last token at slot width - 1, and each row's first real
    slot [B] (the engine's `start`)."""
    tokens = np.zeros((len(rows), width), np.int32)
    for b, r in enumerate(rows):
        tokens[b, width - len(r):] = r
    return tokens, np.array([width - len(r) for r in rows], np.int32)


def ar_window(model: Model, batch: int, max_len: int) -> int:
    """Cache slots a batched AR decode grows by (max_len: no growth).

    Attention reads every slot of the cache each step. At batch 1 the full buffer is small next to the weights
    and one compile is worth more; in a batch it need not be (the K/V of a few dozen rows can outweigh the
    weights), so the cache starts with the prompt and grows by 64 slots (one compile per window size, reused
    across batches)."""
    cache = jax.eval_shape(lambda: model.module.init_cache(batch, max_len))
    kv_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    return 64 if kv_bytes > weight_bytes / 8 else max_len


@dataclass(frozen=True)
class Stats(Mapping):
    """What a run did, summed over its rows. Read as attributes or, for compatibility, as a dict
    (`res.stats["acceptance_length"]`; fields that do not apply to the method are None and absent from the dict
    view)."""

    method: str  # ar | dflash | ddtree
    prompt_tokens: list[int]  # per row
    new_tokens: int  # generated, over all rows
    steps: int  # target forwards, the prefill included (a batch's: its longest row's)
    prefill_s: float  # prefill (and first-call compile) seconds
    decode_s: float
    tokens_per_second: float  # decoded tokens (the prefill's first token aside) per decode second
    acceptance_length: float  # tokens emitted per row per target forward after the prefill (1.0 for AR)
    wall_s: float | None = None  # the call's seconds, prompt encoding and budget="auto"'s timing included
    # speculative methods only
    rounds: int | None = None  # speculative rounds (target verify forwards), summed over rows
    budget: int | None = None  # non-root tree nodes per round
    accepted_length_histogram: list[int] | None = None  # rounds that accepted k draft tokens, k = 0..
    per_depth_acceptance: list[float] | None = None  # P(accept depth d | accepted depth d - 1)
    budget_utilisation: float | None = None  # valid tree nodes verified / (rounds x budget)
    kv_commit: str | None = None  # the KV commit that ran ("xla" | "pallas")
    lookup: bool | None = None  # prompt lookup competed for the tree's nodes
    budget_source: str | None = None  # budget="auto": "auto" or why the default was kept
    predicted_speedup: dict[str, float] | None = None  # budget="auto": AL(b) x AR step / round(b) per budget
    per_row: list[dict] | None = None  # a speculative batch: each row's own rounds and acceptance (spec_stats)

    def _present(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def __getitem__(self, key: str) -> Any:
        if key not in self._present():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self._present())

    def __len__(self) -> int:
        return len(self._present())


@dataclass
class Run:
    """A decode in progress: the engine's state plus what the host needs to size and report it."""

    state: Any  # engine.ARState or engine.SpecState
    prompt_tokens: list[int]
    prompt_slots: int  # P: the padded prompt width (AR) or bucket (speculative)
    full_len: int  # the largest cache a run of this length needs (AR grows towards it by windows)
    window: int  # AR cache growth (full_len: none)
    extra: dict = field(default_factory=dict)  # budget="auto"'s choice, reported in the stats


class Decoder:
    """Decoding for one (model, drafter, method, budget, sampling, eos, kv_impl, lookup); see the module doc.

    Arguments are taken as validated (`jaxspec.generate` checks a user's); `budget` is an int for "ddtree"
    (block_size - 1 for "dflash"), None for "ar"."""

    def __init__(self, model: Model, drafter: Drafter | None = None, *, method: str = "ar", budget: int | None = None,
                 sampling: SamplingParams = SamplingParams(), eos: tuple[int, ...] | None = None,
                 kv_impl: str = "xla", lookup: bool = True):
        self.model, self.drafter, self.method, self.budget = model, drafter, method, budget
        self.sampling = sampling
        self.kv_commit = effective_impl(kv_impl)  # what the commit really runs (the stats say it)
        self.eos = tuple(eos) if eos is not None else (model.eos_token_ids or (-1,))
        self.settings = None
        if method != "ar":
            dc = drafter.config
            self.settings = engine.SpecSettings(method, budget, dc.block_size, dc.target_layer_ids, sampling,
                                                self.eos, kv_impl, model.layout, drafter.layout, bool(lookup))

    def settings_for(self, budget: int | None) -> engine.SpecSettings:
        """The round settings at `budget` (None: the decoder's own). A state sized for the decoder's budget runs any
        smaller one: its caches, acceptance histogram and output margin only hold more than that one needs. Budget
        0 drafts nothing and verifies each row's bonus alone: AR steps in the speculative state (`tree.root_only`),
        for batch sizes where no tree pays for itself."""
        if budget is None or budget == self.budget:
            return self.settings
        if self.method != "ddtree" or not 0 <= budget <= self.budget:
            raise ValueError(f"rounds at budget {budget} need a ddtree Decoder of budget >= {budget} (this one: "
                             f"{self.method}, budget {self.budget})")
        return replace(self.settings, budget=budget)

    # ------------------------------------------------------------------------------ sizing

    def spec_max_len(self, length: int, max_new_tokens: int) -> int:
        """Cache slots for a speculative run: the last round starts at L <= length + max_new - 2 and writes
        1 + budget tree slots (target) and up to max(1 + budget, block_size) context rows (drafter) from
        there; scratch slots past the model's context are fine."""
        P = prompt_width(length)
        need = length + max_new_tokens + self.settings.nodes + self.settings.block_size
        return round_up(max(P, need), CACHE_BUCKET)

    # ------------------------------------------------------------------------------ the loop

    @staticmethod
    def slots_for_queue(prompts: list[list[int]], limits: list[int], chunk: int) -> int:
        """Cache slots for continuous batching (`refill`, `make_room`): a row's prompt and answer never need more
        than span slots, a chunk past the newest token `chunk` more, and a refilled prompt its padded width."""
        span = max(len(r) + m for r, m in zip(prompts, limits))
        widest = prompt_width(max(map(len, prompts)))
        return max(round_up(span + chunk, 32), widest)  # attention reads every slot: no more than needed

    def row_sampling(self, params: list[SamplingParams] | None, n: int) -> RowSampling | None:
        """The engine's per-row settings for n rows (SamplingParams(per_row=True) decoders only)."""
        if not self.sampling.per_row:
            if params is not None:
                raise ValueError("per-row sampling settings need a Decoder with SamplingParams(per_row=True)")
            return None
        if params is None or len(params) != n:
            raise ValueError(f"a per-row decoder needs one SamplingParams per row: {n} rows, got "
                             f"{None if params is None else len(params)}")
        return RowSampling.of(params)

    def prefill(self, rows: list[list[int]], max_new_tokens: int | list[int], key: jax.Array | None = None, *,
                max_len: int | None = None, out_len: int | None = None,
                sampling: list[SamplingParams] | None = None) -> Run:
        """Prefill `rows` and sample each row's first token. max_new_tokens: one limit or one per row.
        max_len / out_len: fixed cache and output sizes (continuous batching) instead of the ones sized for
        max_new_tokens. sampling: each row's settings (a SamplingParams(per_row=True) decoder)."""
        m = self.model
        key = jax.random.key(0) if key is None else key
        check_rows(rows, max_new_tokens)
        row_sampling = self.row_sampling(sampling, len(rows))
        lens = [len(r) for r in rows]
        if self.method == "ar":
            most = max_new_tokens if isinstance(max_new_tokens, int) else max(max_new_tokens)
            P = prompt_width(max(lens))
            tokens, start = left_pad(rows, P)
            full = max(max_len, P) if max_len else round_up(P + most, CACHE_BUCKET)
            window = full if max_len else ar_window(m, len(rows), full)
            state = engine.ar_prefill(m.jit_def, m.params, jnp.asarray(tokens), jnp.asarray(start), key,
                                      jnp.asarray(max_new_tokens, jnp.int32), row_sampling,
                                      max_len=min(full, P + window),
                                      out_len=out_len or round_up(most, 64), sampling=self.sampling, eos=self.eos,
                                      layout=m.layout)
            return Run(state, lens, P, full, window)
        most = max_new_tokens if isinstance(max_new_tokens, int) else max(max_new_tokens)
        P = prompt_width(max(lens))
        tokens = np.zeros((len(rows), P), np.int32)  # right-padded; the forward is told each row's length
        for b, r in enumerate(rows):
            tokens[b, : len(r)] = r
        max_len = max_len or self.spec_max_len(max(lens), most)
        d = self.drafter
        state = engine.spec_prefill(m.jit_def, m.params, d.jit_def, d.params, jnp.asarray(tokens),
                                    jnp.asarray(lens, jnp.int32), key, jnp.asarray(max_new_tokens, jnp.int32),
                                    row_sampling, max_len=max_len,
                                    out_len=out_len or round_up(most, 64) + self.settings.round_tokens,
                                    settings=self.settings)
        return Run(state, lens, P, max_len, max_len)

    def decode(self, run: Run, stop: int, live: list[int] | None = None, budget: int | None = None) -> Run:
        """Decode until every row is done or `count(run)` reaches `stop` (one round may overshoot it).

        Speculative methods only:
        live: the rows that may still emit (every other row must be done). When a power of two below the batch
        size holds them (`live_rows`), rounds run over those rows alone, padded with idle ones (one compile per
        size), so idle rows cost no drafting or verifying.
        budget: DDTree rounds at this budget, at most the decoder's (`settings_for`)."""
        m, s = self.model, run.state
        if self.method != "ar":
            d, settings = self.drafter, self.settings_for(budget)
            B = s.bonus.shape[0]
            R = B if live is None else live_rows(len(live), B, data_parallel(m))
            if R < B:
                rows = list(live) + [b for b in range(B) if b not in live][: R - len(live)]
                run.state = engine.spec_decode_rows(m.jit_def, m.params, d.jit_def, d.params, s,
                                                    jnp.asarray(rows, jnp.int32), jnp.int32(stop), settings=settings)
                return run
            run.state = engine.spec_decode(m.jit_def, m.params, d.jit_def, d.params, s, jnp.int32(stop),
                                           settings=settings)
            return run
        if run.window >= run.full_len:  # one buffer for the whole run
            run.state = engine.ar_decode(m.jit_def, m.params, s, jnp.int32(stop), sampling=self.sampling,
                                         eos=self.eos, layout=m.layout)
            return run
        while True:  # AR grows the cache by windows: token n is written at slot P + n - 1
            room = s.cache.max_len - run.prompt_slots + 1
            s = engine.ar_decode(m.jit_def, m.params, s, jnp.int32(min(stop, room)), sampling=self.sampling,
                                 eos=self.eos, layout=m.layout)
            if s.cache.max_len == run.full_len or int(to_host(s.steps)) >= stop or bool(np.all(to_host(s.done))):
                run.state = s
                return run
            s = engine.ar_reslot(s, jnp.int32(0), max_len=min(run.full_len, s.cache.max_len + run.window),
                                 layout=m.layout)

    def refill(self, run: Run, slots: list[int], prompts: list[list[int]], limits: list[int],
               key: jax.Array | None = None, sampling: list[SamplingParams] | None = None) -> list[int]:
        """Continuous batching: `prompts` enter the finished rows `slots` with `limits` new tokens each; returns
        their first tokens. Groups are padded to a power of two (few distinct compiles). key: the new rows' rng
        streams (one key, split per prompt, or one per prompt). sampling: each new row's settings (a
        SamplingParams(per_row=True) decoder).

        AR rows move in lockstep, so each prompt is prefilled to end where the other rows' tokens end (the live
        rows slide right first where a prompt is longer). A speculative row owns its length, so its prompt
        simply starts at slot 0 of the row."""
        m, n = self.model, len(prompts)
        B = run.state.last.shape[0] if self.method == "ar" else run.state.bonus.shape[0]
        check_rows(prompts, list(limits))
        if len(slots) != n or len(set(slots)) != n or not all(0 <= b < B for b in slots):
            raise ValueError(f"refill needs {n} distinct rows of the batch's {B} (got rows {slots}); a batch holds "
                             "no more prompts than it was prefilled with")
        if self.method == "ar" and prompt_width(max(map(len, prompts))) > run.state.cache.max_len:
            raise ValueError(f"a prompt of {max(map(len, prompts))} tokens fills "
                             f"{prompt_width(max(map(len, prompts)))} cache slots, more than the batch's "
                             f"{run.state.cache.max_len}; prefill the batch with max_len= for the longest")
        if self.method != "ar":
            for p, limit in zip(prompts, limits):
                if (self.spec_max_len(len(p), limit) > run.full_len
                        or limit + self.settings.round_tokens > run.state.out.shape[1]):
                    raise ValueError(f"a prompt of {len(p)} tokens with {limit} new ones needs more than the batch's "
                                     f"{run.full_len} cache slots; prefill the batch with max_len= for the longest")
        R = 1 << math.ceil(math.log2(n))
        P = self.refill_width(run, max(map(len, prompts)))
        row_sampling = self.row_sampling(None if sampling is None else list(sampling) + [sampling[0]] * (R - n), R)
        if key is not None and key.shape == (n,):
            key = jnp.concatenate([key, jnp.broadcast_to(key[:1], (R - n,))])
        rows = jnp.asarray(slots + [B] * (R - n), jnp.int32)  # index B: padding, dropped
        padded, max_new = prompts + [prompts[0]] * (R - n), jnp.asarray(list(limits) + [1] * (R - n), jnp.int32)
        if self.method != "ar":
            tokens = np.zeros((R, P), np.int32)
            for r, p in enumerate(padded):
                tokens[r, : len(p)] = p
            d = self.drafter
            run.state = engine.spec_refill(m.jit_def, m.params, d.jit_def, d.params, run.state, rows,
                                           jnp.asarray(tokens), jnp.asarray([len(p) for p in padded], jnp.int32),
                                           jax.random.key(0) if key is None else key, max_new, row_sampling,
                                           settings=self.settings)
            return to_host(run.state.out)[slots, 0].tolist()
        tokens, start = left_pad(padded, P)
        length = int(to_host(run.state.cache.length).max())  # AR rows move in lockstep
        if length < P:  # the new prompts must end at `length`: slide everything right
            run.state = engine.ar_reslot(run.state, jnp.int32(length - P), max_len=run.state.cache.max_len,
                                         layout=m.layout)
        run.state, first = engine.ar_refill(m.jit_def, m.params, run.state, rows, jnp.asarray(tokens),
                                            jnp.asarray(start), max_new, jax.random.key(0) if key is None else key,
                                            row_sampling, sampling=self.sampling, eos=self.eos, layout=m.layout)
        return to_host(first)[:n].tolist()

    def refill_width(self, run: Run, n: int) -> int:
        """The token width `refill` pads prompts of up to n tokens to. A speculative row's prompt longer than one
        prefill chunk is padded to the widest its buffer holds: each row's prefill writes into the run's full
        buffer anyway and stops after its last chunk with a real token (engine.prefill_forward), so all long
        prompts share one program instead of one per chunk count (a server with a 32k context would otherwise
        compile 31 of them) and none does more work for it. An AR prompt is prefilled into a fresh cache of its
        width, whose every slot each chunk's attention reads on the CPU, so AR keeps one program per width."""
        if self.method == "ar" or n <= engine.PREFILL_CHUNK:
            return prompt_width(n)
        return run.state.cache.max_len // engine.PREFILL_CHUNK * engine.PREFILL_CHUNK

    def start_chunk(self, run: Run) -> None:
        """AR continuous batching: the next chunk counts its own steps (`decode`'s stop is then per chunk). The zero
        is computed from the counter, so it keeps the placement the decode loop was compiled for (a fresh scalar
        differs on a mesh, a placed one on one device: either compiles the loop again)."""
        run.state = replace(run.state, steps=run.state.steps * 0)

    def cancel(self, run: Run, rows: list[int]) -> None:
        """Mark `rows` done (a client went away, a stop string matched): they stop emitting and, for speculative
        methods, stop committing; their rows can be refilled."""
        run.state = replace(run.state, done=run.state.done.at[jnp.asarray(rows, jnp.int32)].set(True))

    def make_room(self, run: Run, live: list[int], tokens: int) -> None:
        """Continuous batching: slide the live rows' tokens to the front of the cache where `tokens` more would
        not fit behind them."""
        cache = run.state.cache
        if int(to_host(cache.length).max()) + tokens > cache.max_len:
            shift = int(to_host(cache.start)[live].min())
            run.state = engine.ar_reslot(run.state, jnp.int32(shift), max_len=cache.max_len, layout=self.model.layout)

    def count(self, run: Run) -> int:
        """Tokens so far: per row in lockstep (AR), or the fewest any live row has emitted (speculative)."""
        s = run.state
        if self.method == "ar":
            return int(to_host(s.steps))
        emitted, done = to_host(s.emitted), to_host(s.done)
        return int(emitted[~done].min()) if (~done).any() else int(emitted.max())

    def finished(self, run: Run) -> bool:
        return bool(np.all(to_host(run.state.done)))

    def tokens(self, run: Run) -> list[list[int]]:
        """Each row's generated tokens (EOS included where sampled)."""
        out, n = to_host(run.state.out), to_host(run.state.emitted)
        return [out[b, : n[b]].tolist() for b in range(out.shape[0])]

    def stats(self, run: Run, prefill_s: float, decode_s: float) -> Stats:
        ids = self.tokens(run)
        new_tokens = sum(map(len, ids))
        decode_tokens = new_tokens - len(ids)  # the first token of each row comes from the prefill
        common = dict(method=self.method, prompt_tokens=run.prompt_tokens, new_tokens=new_tokens,
                      prefill_s=prefill_s, decode_s=decode_s,
                      tokens_per_second=decode_tokens / decode_s if decode_s > 0 else 0.0, **run.extra)
        s = run.state
        if self.method == "ar":
            return Stats(steps=int(to_host(s.steps)), acceptance_length=1.0, **common)
        rounds = to_host(s.rounds)  # per row
        return Stats(steps=int(rounds.max()) + 1,
                     **spec_stats(to_host(s.accepted_hist).sum(0), int(rounds.sum()), new_tokens - len(ids) + 1,
                                  self.budget, int(to_host(s.tree_nodes).sum())),
                     kv_commit=self.kv_commit, lookup=self.settings.lookup,
                     per_row=self.row_stats(run) if len(ids) > 1 else None, **common)

    def row_stats(self, run: Run) -> list[dict]:
        """Each row's own acceptance statistics (spec_stats of its rounds alone)."""
        s, ids = run.state, self.tokens(run)
        hist, rounds, nodes = to_host(s.accepted_hist), to_host(s.rounds), to_host(s.tree_nodes)
        return [spec_stats(hist[b], int(rounds[b]), len(ids[b]), self.budget, int(nodes[b])) for b in range(len(ids))]


def data_parallel(model: Model) -> int:
    """Data-parallel groups a model's rows are split over (1 on one device)."""
    return 1 if model.layout is None else model.layout.mesh.shape["dp"]


def live_rows(n: int, batch: int, dp: int = 1) -> int:
    """The rows a speculative round over n live rows of a batch runs (Decoder.decode): n rounded up to a power of
    two that splits evenly over `dp` data-parallel groups, or the whole batch when that is no smaller."""
    r = 1 << math.ceil(math.log2(max(n, 1)))
    while r < batch and r % dp:
        r *= 2
    return min(r, batch)


def check_rows(rows: list[list[int]], max_new_tokens: int | list[int]) -> None:
    """One clear error, naming the row, for a batch the decoder cannot run."""
    if not rows:
        raise ValueError("no prompts: give at least one")
    limits = [max_new_tokens] * len(rows) if isinstance(max_new_tokens, (int, np.integer)) else list(max_new_tokens)
    if len(limits) != len(rows):
        raise ValueError(f"{len(limits)} max_new_tokens for {len(rows)} prompts: give one limit, or one per row")
    for b, (r, m) in enumerate(zip(rows, limits)):
        if len(r) == 0:
            raise ValueError(f"empty prompt (row {b} of the batch): give at least one token")
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
            raise ValueError(f"max_new_tokens must be a positive integer (row {b} of the batch), got {m!r}")


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
        per_depth_acceptance=[float(reached[d] / reached[d - 1]) if reached[d - 1] else 0.0
                              for d in range(1, len(hist))],
        budget_utilisation=float(tree_nodes / max(rounds * budget, 1)),
    )
