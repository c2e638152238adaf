"""budget="auto": the best measured entry of the drafter's acceptance table at this machine's costs."""
import dataclasses
import importlib.metadata
import json
import logging
import math
import os

import jax
import numpy as np
import pytest

import jaxspec
from jaxspec import budget as budget_mod
from jaxspec import engine
from jaxspec.budget import best_budget, larger_can_win
from jaxspec.decoder import Decoder
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
    b, speedup = best_budget(acceptance, 0.010, {4: 0.019, 8: 0.025, 32: 0.042})  # a batch where no tree pays
    assert b == 0 and max(speedup.values()) < 1


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
    (tmp_path / "acceptance.json").write_text(json.dumps({"acceptance_length": {}}))
    with pytest.raises(ValueError, match="no valid entries"):
        read_acceptance(tmp_path)


@pytest.mark.parametrize("table", [{"0": 1.8}, {"1025": 2.0}, {"100000": 2.0}, {"4": math.nan}, {"4": math.inf},
                                   {"4": 0.5}, {"2": 50.0}, {"2": 3.01}, {"4": 1.8, "-1": 1.0}])
def test_read_acceptance_refuses_impossible_tables(tmp_path, table):
    """Budgets as generate's `budget` accepts them ([1, 1024]); acceptance lengths finite, in [1, 1 + budget]."""
    f = tmp_path / "acceptance.json"
    f.write_text(json.dumps({"acceptance_length": table}))  # NaN / Infinity as Python's json writes them
    with pytest.raises(ValueError, match="bench/spec.py --save-acceptance") as e:
        read_acceptance(tmp_path)
    assert str(f) in str(e.value)


def test_read_acceptance_edges(tmp_path):
    (tmp_path / "acceptance.json").write_text(json.dumps({"acceptance_length": {"1": 1.0, "2": 3.0, "1024": 9.5}}))
    assert read_acceptance(tmp_path) == {1: 1.0, 2: 3.0, 1024: 9.5}


def picked(res) -> int:
    """auto's choice as its statistics report it: a DDTree budget, or 0 where it decoded AR."""
    st = res.stats
    if st.method == "ar":
        assert st.budget is None and st.budget_source.startswith("auto: AR"), dict(st)
        return 0
    assert st.budget_source == "auto" and st.budget is not None, dict(st)
    return st.budget


def test_auto_measures_once_and_stays_lossless(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(budget_mod, "COST_SAMPLES", 1)  # an entry settled by one run (the sampling: tests below)
    m = tiny_target("qwen3")
    d = jaxspec.init_drafter(m, num_layers=1, block_size=8, seed=3)
    want = jaxspec.generate(m, input_ids=PROMPT, method="ar", max_new_tokens=24).token_ids

    res = jaxspec.generate(m, input_ids=PROMPT, drafter=d, budget="auto", max_new_tokens=24)
    assert res.stats["budget"] == 7 and res.stats["budget_source"].startswith("default")  # no table: block_size - 1

    d.save(tmp_path / "d")
    (tmp_path / "d" / "acceptance.json").write_text(json.dumps({"acceptance_length": {"2": 2.9, "6": 6.5}}))
    d = jaxspec.load_drafter(tmp_path / "d", m)
    assert d.acceptance == {2: 2.9, 6: 6.5}
    res = jaxspec.generate(m, input_ids=PROMPT, drafter=d, budget="auto", max_new_tokens=24)
    assert picked(res) in (0, 2, 6)  # 0: this machine's timings predicted no gain (AR)
    assert "2" in res.stats["predicted_speedup"] and set(res.stats["predicted_speedup"]) <= {"2", "6"}
    assert res.token_ids == want
    (e,) = json.loads((tmp_path / "cache" / "costs.json").read_text()).values()
    (c,) = e["samples"]
    assert set(c["round_s"]) == set(res.stats["predicted_speedup"]) == set(c["spread"]) and c["ar_step_s"] > 0
    assert min(c["round_s"].values()) > 0 and min(c["spread"].values()) >= 0

    monkeypatch.setattr(budget_mod, "measure_costs", lambda *a, **k: pytest.fail("costs were not read from the cache"))
    monkeypatch.setattr(budget_mod, "_measured", {}, raising=False)  # as a new process: from the file
    again = jaxspec.generate(m, input_ids=PROMPT, drafter=d, budget="auto", max_new_tokens=24)
    assert picked(again) == picked(res)

    d.save(tmp_path / "d2")  # the table travels with the weights
    assert read_acceptance(tmp_path / "d2") == {2: 2.9, 6: 6.5}

    monkeypatch.undo()
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path / "cache"))
    rows = [PROMPT, PROMPT[:6], PROMPT[4:]]  # 3 rows: timed at a batch of 4, and still lossless
    batch = jaxspec.generate(m, input_ids=rows, drafter=d, budget="auto", max_new_tokens=24)
    assert picked(batch) in (0, 2, 6)
    assert batch.token_ids == [jaxspec.generate(m, input_ids=r, method="ar", max_new_tokens=24).token_ids
                               for r in rows]
    assert len(json.loads((tmp_path / "cache" / "costs.json").read_text())) == 2  # batch 1's entry and batch 4's


def test_auto_times_at_the_batch_size(fake_timing, monkeypatch):
    """A batch's budget comes from costs timed at its size rounded up to a power of two, kept under its own key."""
    m, d, path = fake_timing.model, fake_timing.drafter, fake_timing.path
    seen, fake = [], budget_mod.measure_costs
    monkeypatch.setattr(budget_mod, "measure_costs", lambda *a, batch=1, **k: seen.append(batch) or fake(*a, **k))
    d = dataclasses.replace(d, acceptance=TABLE)
    for b in (3, 4, 1, 1, 5):
        assert budget_mod.choose(m, d, batch=b)[0] in TABLE
    assert seen == [4, 1, 8]
    assert set(json.loads(path.read_text())) == {budget_mod._key(m, d, TABLE, True, b) for b in (1, 4, 8)}
    assert budget_mod._key(m, d, TABLE, True, 1) == budget_mod._key(m, d, TABLE, True)


def test_auto_decodes_ar_where_no_tree_pays(fake_timing):
    """Where every timed round costs more AR steps than it emits tokens (a large batch), `auto` decodes AR, and says
    so in the statistics."""
    m, d = fake_timing.model, dataclasses.replace(fake_timing.drafter, acceptance=TABLE)
    fake_timing.timings = [timing(r2=1.6, r6=2.5)]  # predicted 1.5 / 1.6 and 1.9 / 2.5 of AR's speed
    res = jaxspec.generate(m, input_ids=PROMPT, drafter=d, budget="auto", max_new_tokens=12)
    assert res.stats.method == "ar" and res.stats.budget is None and res.stats.rounds is None
    assert res.stats.budget_source.startswith("auto: AR") and res.stats.predicted_speedup == {"2": 0.938, "6": 0.76}
    assert res.token_ids == jaxspec.generate(m, input_ids=PROMPT, method="ar", max_new_tokens=12).token_ids
    faster = dataclasses.replace(d, acceptance={2: 2.0, 6: 1.9})  # a new table, timed again: 2.0 / 1.2 > 1
    assert budget_mod.choose(m, faster)[0] == 2


def test_bad_budget():
    m = tiny_target("qwen3")
    d = jaxspec.init_drafter(m, num_layers=1, block_size=8, seed=3)
    for bad in ("fast", 0, 2.5):
        with pytest.raises(ValueError, match="or 'auto'"):
            jaxspec.generate(m, input_ids=PROMPT, drafter=d, budget=bad, max_new_tokens=4)


def test_costs_wait_for_the_loops(monkeypatch):
    """A decode call returns once its loop is queued: every timed chunk must wait for the loop's result before the
    clock stops (it once timed the dispatch alone, 0.3 ms per "AR step" of a 135M model, and `auto` chose from
    noise). A batch's AR runs in one buffer, never growing it (a growth's compile timed as steps)."""
    m = tiny_target("qwen3")
    d = jaxspec.init_drafter(m, num_layers=1, block_size=8, seed=3)
    events, wait, decode = [], jax.block_until_ready, Decoder.decode

    def waited(x):
        events.append("wait")
        return wait(x)

    def decoded(self, run, stop):
        events.append(("decode", run.window >= run.full_len))
        return decode(self, run, stop)

    monkeypatch.setattr(jax, "block_until_ready", waited)
    monkeypatch.setattr(Decoder, "decode", decoded)
    c = budget_mod.measure_costs(m, d, {2: 1.5, 4: 1.7}, reps=2, batch=8)
    assert set(c["spread"]) == set(c["round_s"]) and all(0 <= x < 1 for x in c["spread"].values())
    calls = [i for i, e in enumerate(events) if e != "wait"]
    assert calls and all(events[i][1] for i in calls)  # one buffer for every run
    assert all(i + 1 < len(events) and events[i + 1] == "wait" for i in calls)  # each call waited for


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


TABLE = {2: 1.5, 6: 1.9}


def timing(r2=1.2, r6=2.0, ar=0.01, spread=0.01):
    """One process's timing as measure_costs returns it: rounds of r2 and r6 AR steps at budgets 2 and 6."""
    return dict(ar_step_s=ar, round_s={2: r2 * ar, 6: r6 * ar}, spread={2: spread, 6: spread})


FAKE = timing()


@dataclasses.dataclass
class Fake:
    """A fresh process's view of a cache in tmp_path, with measure_costs replaced: each call pops the next of
    `timings` (FAKE once they run out), restricted to the budgets asked, and records those budgets in `calls`."""
    model: object
    drafter: object
    path: object
    calls: list
    timings: list

    def costs(self):
        return budget_mod.costs(self.model, self.drafter, TABLE)

    def choose(self):
        return budget_mod.choose(self.model, dataclasses.replace(self.drafter, acceptance=TABLE))[0]

    def new_process(self):
        budget_mod._measured.clear()

    def entry(self):
        return json.loads(self.path.read_text())[budget_mod._key(self.model, self.drafter, TABLE, True)]


@pytest.fixture
def fake_timing(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(budget_mod, "_measured", {}, raising=False)
    m = tiny_target("qwen3")
    fake = Fake(m, jaxspec.init_drafter(m, num_layers=1, block_size=8, seed=3), tmp_path / "cache" / "costs.json",
                [], [])

    def measure(model, drafter, acceptance, *args, **kwargs):
        fake.calls.append(sorted(acceptance))
        t = fake.timings.pop(0) if fake.timings else FAKE
        return {k: v if k == "ar_step_s" else {b: v[b] for b in acceptance} for k, v in t.items()}

    monkeypatch.setattr(budget_mod, "measure_costs", measure)
    return fake


def same(got, want):
    """costs' result equals measure_costs' (up to the rounding of a round's conversion to AR steps and back)."""
    return got["ar_step_s"] == pytest.approx(want["ar_step_s"]) and got["round_s"] == pytest.approx(want["round_s"])


def stored(path, key):
    entry = json.loads(path.read_text())[key]
    assert entry["format"] == budget_mod.COST_FORMAT and entry["samples"]
    assert all(s["reps"] >= 2 and s["measured"] for s in entry["samples"])
    return entry


@pytest.mark.parametrize("text", ["null", "3", "[]", "[1, 2]", '"costs"', "true", "{not json", "bad utf-8"])
def test_bad_cost_file_reads_as_empty(fake_timing, text, caplog):
    """A costs.json that is no JSON object is noticed, re-timed and rewritten, never a traceback."""
    f = fake_timing
    f.path.parent.mkdir(parents=True, exist_ok=True)
    if text == "bad utf-8":
        f.path.write_bytes(b"\xff\xfe{")
    else:
        f.path.write_text(text)
    key = budget_mod._key(f.model, f.drafter, TABLE, True)
    with caplog.at_level(logging.WARNING, "jaxspec.budget"):
        assert same(f.costs(), FAKE)
    assert f.calls == [[2, 6]] and "ignoring the budget cost table" in caplog.text
    (s,) = stored(f.path, key)["samples"]
    assert s["round_s"] == {"2": 0.012, "6": 0.02} and s["spread"] == {"2": 0.01, "6": 0.01}


def sample(**kw):
    return {"ar_step_s": 0.01, "round_s": {"2": 0.012, "6": 0.02}, "spread": {"2": 0.01, "6": 0.01}, "reps": 4,
            "measured": "2026-12-06T00:00:00+00:00", **kw}


def entry(*samples, **kw):
    return {"format": budget_mod.COST_FORMAT, "retimed": False, "samples": list(samples) or [sample()], **kw}


BAD_ENTRIES = [None, 3, [], "x", {}, entry(format=budget_mod.COST_FORMAT - 1), entry(format=None),
               {"ar_step_s": 0.01, "round_s": {"2": 0.012}, "format": budget_mod.COST_FORMAT},  # format 5's layout
               entry(samples=[]), entry(samples=None), entry(samples=sample()), entry(samples=[None]),
               entry(sample(ar_step_s=0)), entry(sample(ar_step_s=-0.01)), entry(sample(ar_step_s=math.nan)),
               entry(sample(ar_step_s=math.inf)), entry(sample(ar_step_s="0.01")), entry(sample(ar_step_s=True)),
               entry(sample(round_s={})), entry(sample(round_s=[0.01])), entry(sample(round_s={"2": 0})),
               entry(sample(round_s={"2": -1.0})), entry(sample(round_s={"2": math.nan})),
               entry(sample(round_s={"2": 1e-9, "6": 0.02})), entry(sample(round_s={"x": 0.02})),
               entry(sample(round_s={"2": None})), entry(sample(spread=None)), entry(sample(spread={"2": 0.01})),
               entry(sample(spread={"2": -0.1, "6": 0.01})), entry(sample(spread={"2": math.nan, "6": 0.01})),
               entry(sample(spread={"2": math.inf, "6": 0.01})), entry(sample(spread={"2": True, "6": 0.01})),
               entry(sample(spread={"2": "0.01", "6": 0.01})), entry(sample(), sample(round_s={"2": None})),
               entry(sample(round_s={"64": 0.02}, spread={"64": 0.01}))]


@pytest.mark.parametrize("bad", BAD_ENTRIES)
def test_bad_cost_entry_is_retimed(fake_timing, bad):
    """A missing field, a non-number, zero, negative, non-finite or implausibly small seconds, a bad spread, an
    empty round table, a budget outside the acceptance table, an entry of an older format, one bad sample among
    good ones: absent, so timed again (every budget) and replaced."""
    f = fake_timing
    key = budget_mod._key(f.model, f.drafter, TABLE, True)
    f.path.parent.mkdir(parents=True, exist_ok=True)
    f.path.write_text(json.dumps({key: bad, "other": entry(sample(round_s={"2": 0.03}, spread={"2": 0.0}))}))
    assert same(f.costs(), FAKE) and f.calls == [[2, 6]]
    assert f.choose() in TABLE
    (s,) = stored(f.path, key)["samples"]
    assert s["round_s"] == {"2": 0.012, "6": 0.02}
    assert "other" in json.loads(f.path.read_text())  # another key's good entry is kept


@pytest.mark.parametrize("rounds", [{"2": 0.05, "6": 0.02}, {"2": 0.003, "6": 0.004}])
def test_good_cost_entry_is_used(fake_timing, rounds):
    """Entries as measured are read back, rounds cheaper than an AR step included (a tiny target's small tree
    can time so; CI saw a budget-2 round under half an AR step); one of COST_SAMPLES samples is not timed again."""
    f = fake_timing
    key = budget_mod._key(f.model, f.drafter, TABLE, True)
    f.path.parent.mkdir(parents=True, exist_ok=True)
    f.path.write_text(json.dumps({key: entry(*[sample(round_s=rounds)] * budget_mod.COST_SAMPLES)}))
    want = dict(ar_step_s=0.01, round_s={int(b): s for b, s in rounds.items()})
    assert same(f.costs(), want) and f.calls == []


def test_noisy_first_timing_is_outvoted(fake_timing):
    """Two identical first runs once chose budgets 8 and 4 from one timing each. The first run's timing is one
    sample; the next runs time the budgets within the noise of the best again, each adding a sample, and the
    median decides: a first timing that put budget 6 4% low (within the noise, so no re-time) is outvoted.
    Once COST_SAMPLES runs have timed, no run times again."""
    f = fake_timing
    f.timings += [timing(r6=1.50), timing(r6=1.56), timing(r6=1.56)]  # rates 1.5 / 1.2 = 1.25 against 1.9 / r6
    assert f.choose() == 6 and f.calls == [[2, 6]]  # 1.9 / 1.50 = 1.27: the noisy first timing alone says 6
    for run in range(2, budget_mod.COST_SAMPLES + 1):
        f.new_process()
        assert f.choose() == 2  # 1.9 / 1.53 (the median of 1.50 and 1.56), then 1.9 / 1.56: below 1.25
        assert f.calls[-1] == [2, 6] and len(f.calls) == run  # one timing of the two contenders, no re-time
    e = f.entry()
    assert len(e["samples"]) == budget_mod.COST_SAMPLES and e["retimed"] is False
    for _ in range(2):
        f.new_process()
        assert f.choose() == 2 and len(f.calls) == budget_mod.COST_SAMPLES  # settled: read, not timed


def test_later_runs_time_only_the_contenders(fake_timing):
    """A run after the first times only the budgets whose rate comes within the noise of the best one's; a whole
    machine running slower (a longer AR step, rounds as many AR steps as before) agrees with the stored timing."""
    f = fake_timing
    f.timings += [timing(r2=1.2, r6=2.0), timing(r2=1.23, ar=0.02, spread=0.03)]
    f.costs()  # budget 6: 1.9 / 2.0 = 0.95 tokens per AR step, far below budget 2's 1.25
    f.new_process()
    assert same(f.costs(), dict(ar_step_s=0.015, round_s={2: 0.015 * 1.215, 6: 0.015 * 2.0}))
    assert f.calls == [[2, 6], [2]]
    second = f.entry()["samples"][1]
    assert set(second["round_s"]) == {"2"} and second["spread"] == {"2": 0.03}


def test_disagreeing_timing_retimes_once(fake_timing, caplog):
    """A run whose timing lies outside the stored ones by more than the noise re-times every budget, and that
    replaces the entry; a later disagreement joins the samples (a machine noisier than its chunks show: the
    median decides), so a noisy machine is not re-timed on every run."""
    f = fake_timing
    f.timings += [timing(r6=1.5), timing(r6=1.8), timing(r6=1.62, spread=0.02)]
    f.costs()
    f.new_process()
    with caplog.at_level(logging.WARNING, "jaxspec.budget"):
        assert same(f.costs(), timing(r6=1.62))  # the re-time's
    assert f.calls == [[2, 6], [2, 6], [2, 6]]  # first run; contenders, 20% off budget 6's 1.5; every budget
    assert "disagree" in caplog.text
    e = f.entry()
    assert e["retimed"] is True and [s["round_s"]["6"] for s in e["samples"]] == [pytest.approx(0.0162)]
    f.timings += [timing(r6=1.2)]  # disagrees again: joins
    f.new_process()
    f.costs()
    assert len(f.calls) == 4
    assert [s["round_s"].get("6") for s in f.entry()["samples"]] == [pytest.approx(0.0162), pytest.approx(0.012)]


def test_agreeing_timing_is_not_retimed(fake_timing, caplog):
    """Within the noise (the larger of COST_NOISE and the chunks' spread) a timing joins without a re-time."""
    f = fake_timing
    f.timings += [timing(r6=1.5, spread=0.1), timing(r6=1.64, spread=0.01)]  # 9% off, within the first's 10%
    f.costs()
    f.new_process()
    with caplog.at_level(logging.WARNING, "jaxspec.budget"):
        f.costs()
    assert f.calls == [[2, 6], [2, 6]] and "disagree" not in caplog.text
    assert len(f.entry()["samples"]) == 2


def test_concurrent_first_runs_keep_each_others_keys(fake_timing, monkeypatch):
    """Another process that writes its entries while this one times: its other key, and its sample of this key,
    are both in the file afterwards beside this run's sample (no last writer wins)."""
    f = fake_timing
    key = budget_mod._key(f.model, f.drafter, TABLE, True)
    fake = budget_mod.measure_costs

    def racing(*args, **kwargs):
        f.path.parent.mkdir(parents=True, exist_ok=True)
        theirs = entry(sample(round_s={"2": 0.013, "6": 0.02}))
        f.path.write_text(json.dumps({"theirs": entry(), key: theirs}))  # the other process's write, during ours
        return fake(*args, **kwargs)

    monkeypatch.setattr(budget_mod, "measure_costs", racing)
    assert same(f.costs(), dict(ar_step_s=0.01, round_s={2: 0.0125, 6: 0.02}))  # the median of both runs
    on_disk = json.loads(f.path.read_text())
    assert set(on_disk) == {"theirs", key}
    assert [s["round_s"]["2"] for s in on_disk[key]["samples"]] == [0.013, pytest.approx(0.012)]
    assert not [p for p in f.path.parent.iterdir() if p.name.endswith(".tmp")]  # no temporary file left


def test_unwritable_cache_times_once_per_process(fake_timing, tmp_path, monkeypatch, caplog):
    f = fake_timing
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path / "a_file" / "cache"))  # cannot be created
    with caplog.at_level(logging.WARNING, "jaxspec.budget"):
        assert same(f.costs(), FAKE)
        assert same(f.costs(), FAKE)
    assert f.calls == [[2, 6]]
    assert "this process only" in caplog.text and "once per machine" not in caplog.text


def test_cost_key_names_the_machine_and_version(fake_timing, monkeypatch):
    """Timings depend on the cores, XLA's flags and jaxspec's own code: a copied cache must not pass for local."""
    m, d = fake_timing.model, fake_timing.drafter
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    key = budget_mod._key(m, d, TABLE, True)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    assert budget_mod._key(m, d, TABLE, True) != key
    monkeypatch.delenv("XLA_FLAGS")
    cores = os.cpu_count()
    monkeypatch.setattr(os, "cpu_count", lambda: 1234)
    assert budget_mod._key(m, d, TABLE, True) != key
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert budget_mod._key(m, d, TABLE, True) == key
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "99.0")
    budget_mod._jaxspec_version.cache_clear()
    try:
        assert budget_mod._key(m, d, TABLE, True) != key
    finally:
        budget_mod._jaxspec_version.cache_clear()
