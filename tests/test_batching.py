"""Continuous batching (jaxspec/batching.py): every answer equals the prompt decoded alone by `generate`."""
import collections

import numpy as np
import pytest

import jaxspec
from jaxspec.batching import generate_many
from jaxspec.sampling import SamplingParams
from test_cache import TARGETS
from test_engine import PROMPT, tiny_target
from test_sampling import check_distribution, exact_levels, sampling_target

FAMILIES = {
    "qwen3": lambda: tiny_target("qwen3"),
    "gemma3": lambda: tiny_target("gemma3"),  # sliding window: key positions follow each row's start
    "qwen3_5": lambda: jaxspec.random_model(TARGETS["qwen3_5"](), seed=1),  # recurrent state per row
    "deepseek_v3": lambda: jaxspec.random_model(TARGETS["deepseek_v3"](), seed=1),  # latent KV
}


def with_eos(model, prompts):
    """The model with an EOS id its greedy answers actually produce, so some rows stop early."""
    outs = [jaxspec.generate(model, input_ids=p, method="ar", max_new_tokens=30).token_ids for p in prompts[:3]]
    eos = collections.Counter(sum(outs, [])).most_common(1)[0][0]
    model.config = model.config.replace(eos_token_ids=(eos,))
    return model


def queue(family: str, n: int, most: int, seed: int):
    """(model with an EOS its answers produce, n prompts of 1 to 60 tokens, limits below `most`, each prompt's AR
    answer alone)."""
    rng = np.random.default_rng(seed)
    model = FAMILIES[family]()
    prompts = [rng.integers(0, model.config.vocab_size, int(rng.integers(1, 61))).tolist() for _ in range(n)]
    limits = rng.integers(1, most, n).tolist()
    model = with_eos(model, prompts)
    want = [jaxspec.generate(model, input_ids=p, method="ar", max_new_tokens=m).token_ids
            for p, m in zip(prompts, limits)]
    return model, prompts, limits, want


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_answers_equal_generate_alone(family):
    """9 prompts (1 to 60 tokens, limits 1 to 45) through 3 slots refilled every 4 steps: rows start, slide
    and stop at different times, and each answer is the one `generate` gives the prompt alone."""
    model, prompts, limits, want = queue(family, 9, 46, seed=0)
    done = []
    got = generate_many(model, prompts, limits, batch=3, chunk=4, on_done=done.append)
    assert got == want
    assert done == list(range(1, 10))
    assert any(len(w) < m for w, m in zip(want, limits)), "no answer stopped at EOS"


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "deepseek_v3"])
def test_speculative_answers_equal_generate_alone(family):
    """The same queue through 3 DDTree slots (a random drafter; prompt lookup on, so some drafts are accepted):
    rows refilled at any length and round, each answer the target's greedy one."""
    model, prompts, limits, want = queue(family, 7, 40, seed=4)
    d = jaxspec.init_drafter(model, num_layers=1, block_size=8, seed=2)
    done = []
    got = generate_many(model, prompts, limits, batch=3, chunk=6, drafter=d, method="ddtree", budget=6,
                        on_done=done.append)
    assert got == want
    assert done == list(range(1, 8))


def test_a_refill_wider_than_the_first_prompts():
    """A waiting prompt whose padded width (65 tokens: 128 slots) exceeds what the first prompts and the limits
    alone would size the cache for: it enters a freed row like any other, and its answer is generate's."""
    model = tiny_target("qwen3")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (5, 5, 65)]
    limits = [3, 3, 5]
    want = [jaxspec.generate(model, input_ids=p, method="ar", max_new_tokens=m).token_ids
            for p, m in zip(prompts, limits)]
    assert generate_many(model, prompts, limits, batch=2, chunk=16) == want


def test_sampling_is_seeded_and_within_limits():
    model = tiny_target("qwen3")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 128, int(rng.integers(1, 30))).tolist() for _ in range(5)]
    a = generate_many(model, prompts, 12, batch=2, chunk=4, temperature=1.0, seed=3)
    b = generate_many(model, prompts, 12, batch=2, chunk=4, temperature=1.0, seed=3)
    greedy = generate_many(model, prompts, 12, batch=2, chunk=4)
    assert a == b and a != greedy and all(len(x) == 12 for x in a)


def test_sampled_answers_follow_the_target():
    """Sampled rows are exact draws wherever they land: 1500 copies of PROMPT among 500 other prompts (1-40
    tokens, 1-9 new tokens each) through 16 slots refilled every 2 steps, so PROMPT starts in every slot, at
    many offsets, before and after slides. Its tokens 1-3 (marginals and consecutive pairs) must follow the
    exact filtered target probabilities (chi-square, p > 1e-3)."""
    model = sampling_target(3.0)
    sp = SamplingParams(0.8, 12, 0.9)
    rng = np.random.default_rng(2)
    n = 2000
    mine = set(rng.choice(n, 1500, replace=False).tolist())
    prompts = [PROMPT if i in mine else rng.integers(0, 128, int(rng.integers(1, 41))).tolist() for i in range(n)]
    limits = [3 if i in mine else int(rng.integers(1, 10)) for i in range(n)]
    got = generate_many(model, prompts, limits, batch=16, chunk=2, temperature=sp.temperature, top_k=sp.top_k,
                        top_p=sp.top_p, seed=5)
    check_distribution([got[i] for i in sorted(mine)], exact_levels(model, sp, 3), 3, "continuous batching")


def test_bad_inputs():
    model = tiny_target("qwen3")
    ctx = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="exceeds the model's context"):
        generate_many(model, [[1, 2], [1] * ctx], 4)
    with pytest.raises(ValueError, match="max_new_tokens for"):
        generate_many(model, [[1, 2], [3]], [4])
    with pytest.raises(ValueError, match="at least one token"):
        generate_many(model, [[]], 4)
    assert generate_many(model, [], 4) == []
