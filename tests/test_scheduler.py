"""The serving loop (jaxspec.scheduler) without HTTP, on a tiny random Qwen3 with a character tokenizer: requests
of different lengths and limits arriving while others run, for AR (lockstep rows, slid and refilled) and DDTree
(rows with their own lengths). Every greedy answer must equal jaxspec.generate's for that prompt alone."""
from __future__ import annotations

import threading

import pytest

import jaxspec
from compiles import compiles, engine_compiles
from jaxspec.decoder import Decoder
from jaxspec.sampling import SamplingParams
from jaxspec.scheduler import Event, QueueFull, Request, Scheduler
from test_cli import char_tokenizer
from test_engine import tiny_target

CTX = 96
PROMPTS = [[5 + (7 * i + j) % 90 for j in range(n)] for i, n in enumerate([3, 40, 9, 17, 60, 1])]
LIMITS = [20, 7, 30, 12, 25, 16]


@pytest.fixture(scope="module")
def target():
    model = tiny_target("qwen3")
    model.tokenizer = char_tokenizer()
    return model


def scheduler(model, method, eos=None, **kw):
    drafter = None if method == "ar" else jaxspec.init_drafter(model, num_layers=1, block_size=8, seed=0)
    dec = Decoder(model, drafter, method=method, budget=None if method == "ar" else 4,
                  sampling=SamplingParams(per_row=True), eos=eos)
    s = Scheduler(dec, max_batch=2, max_model_len=CTX, chunk=4, **kw)
    s.start()
    assert s.ready.wait(600) and not s.failed
    return s


class Collector:
    """A request's events, and a way to wait for its end."""

    def __init__(self):
        self.events: list[Event] = []
        self.done = threading.Event()

    def __call__(self, e: Event) -> None:
        self.events.append(e)
        if e.finish_reason:
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)


@pytest.mark.parametrize("method", ["ar", "ddtree", "ar-dp2xtp2", "ddtree-dp2xtp2"])
def test_requests_arriving_while_others_run(target, method):
    """Two rows, six requests: two at first, the rest submitted once the first has streamed text, one of them
    sampled with a seed (AR: generate(seed=)'s answer). Every greedy request gets generate's tokens and text (EOS
    included where the target samples it). DDTree rounds over one live row run alone at budget 0 (AR steps, as
    `auto` picks where no tree pays), over both at the decoder's 4. Sharded (`serve --dp 2 --tp 2`: a row per
    data-parallel group, heads over two devices), every round runs both rows. Every program the loop runs was
    compiled before it took its first request."""
    model = target
    if method.endswith("dp2xtp2"):
        model, method = target.on_mesh(jaxspec.make_mesh(tp=2, dp=2)), method.split("-")[0]
    sched = scheduler(model, method, budgets={1: 0} if method == "ddtree" else None)
    try:
        reqs = [Request(p, m, on_event=Collector()) for p, m in zip(PROMPTS, LIMITS)]
        reqs[3].sampling, reqs[3].seed = SamplingParams(1.0, 20), 7
        with compiles() as compiled:
            for r in reqs[:2]:
                sched.submit(r)
            while not reqs[0].on_event.events:
                reqs[0].on_event.done.wait(0.01)
            for r in reqs[2:]:
                sched.submit(r)
            for r in reqs:
                assert r.on_event.done.wait(600)
        assert not engine_compiles(compiled), compiled
        for i, r in enumerate(reqs):
            end = r.on_event.events[-1]
            assert end.completion_tokens == len(r.tokens) <= LIMITS[i]
            assert end.finish_reason == ("stop" if r.tokens[-1] in target.eos_token_ids else "length"), i
            if i == 3:  # AR: the seed's own stream, as generate(seed=) draws it for this prompt alone
                if method == "ar":
                    assert r.tokens == jaxspec.generate(target, input_ids=PROMPTS[i], max_new_tokens=LIMITS[i],
                                                        temperature=1.0, top_k=20, seed=7).token_ids
                continue
            want = jaxspec.generate(target, input_ids=PROMPTS[i], max_new_tokens=LIMITS[i], method="ar").token_ids
            assert r.tokens == want, i
            assert r.on_event.text == target.tokenizer.decode(want, skip_special_tokens=True,
                                                              clean_up_tokenization_spaces=False)
        assert sched.depth() == (0, 0)
    finally:
        sched.stop(60)


def greedy_alone(model, prompt, n):
    """AR greedy tokens with no EOS (the decoder alone)."""
    dec = Decoder(model, eos=(-1,))
    return dec.tokens(dec.decode(dec.prefill([prompt], n), n))[0]


def test_cancel_stop_strings_and_queue_limit(target):
    """Without EOS (rows run until their limit or a cancel): a cancel frees a row for a waiting request, a full
    queue refuses, a stop string ends the text before it and keeps the tokens up to the one completing it."""
    sched = scheduler(target, "ddtree", eos=(-1,), max_queue=1)
    try:
        long = Request(PROMPTS[1], CTX - len(PROMPTS[1]), on_event=Collector())
        sched.submit(long)
        while not long.on_event.events:
            long.on_event.done.wait(0.01)
        other = Request(PROMPTS[0], CTX - len(PROMPTS[0]), on_event=Collector())
        sched.submit(other)
        while not other.on_event.events:
            other.on_event.done.wait(0.01)
        waiting = Request(PROMPTS[2], 5, on_event=Collector())
        sched.submit(waiting)  # both rows are busy: it waits, and the queue (1) is full
        with pytest.raises(QueueFull):
            sched.submit(Request(PROMPTS[3], 5))
        assert sched.depth() == (1, 2)
        sched.cancel(long)  # frees a row for the waiting request
        assert waiting.on_event.done.wait(600)
        sched.cancel(other)
        for r in (long, other):
            assert r.on_event.done.wait(600)
            assert r.on_event.events[-1].finish_reason == "cancelled" and len(r.tokens) < CTX - len(r.prompt)
        assert waiting.tokens == greedy_alone(target, PROMPTS[2], 5)
        want = greedy_alone(target, PROMPTS[2], 30)
        text = target.tokenizer.decode(want, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        stop = text[10:12]
        cut = text.index(stop)
        r = Request(PROMPTS[2], 30, stop=(stop,), on_event=Collector())
        sched.submit(r)
        assert r.on_event.done.wait(600)
        assert r.on_event.text == text[:cut] and r.on_event.events[-1].finish_reason == "stop"
        shown = lambda n: target.tokenizer.decode(want[:n], skip_special_tokens=True)  # noqa: E731
        assert r.tokens == want[: next(n for n in range(len(want) + 1) if stop in shown(n))]
        with pytest.raises(ValueError, match="context"):
            sched.submit(Request(PROMPTS[4], CTX))
    finally:
        sched.stop(60)
    assert sched.depth() == (0, 0)
