"""budget="auto": the best measured entry of the drafter's acceptance table at this machine's costs."""
import dataclasses
import json

import numpy as np
import pytest

import jaxspec
from jaxspec import budget as budget_mod
from jaxspec import engine
from jaxspec.budget import best_budget, larger_can_win
from jaxspec.drafter import read_acceptance
from test_engine import PROMPT, tiny_target


def test_best_budget_is_the_fastest_entry():
    # AR step 10 ms; a round grows with the tree: rates 1.8/16 = .1125, 2.4/22 = .109, 3.0/42 tokens per ms
    acceptance = {4: 1.8, 8: 2.4, 32: 3.0}
    rounds = {4: 0.016, 8: 0.022, 32: 0.042}
    b, speedup = best_budget(acceptance, 0.010, rounds)
    assert b == 4
    assert speedup[4] == pytest.approx(1.8 * 10 / 16) and speedup[32] == pytest.approx(3.0 * 10 / 42)
    b, _ = best_budget(acceptance, 0.010, {4: 0.016, 8: 0.017, 32: 0.042})  # a cheap 8-node round
    assert b == 8


def test_timing_stops_once_no_larger_budget_can_win():
    acceptance = {2: 1.8, 4: 2.0, 8: 2.3, 16: 2.4, 64: 2.7}
    assert larger_can_win(acceptance, {2: 0.011})  # 2.7 / 11 ms could still beat 1.8 / 11 ms
    assert larger_can_win(acceptance, {2: 0.011, 4: 0.012, 8: 0.016})  # 2.7 / 16 = .169 >= 2.0 / 12 = .167
    assert not larger_can_win(acceptance, {2: 0.011, 4: 0.012, 8: 0.017})  # 2.7 / 17 = .159 < 2.0 / 12 = .167
    assert not larger_can_win({2: 1.8, 4: 1.8}, {2: 0.011, 4: 0.012})


def test_read_acceptance(tmp_path):
    assert read_acceptance(tmp_path) is None
    (tmp_path / "acceptance.json").write_text(json.dumps({"acceptance_length": {"4": 1.8, "16": 2.1}}))
    assert read_acceptance(tmp_path) == {4: 1.8, 16: 2.1}
    (tmp_path / "acceptance.json").write_text("{not json")
    with pytest.raises(ValueError, match="bench/spec.py --save-acceptance"):
        read_acceptance(tmp_path)
    (tmp_path / "acceptance.json").write_text(json.dumps({"acceptance_length": {"0": 1.8}}))
    with pytest.raises(ValueError, match="no valid entries"):
        read_acceptance(tmp_path)


def test_auto_measures_once_and_stays_lossless(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path / "cache"))
    m = tiny_target("qwen3")
    d = jaxspec.init_drafter(m, num_layers=1, block_size=8, seed=3)
    want = jaxspec.generate(m, input_ids=PROMPT, method="ar", max_new_tokens=24).token_ids

    res = jaxspec.generate(m, input_ids=PROMPT, drafter=d, budget="auto", max_new_tokens=24)
    assert res.stats["budget"] == 7 and res.stats["budget_source"].startswith("default")  # no table: block_size - 1

    d.save(tmp_path / "d")
    (tmp_path / "d" / "acceptance.json").write_text(json.dumps({"acceptance_length": {"2": 1.5, "6": 1.9}}))
    d = jaxspec.load_drafter(tmp_path / "d", m)
    assert d.acceptance == {2: 1.5, 6: 1.9}
    res = jaxspec.generate(m, input_ids=PROMPT, drafter=d, budget="auto", max_new_tokens=24)
    assert res.stats["budget_source"] == "auto" and res.stats["budget"] in (2, 6)
    assert "2" in res.stats["predicted_speedup"] and set(res.stats["predicted_speedup"]) <= {"2", "6"}
    assert res.token_ids == want
    (c,) = json.loads((tmp_path / "cache" / "costs.json").read_text()).values()
    assert set(c["round_s"]) == set(res.stats["predicted_speedup"]) and c["ar_step_s"] > 0
    assert min(c["round_s"].values()) > 0

    monkeypatch.setattr(budget_mod, "measure_costs", lambda *a: pytest.fail("costs were not read from the cache"))
    again = jaxspec.generate(m, input_ids=PROMPT, drafter=d, budget="auto", max_new_tokens=24)
    assert again.stats["budget"] == res.stats["budget"]

    d.save(tmp_path / "d2")  # the table travels with the weights
    assert read_acceptance(tmp_path / "d2") == {2: 1.5, 6: 1.9}


def test_bad_budget():
    m = tiny_target("qwen3")
    d = jaxspec.init_drafter(m, num_layers=1, block_size=8, seed=3)
    for bad in ("fast", 0, 2.5):
        with pytest.raises(ValueError, match="or 'auto'"):
            jaxspec.generate(m, input_ids=PROMPT, drafter=d, budget=bad, max_new_tokens=4)


class CharTokenizer:
    """One token per character (mod 128), no chat template: an encoding the test can write out by hand."""
    chat_template = None

    def encode(self, text):
        return [ord(c) % 128 for c in text]


def test_costs_are_timed_after_text(monkeypatch):
    """With a tokenizer the rounds are timed after COST_PROMPT as generate encodes it (its last COST_CONTEXT // 2
    tokens: trees and lookup chains shaped as in use); a model without one gets random tokens."""
    m = tiny_target("qwen3")
    d = jaxspec.init_drafter(m, num_layers=1, block_size=8, seed=3)
    seen, prefill = [], engine.spec_prefill

    def spy(tg, tp, dg, dp, tokens, *args, **kwargs):  # the prompt each budget's rounds are timed after
        seen.append(np.asarray(tokens)[0].tolist())
        return prefill(tg, tp, dg, dp, tokens, *args, **kwargs)

    monkeypatch.setattr(engine, "spec_prefill", spy)
    budget_mod.measure_costs(dataclasses.replace(m, tokenizer=CharTokenizer()), d, {2: 1.5}, reps=2)
    assert seen == [[ord(c) % 128 for c in budget_mod.COST_PROMPT][-(budget_mod.COST_CONTEXT // 2):]]
    plain = budget_mod.cost_prompt(m, 16)
    assert len(plain) == 16 and all(0 <= t < m.config.vocab_size for t in plain)
