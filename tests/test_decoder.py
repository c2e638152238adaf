"""The decoder's host side: the statistics' two views, the call's wall time, and the continuous-batching
buffer size (the decoding itself is held to AR and to each prompt alone in test_engine.py and
test_batching.py)."""
import json

import numpy as np
import pytest

import jaxspec
from jaxspec.decoder import PROMPT_BUCKET, Decoder, Stats
from test_engine import PROMPT, tiny_target


def test_stats_read_as_attributes_and_as_a_dict():
    s = Stats(method="ar", prompt_tokens=[3], new_tokens=4, steps=4, prefill_s=0.5, decode_s=0.25,
              tokens_per_second=12.0, acceptance_length=1.0)
    assert s["steps"] == s.steps == 4
    assert "rounds" not in s and s.get("rounds") is None  # a speculative field, absent from an AR run
    assert set(json.loads(json.dumps(dict(s)))) == {"method", "prompt_tokens", "new_tokens", "steps", "prefill_s",
                                                    "decode_s", "tokens_per_second", "acceptance_length"}


def test_wall_time_covers_the_whole_call():
    m = tiny_target("qwen3")
    d = jaxspec.init_drafter(m, num_layers=1, block_size=4)
    for res in (jaxspec.generate(m, input_ids=PROMPT, max_new_tokens=8),
                jaxspec.generate(m, input_ids=PROMPT, drafter=d, max_new_tokens=8)):
        st = res.stats
        assert st["wall_s"] >= st["prefill_s"] + st["decode_s"] > 0


def test_queue_slots_hold_every_row_and_the_widest_refill():
    prompts, limits = [[1] * 5, [1] * 5, [1] * 65], [3, 3, 5]
    n = Decoder.slots_for_queue(prompts, limits, chunk=16)
    assert n >= 70 + 16 and n >= 2 * PROMPT_BUCKET and n % 32 == 0


def test_ar_refill_refuses_a_prompt_wider_than_the_batch():
    m = tiny_target("qwen3")
    dec = Decoder(m)
    run = dec.prefill([PROMPT, PROMPT], 8)  # a batch's buffer starts at its prompt's 64 slots + a 64-slot window
    with pytest.raises(ValueError, match="a prompt of 300 tokens fills 320 cache slots, more than the batch's 128"):
        dec.refill(run, [0], [[1] * 300], [4])


def test_decode_over_the_live_rows_alone():
    """A speculative batch of 4 with rows 1 and 3 done decodes rows 0 and 2 in 2-row rounds (and row 2 alone in
    1-row rounds): each live row gets the tokens and rounds of the full 4-row decode, and the idle rows are left
    as they were."""
    m = tiny_target("qwen3")
    d = jaxspec.init_drafter(m, num_layers=1, block_size=4, seed=1)
    dec = Decoder(m, d, method="ddtree", budget=4)
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:], PROMPT[:7]]

    def run(live):
        r = dec.prefill(prompts, 12)
        dec.cancel(r, [1, 3])
        before = {name: np.asarray(getattr(r.state, name)) for name in ("out", "emitted", "rounds", "bonus")}
        dec.decode(r, 100, live=live)
        return before, r

    with pytest.raises(ValueError, match="budget >= 8"):
        dec.settings_for(8)  # a state sized for budget 4 cannot run rounds of 8
    _, full = run(None)
    for live in ([0, 2], [2]):
        before, part = run(live)
        for b in range(4):
            for name in ("out", "emitted", "rounds", "bonus"):
                got = np.asarray(getattr(part.state, name))[b]
                want = (np.asarray(getattr(full.state, name)) if b in live else before[name])[b]
                np.testing.assert_array_equal(got, want, err_msg=f"live {live}, row {b}, {name}")


def test_budget_zero_rounds_are_ar_steps():
    """Rounds at budget 0 (what `auto` picks where no tree beats AR) draft nothing and verify each row's bonus
    alone: one token per round, AR's tokens. The drafter's context still takes every committed token, as a fresh
    prefill of the same tokens builds it, so trees can come back on the same state and stay lossless."""
    m = tiny_target("qwen3")
    d = jaxspec.init_drafter(m, num_layers=1, block_size=4, seed=1)
    dec = Decoder(m, d, method="ddtree", budget=4)
    prompts = [PROMPT, PROMPT[:5]]
    want = [jaxspec.generate(m, input_ids=p, method="ar", max_new_tokens=16).token_ids for p in prompts]
    r = dec.prefill(prompts, 16)
    dec.decode(r, 7, budget=0)
    s = r.state
    emitted, rounds = np.asarray(s.emitted), np.asarray(s.rounds)
    np.testing.assert_array_equal(rounds, emitted - 1)  # one token per round
    assert np.asarray(s.accepted_hist)[:, 1:].sum() == 0 and np.asarray(s.tree_nodes).sum() == 0
    done = dec.tokens(r)
    assert all(got == w[: len(got)] for got, w in zip(done, want))

    fresh = dec.prefill([p + t[:-1] for p, t in zip(prompts, done)], 4)  # the committed tokens, prefilled
    for b, (p, t) in enumerate(zip(prompts, done)):
        n = len(p) + len(t) - 1
        assert int(s.draft_cache.length[b]) == int(fresh.state.draft_cache.length[b]) == n
        for old, new in zip(s.draft_cache.layers, fresh.state.draft_cache.layers):
            np.testing.assert_allclose(np.asarray(old.k)[b, :, :n], np.asarray(new.k)[b, :, :n], atol=2e-5)
            np.testing.assert_allclose(np.asarray(old.v)[b, :, :n], np.asarray(new.v)[b, :, :n], atol=2e-5)

    dec.decode(r, 16)  # trees again, on the same state
    assert dec.tokens(r) == want and np.asarray(r.state.tree_nodes).sum() > 0
