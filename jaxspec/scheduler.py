"""The serving loop: one thread owns the device and a batch of decode rows; requests wait in a queue and enter
free rows between chunks, so a request never waits for another to finish (continuous batching, as in
jaxspec.batching, for an open-ended stream of requests).

    sched = Scheduler(decoder, max_batch=8, max_model_len=4096)
    sched.start()
    req = Request(prompt_ids, max_tokens=64, sampling=SamplingParams(0.7), on_event=print)
    sched.submit(req)          # events arrive on the loop's thread: text deltas, then one with finish_reason

Every row decodes as it would alone (its own positions, slots and, for speculative methods, its own tree and
rng stream), so a greedy answer does not depend on what else is running. Each row samples with its own settings
(the decoder runs SamplingParams(per_row=True)). The host reads tokens back once per chunk: that is when text is
streamed, stop strings are matched, cancelled rows are dropped and waiting requests are admitted.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import jax

from jaxspec.decoder import Decoder, Run, data_parallel, live_rows, prompt_width, round_up
from jaxspec.plan import out_of_memory
from jaxspec.sampling import SamplingParams
from jaxspec.sharding import to_host


class QueueFull(Exception):
    """The waiting queue is at its limit: the server answers 503."""


@dataclass
class Event:
    """What a request hears from the loop: new text, and at the end a finish_reason ("stop" | "length" |
    "cancelled" | "error") with the token counts."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    on_event: Callable[[Event], None] = lambda e: None  # called on the loop's thread
    stop: tuple[str, ...] = ()
    seed: int | None = None  # the row's own rng stream: generate(seed=)'s for this prompt alone
    # the loop's bookkeeping
    tokens: list[int] = field(default_factory=list)
    sent: int = 0  # characters of text already sent
    cancelled: bool = False
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None


class Scheduler:
    """Continuous batching over one Decoder (see the module doc). The decoder must sample per row
    (SamplingParams(per_row=True)); `max_model_len` bounds each request's prompt + max_tokens and sizes the
    buffers once, so one set of compiled programs serves every request. on_finish(request, rounds) reports each
    finished request (metrics; rounds: its speculative rounds, None for AR).

    Speculative rounds run over the live rows only (Decoder.decode's `live`: idle rows cost nothing), at the
    budget `budgets` gives for that many rows (`live_rows`: a power of two or the batch; default the decoder's
    budget, which must be the largest)."""

    def __init__(self, decoder: Decoder, *, max_batch: int, max_model_len: int, chunk: int = 16,
                 max_queue: int = 256, on_finish: Callable[[Request, int | None], None] | None = None,
                 budgets: dict[int, int] | None = None):
        if not decoder.sampling.per_row:
            raise ValueError("the scheduler needs a Decoder with SamplingParams(per_row=True)")
        self.dec, self.B, self.ctx, self.chunk, self.max_queue = decoder, max_batch, max_model_len, chunk, max_queue
        self.budgets = dict(budgets or {})
        for b in self.budgets.values():
            decoder.settings_for(b)  # each must fit the decoder's state
        self.tokenizer = decoder.model.tokenizer
        self.on_finish = on_finish or (lambda r, n: None)
        self.on_failure: Callable[[], None] = lambda: None  # called once the loop has died (`failed` says why)
        self.waiting: deque[Request] = deque()
        self.rows: list[Request | None] = [None] * max_batch
        self.wake = threading.Condition()
        self.stopping = False
        self.failed: str | None = None
        self.thread = threading.Thread(target=self._main, name="jaxspec-engine", daemon=True)
        self.tok_lock = threading.Lock()  # one tokenizer, used by the loop and by request handlers
        self.run: Run | None = None
        self.ready = threading.Event()

    # ------------------------------------------------------------------------------ the public side

    def start(self) -> None:
        """Start the loop: it builds the batch (compiling prefill, refill and decode) and then sets `ready`."""
        self.thread.start()

    def submit(self, req: Request) -> None:
        if not 1 <= len(req.prompt) or len(req.prompt) + req.max_tokens > self.ctx:
            raise ValueError(f"prompt ({len(req.prompt)} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                             f"served context of {self.ctx} tokens")
        with self.wake:
            if self.failed or self.stopping:
                raise QueueFull(self.failed or "the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (--max-queue); retry later")
            self.waiting.append(req)
            self.wake.notify()

    def cancel(self, req: Request) -> None:
        """Drop a request (its client went away): a waiting one leaves the queue, a running one frees its row at
        the next chunk boundary."""
        with self.wake:
            req.cancelled = True
            self.wake.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Cancel what is waiting and running, end the loop and wait for it."""
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join(timeout)

    def depth(self) -> tuple[int, int]:
        """(waiting requests, running rows)."""
        with self.wake:
            return len(self.waiting), sum(r is not None for r in self.rows)

    def with_tokenizer(self, fn):
        """Run fn(tokenizer) under the tokenizer's lock."""
        with self.tok_lock:
            return fn(self.tokenizer)

    # ------------------------------------------------------------------------------ the loop

    def _main(self) -> None:
        try:
            self._build()
            self.ready.set()
            while self._next():
                pass
            reason = "cancelled"
        except Exception as e:  # a bug or a device failure: every request hears of it, then the server is unhealthy
            reason, self.failed = "error", out_of_memory(e) or f"{type(e).__name__}: {e}"
            self.ready.set()
            self.on_failure()
        with self.wake:
            self.stopping = True
            pending = [r for r in self.rows if r is not None] + list(self.waiting)
            self.rows, self.waiting = [None] * self.B, deque()
        for r in pending:
            r.on_event(Event(finish_reason=reason, error=self.failed, prompt_tokens=len(r.prompt),
                             completion_tokens=len(r.tokens)))

    def _build(self) -> None:
        """The batch: B placeholder rows prefilled with one token and done at once, so every request enters
        through refill; then one refill per prompt width a request can have, so nothing compiles once requests
        are served (a compile in the loop would stall every row for seconds)."""
        dec, B = self.dec, self.B
        greedy = [SamplingParams()] * B
        if dec.method == "ar":
            slots = max(round_up(self.ctx + self.chunk, 32), prompt_width(self.ctx) + self.chunk)
            run = dec.prefill([[0]] * B, 1, max_len=slots, out_len=self.chunk, sampling=greedy)
        else:
            run = dec.prefill([[0]] * B, 1, max_len=dec.spec_max_len(self.ctx, 0),
                              out_len=round_up(self.ctx, 64) + dec.settings.round_tokens, sampling=greedy)
        # the buffers are allocated now: wait, so that a failed allocation (out of device memory) is raised here (a
        # program that takes a failed one's outputs can wait for ever instead)
        jax.block_until_ready(run.state)
        for width in sorted({dec.refill_width(run, n) for n in range(1, self.ctx)}):
            dec.refill(run, [0], [[0] * min(width, self.ctx - 1)], [1], jax.random.key(0)[None], sampling=greedy[:1])
        self.run = dec.decode(run, 1, budget=self.budgets.get(B))  # compiles the loop without a step (all done)
        if dec.method != "ar":  # and the loops over fewer live rows (Decoder.decode)
            for n in sorted({live_rows(n, B, data_parallel(dec.model)) for n in range(1, B)} - {B}):
                dec.decode(self.run, 1, live=list(range(n)), budget=self.budgets.get(n))
        jax.block_until_ready(self.run.state)

    def _next(self) -> bool:
        """One turn: drop cancelled rows, admit waiting requests, decode a chunk, stream. False to stop."""
        with self.wake:
            while not self.stopping and not self.waiting and all(r is None for r in self.rows):
                self.wake.wait()
            if self.stopping:
                return False
            for q in [q for q in self.waiting if q.cancelled]:
                self.waiting.remove(q)
                self._finish_waiting(q)
            dropped = [b for b, r in enumerate(self.rows) if r is not None and r.cancelled]
            free = [b for b, r in enumerate(self.rows) if r is None or r.cancelled]
            admit = [self.waiting.popleft() for _ in range(min(len(free), len(self.waiting)))]
        if dropped:
            self.dec.cancel(self.run, dropped)
            for b in dropped:
                self._finish(b, "cancelled")
        if admit:
            self._admit(free[: len(admit)], admit)
        if any(r is not None for r in self.rows):
            self._decode()
        return True

    def _admit(self, slots: list[int], reqs: list[Request]) -> None:
        """Prefill each request into its row, one at a time: one refill program per prompt width, all compiled
        by _build, where groups would need one per (group size, width)."""
        dec, run = self.dec, self.run
        for b, r in zip(slots, reqs):
            seed = r.seed if r.seed is not None else time.time_ns() % (1 << 62)
            key = jax.random.split(jax.random.key(seed), 1)  # generate(seed=)'s stream for one prompt
            first = dec.refill(run, [b], [r.prompt], [r.max_tokens], key, sampling=[r.sampling])[0]
            r.first_token_at = time.perf_counter()
            with self.wake:
                self.rows[b] = r
            self._emit(b, [first], done=first in dec.eos or r.max_tokens <= 1)

    def _decode(self) -> None:
        dec, run = self.dec, self.run
        live = [b for b, r in enumerate(self.rows) if r is not None]
        if dec.method == "ar":
            dec.make_room(run, live, self.chunk)
            dec.start_chunk(run)
            before = to_host(run.state.emitted)
            dec.decode(run, self.chunk)
            out, emitted, done = (to_host(x) for x in (run.state.out, run.state.emitted, run.state.done))
            new = {b: out[b, : emitted[b] - before[b]].tolist() for b in live}
        else:
            budget = self.budgets.get(live_rows(len(live), self.B, data_parallel(dec.model)))
            dec.decode(run, dec.count(run) + self.chunk, live=live, budget=budget)
            out, emitted, done = (to_host(x) for x in (run.state.out, run.state.emitted, run.state.done))
            new = {b: out[b, len(self.rows[b].tokens): emitted[b]].tolist() for b in live}
        for b in live:
            self._emit(b, new[b], done=bool(done[b]))

    # ------------------------------------------------------------------------------ text and endings

    def _emit(self, b: int, ids: list[int], done: bool) -> None:
        """Row b produced `ids`: send the text they complete, end the request at a stop string, EOS or its
        limit. Text is decoded from all the row's tokens each time (characters split over byte tokens, merges
        across tokens); a trailing U+FFFD waits for its bytes and, with stop strings, the last few characters
        wait until they cannot start one."""
        r = self.rows[b]
        start = len(r.tokens)
        r.tokens += ids
        text = self._text(r.tokens)
        hit = self._find_stop(text, r)
        if hit is not None:
            cut = next(n for n in range(start + 1, len(r.tokens) + 1) if self._find_stop(self._text(r.tokens[:n]), r))
            r.tokens = r.tokens[:cut]  # tokens past the one completing the stop string are not the answer's
            self._send(r, text[:hit])
            self.dec.cancel(self.run, [b])
            self._finish(b, "stop")
            return
        if done:
            self._send(r, text)
            self._finish(b, "stop" if r.tokens[-1] in self.dec.eos else "length")
            return
        hold = max((len(s) - 1 for s in r.stop), default=0)
        shown = len(text.rstrip("\ufffd"))
        self._send(r, text[: max(r.sent, shown - hold)])

    def _text(self, ids: list[int]) -> str:
        return self.with_tokenizer(
            lambda t: t.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    @staticmethod
    def _find_stop(text: str, r: Request) -> int | None:
        """Where the first stop string begins in text (searched from a little before the text already sent)."""
        at = [i for s in r.stop if (i := text.find(s, max(0, r.sent - len(s)))) >= 0]
        return min(at) if at else None

    @staticmethod
    def _send(r: Request, text: str) -> None:
        if len(text) > r.sent:
            r.on_event(Event(text=text[r.sent:]))
            r.sent = len(text)

    def _finish(self, b: int, reason: str) -> None:
        r = self.rows[b]
        rounds = None if self.dec.method == "ar" else int(to_host(self.run.state.rounds)[b])
        with self.wake:
            self.rows[b] = None
        r.on_event(Event(finish_reason=reason, prompt_tokens=len(r.prompt), completion_tokens=len(r.tokens)))
        self.on_finish(r, rounds)

    @staticmethod
    def _finish_waiting(r: Request) -> None:
        r.on_event(Event(finish_reason="cancelled", prompt_tokens=len(r.prompt)))
