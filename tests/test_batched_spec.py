"""Speculative decoding for a batch: B rows in one round, each with its own tree, acceptance, commit and length.

Greedy decoding is deterministic, so a row of a batch must do exactly what its prompt does alone: the same
tokens and the same rounds, acceptance histogram and verified nodes. Any leak between rows (a cache slot, a
recurrent state, a mask, a length, a drafter context) changes some row's acceptance or tokens. Checked for every
family with the oracle drafter (deep paths), with random drafters and per-row EOS / max_new_tokens ending rows at
different rounds, and for sampling per row (chi-square against the exact target distribution).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.decoder import Decoder
from jaxspec.models.deepseek import deepseek_config_from_dict
from jaxspec.models.gemma4 import gemma4_config_from_dict
from jaxspec.sampling import SamplingParams
from jaxspec.testing import oracle_drafter
from test_deepseek_engine import CONFIG as DEEPSEEK
from test_engine import tiny_target
from test_engine_gdn import hybrid_target
from test_gemma4 import ENGINE as GEMMA4
from test_sampling import check_distribution, exact_levels, sampling_target

NEW = 40
RNG = np.random.RandomState(5)
PROMPTS = [RNG.randint(0, 128, n).tolist() for n in (13, 5, 29)]  # different lengths: rows' lengths differ


def deepseek_target(absorb_max_tokens: int = 20):
    # the 29-token row prefills expanded
    cfg = deepseek_config_from_dict(DEEPSEEK).replace(absorb_max_tokens=absorb_max_tokens)
    m = jaxspec.random_model(cfg, seed=0)
    m.params = jax.tree.map(lambda x: x * 2.5, m.params)
    return m


def gemma4_target():
    m = jaxspec.random_model(gemma4_config_from_dict(GEMMA4), seed=0)  # shared KV, sliding window 8, MoE, PLE
    m.params = jax.tree.map(lambda x: x * 2.0, m.params)
    return m


FAMILIES = {"llama": lambda: tiny_target("llama"), "qwen3_5": hybrid_target, "deepseek_v3": deepseek_target,
            "gemma4": gemma4_target}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """(target, each prompt's AR greedy continuation)."""
    m = FAMILIES[request.param]()
    return m, [jaxspec.generate(m, input_ids=p, method="ar", max_new_tokens=NEW).token_ids for p in PROMPTS]


def row_view(stats: dict) -> tuple:
    return stats["rounds"], stats["accepted_length_histogram"], stats["budget_utilisation"]


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 12)])
def test_rows_do_what_they_do_alone(family, method, budget):
    """Oracle drafter with noise (deep paths and accepted siblings): each row's tokens equal its AR greedy output,
    and its rounds, acceptance histogram and tree use equal the prompt's run alone."""
    m, refs = family
    full = [p + r for p, r in zip(PROMPTS, refs)]
    batch = jaxspec.generate(m, input_ids=PROMPTS, drafter=oracle_drafter(m, full, noise=0.3), method=method,
                             budget=budget, max_new_tokens=NEW)
    assert batch.token_ids == refs
    alone = [jaxspec.generate(m, input_ids=p, drafter=oracle_drafter(m, f, noise=0.3), method=method, budget=budget,
                              max_new_tokens=NEW).stats for p, f in zip(PROMPTS, full)]
    assert [row_view(s) for s in batch.stats.per_row] == [row_view(s) for s in alone]
    assert batch.stats.acceptance_length > 2.0  # deep paths were accepted
    assert batch.stats.rounds == sum(s.rounds for s in alone)


def test_rows_end_at_different_rounds(family):
    """A random drafter, an EOS token that ends one row early and per-row max_new_tokens: each row's tokens equal
    its AR output under the same stops, its statistics its own run alone; finished rows stop growing."""
    m, refs = family
    eos = (refs[0][7],)  # row 0 stops at its 8th token (or earlier if that token comes before)
    limits = [NEW, 11, 26]
    d = jaxspec.init_drafter(m, num_layers=1, block_size=8, seed=4)

    def run(rows, limit, method, budget=None):
        dec = Decoder(m, d if method != "ar" else None, method=method, budget=budget, eos=eos)
        r = dec.decode(dec.prefill(rows, limit), 10 ** 6)
        return dec.tokens(r), (dec.row_stats(r) if method != "ar" else None)

    want = [run([p], n, "ar")[0][0] for p, n in zip(PROMPTS, limits)]
    assert len(want[0]) <= 8 and want[0][-1] == eos[0] and len(set(map(len, want))) == 3  # rows end apart
    got, stats = run(PROMPTS, limits, "ddtree", 6)
    assert got == want
    alone = [run([p], n, "ddtree", 6)[1][0] for p, n in zip(PROMPTS, limits)]
    assert [row_view(s) for s in stats] == [row_view(s) for s in alone]


def test_finished_rows_stop_growing():
    """Decoding in chunks: a row that finished keeps its tokens and statistics while the others go on."""
    m = tiny_target("qwen3")
    d = jaxspec.init_drafter(m, num_layers=1, block_size=8, seed=1)
    dec = Decoder(m, d, method="ddtree", budget=4)
    run = dec.prefill(PROMPTS, [4, NEW, NEW])
    run = dec.decode(run, 4)
    before = dec.tokens(run)[0], dec.row_stats(run)[0]
    assert len(before[0]) == 4 and not dec.finished(run)
    run = dec.decode(run, 10 ** 6)
    assert (dec.tokens(run)[0], dec.row_stats(run)[0]) == before
    assert [len(t) for t in dec.tokens(run)] == [4, NEW, NEW]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_sampling_per_row(family):
    """DDTree sampling on a batch of two different prompts (each row its own rng stream): each prompt's tokens 1-3
    follow its exact target distribution (marginals and consecutive pairs, chi-square p > 1e-3)."""
    model = sampling_target(3.0, family=family)
    sp = SamplingParams(temperature=1.0, top_k=12, top_p=0.95)
    prompts = [PROMPTS[0], PROMPTS[1]]
    greedy = [jaxspec.generate(model, input_ids=p, max_new_tokens=16).token_ids for p in prompts]
    rows = prompts * 16
    d = oracle_drafter(model, [p + g for p, g in zip(prompts, greedy)] * 16, noise=0.5, max_rank=2, block_size=4)
    samples = [[], []]
    for seed in range(63):  # 1008 samples per prompt
        res = jaxspec.generate(model, input_ids=rows, drafter=d, method="ddtree", budget=8, max_new_tokens=3,
                               temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, seed=seed)
        for b, ids in enumerate(res.token_ids):
            samples[b % 2].append(ids)
    for b, p in enumerate(prompts):
        check_distribution(samples[b], exact_levels(model, sp, 3, prompt=p), 3, f"{family} row {b}")


def test_batch_errors_name_the_row():
    m = tiny_target("llama")
    d = jaxspec.init_drafter(m, num_layers=1, block_size=8, seed=4)
    with pytest.raises(ValueError, match=r"empty prompt \(row 2 of the batch\)"):
        jaxspec.generate(m, input_ids=[PROMPTS[0], PROMPTS[1], []], drafter=d)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 128\) \(row 1 of the batch\)"):
        jaxspec.generate(m, input_ids=[PROMPTS[0], [1, 500]], drafter=d)


def test_decoder_refuses_what_it_cannot_run():
    m = tiny_target("llama")
    dec = Decoder(m, jaxspec.init_drafter(m, num_layers=1, block_size=8, seed=4), method="ddtree", budget=4)
    with pytest.raises(ValueError, match="2 max_new_tokens for 3 prompts"):
        dec.prefill(PROMPTS, [8, 8])
    with pytest.raises(ValueError, match=r"max_new_tokens must be a positive integer \(row 1 of the batch\)"):
        dec.prefill(PROMPTS, [8, 0, 8])
    run = dec.prefill(PROMPTS[:2], 8)
    with pytest.raises(ValueError, match="distinct rows of the batch's 2"):
        dec.refill(run, [2], [PROMPTS[0]], [8])
    with pytest.raises(ValueError, match="cache slots"):
        dec.refill(run, [0], [PROMPTS[0] * 20], [8])
    with pytest.raises(ValueError, match=r"empty prompt \(row 0 of the batch\)"):
        dec.refill(run, [0], [[]], [8])


def test_rows_sample_independently():
    """Two copies of one prompt in a batch draw different continuations (one rng stream per row)."""
    m = tiny_target("qwen3")
    d = jaxspec.init_drafter(m, num_layers=1, block_size=8, seed=4)
    res = jaxspec.generate(m, input_ids=[PROMPTS[0]] * 4, drafter=d, method="ddtree", budget=4, max_new_tokens=12,
                           temperature=1.5)
    assert len({tuple(t) for t in res.token_ids}) > 1
    assert jnp.asarray(res.stats.per_row[0]["rounds"]) > 0
