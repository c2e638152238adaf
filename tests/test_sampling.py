"""Sampling: the filter against transformers' logits processors, and sampled generation (AR, DFlash, DDTree)
against the target's exact probabilities (enumerated from model.logits): chi-square over fixed seeds, on each
token's marginal and on the joint of each pair of consecutive tokens, which adds power against dependence
between tokens (a key reused across steps or rounds, noise shared between tree nodes). Each comparison must
give p > 1e-3; the seeds are fixed, so the tests are deterministic.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import jaxspec
from jaxspec.config import dense_config_from_dict
from jaxspec.decoder import Decoder
from jaxspec.kernels import cpu as cpu_kernel
from jaxspec.kernels.xla import argmax as _argmax_xla
from jaxspec.models.deepseek import deepseek_config_from_dict
from jaxspec.models.qwen3_next import hybrid_config_from_dict
from jaxspec.sampling import RowSampling, SamplingParams, argmax, filtered_logits, row_filtered_logits
from jaxspec.testing import oracle_drafter
from test_cache import GDN, MLA
from test_engine import BASE, PROMPT, TINY, tiny_target

# ------------------------------------------------------------------------------------ filtering


def hf_filtered(logits: np.ndarray, sp: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """transformers' warpers in its own order (temperature, top-k, top-p) on torch tensors.
    Returns (tempered logits, filtered logits with -inf = removed)."""
    import torch
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores, ids = torch.tensor(logits, dtype=torch.float32), torch.zeros((logits.shape[0], 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(float(sp.temperature))(ids, scores)
    tempered = scores.numpy().copy()
    if sp.top_k:
        scores = TopKLogitsWarper(int(sp.top_k))(ids, scores)
    if sp.top_p < 1.0:  # as in transformers' generate, which adds no top-p warper at top_p = 1
        scores = TopPLogitsWarper(float(sp.top_p))(ids, scores)
    return tempered, scores.numpy()


def softmax64(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


V_FILTER = 50
FILTER_CASES = [  # (temperature, top_k, top_p); temperature != 1 throughout
    (0.7, 5, 0.9),
    (1.5, 0, 0.8),  # top-p alone
    (0.5, 10, 1.0),  # top-k alone
    (2.0, 64, 0.7),  # top_k > V: no top-k cut
    (1.3, V_FILTER, 0.95),  # top_k == V
    (0.9, 1, 0.5),  # top_k = 1: the argmax only (all of a tied maximum)
    (3.0, 20, 0.33),
    (0.25, 7, 0.999),
]


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("temperature,top_k,top_p", FILTER_CASES)
def test_filtered_logits_matches_transformers(temperature, top_k, top_p, ties):
    """Kept sets and probabilities equal transformers' Temperature -> TopK -> TopP warpers.

    One deliberate difference: at a top-p cut that falls inside a group of tied logits, transformers keeps the
    tied tokens that its sort happens to put first; jaxspec keeps the whole group (independent of token ids).
    So jaxspec's set is compared with transformers' set closed under ties; without ties they are equal.
    """
    sp = SamplingParams(temperature, top_k, top_p)
    rng = np.random.RandomState(1000 * top_k + int(100 * top_p) + ties)
    scale = rng.choice([0.3, 1.0, 3.0, 8.0], size=(256, 1))  # flat to peaked rows
    logits = (rng.randn(256, V_FILTER) * scale).astype(np.float32)
    if ties:  # a coarse grid: many exactly equal logits, at the top-k and top-p cuts too
        logits = (np.round(logits * 2) / 2).astype(np.float32)
    ours = np.asarray(filtered_logits(jnp.asarray(logits), sp))
    tempered, theirs = hf_filtered(logits, sp)
    kept_ours, kept_theirs = np.isfinite(ours), np.isfinite(theirs)
    cut = np.where(kept_theirs, tempered, np.inf).min(-1, keepdims=True)
    closed = tempered >= cut  # transformers' kept set, closed under ties
    np.testing.assert_array_equal(kept_ours, closed)
    if not ties:
        np.testing.assert_array_equal(kept_ours, kept_theirs)
    else:  # the tie case is not vacuous: ties sit exactly at the top-k cut in some rows
        if 1 <= top_k < V_FILTER:
            srt = -np.sort(-logits, axis=-1)
            assert (srt[:, top_k - 1] == srt[:, top_k]).sum() >= 5
    np.testing.assert_allclose(ours[kept_ours], tempered[kept_ours], rtol=1e-6)  # kept logits only tempered
    probs = np.asarray(jax.nn.softmax(jnp.asarray(ours), axis=-1))
    np.testing.assert_allclose(probs, softmax64(np.where(closed, tempered, -np.inf)), atol=1e-6)


@pytest.mark.parametrize("V", [1, 13, 257])
def test_argmax_is_numpys(V):
    """The greedy token, on the CPU kernel and in XLA's form: numpy's argmax (the first maximum, the first NaN
    if any) on random rows, rows with tied maxima, -inf everywhere, NaNs, and leading batch dims."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, V)).astype(np.float32)
    x[0, 1, [v % V for v in (7, 3, 200)]] = 9.0  # ties: the first wins
    x[0, 2] = -np.inf
    x[1, 0, [50 % V, 9 % V]] = np.nan
    x[1, 1, 4 % V] = np.inf
    x[1, 2, V - 1] = np.nan  # in the last block's tail
    x[2] = rng.integers(0, 3, size=(5, V))  # many ties
    for f in (argmax, _argmax_xla):
        np.testing.assert_array_equal(np.asarray(jax.jit(f)(jnp.asarray(x))), np.argmax(x, axis=-1))
    assert "jaxspec_argmax" in jax.jit(argmax).lower(jnp.asarray(x)).as_text() or not cpu_kernel.usable(x)


def test_filter_edge_cases():
    """Hand-checked cases: ties at the top-k cut stay, top_k >= V keeps everything, a tie at the top-p cut stays
    whole, and the order is temperature before top-p (the order changes the kept set here)."""
    def kept(logits, sp):
        return np.isfinite(np.asarray(filtered_logits(jnp.asarray([logits]), sp)))[0].tolist()

    x = [3.0, 1.0, 1.0, 1.0, 0.0]
    assert kept(x, SamplingParams(0.5, 2, 1.0)) == [True, True, True, True, False]  # 3 tokens tied at the cut
    assert kept(x, SamplingParams(0.5, 5, 1.0)) == [True] * 5
    assert kept(x, SamplingParams(0.5, 99, 1.0)) == [True] * 5
    # mass before the 2nd 0.3 is 0.3 < 0.5 -> kept, and the 3rd is tied with it: all three stay
    assert kept(np.log([0.3, 0.3, 0.3, 0.1]), SamplingParams(1.0, 0, 0.5)) == [True] * 3 + [False]
    # p = softmax([2, 1, 0]) = [.665, .245, .090]; at T = 2: [.506, .307, .186]. top_p = 0.6 keeps one token
    # if applied before the temperature, two after it.
    assert kept([2.0, 1.0, 0.0], SamplingParams(2.0, 0, 0.6)) == [True, True, False]


# ------------------------------------------------------------------------------ exact probabilities


def cond_dists(model, prompt, prefixes, sp, n, chunk=256):
    """Filtered next-token distributions after prompt + prefix, float64 [len(prefixes), V]. Every sequence is
    padded to prompt + n - 1 tokens (a causal forward: padding after a position does not change its logits)
    and the batch to a multiple of `chunk`, so one compiled forward (and filter) serves every level."""
    T = len(prompt) + n - 1
    seqs = np.zeros((-(-len(prefixes) // chunk) * chunk, T), np.int32)
    for j, p in enumerate(prefixes):
        seqs[j, : len(prompt) + len(p)] = list(prompt) + list(p)
    at = len(prompt) + len(prefixes[0]) - 1  # all prefixes of a level have the same length
    dist = lambda x: np.asarray(jax.nn.softmax(filtered_logits(jnp.asarray(x), sp), axis=-1), np.float64)  # noqa: E731
    out = np.concatenate([dist(model.logits(seqs[i: i + chunk])[:, at]) for i in range(0, len(seqs), chunk)])
    return out[: len(prefixes)]


def exact_levels(model, sp, n, prompt=PROMPT):
    """Enumerate generated prefixes of non-zero probability after `prompt`. Level i (0-based) = (prefixes of
    length i [as tuples], their probabilities [P_i], next-token distributions [P_i, V])."""
    prefixes, weights, levels = [()], np.ones(1), []
    for _ in range(n):
        cond = cond_dists(model, prompt, prefixes, sp, n)
        levels.append((prefixes, weights, cond))
        nxt = [(p + (int(t),), w * cond[i, t]) for i, (p, w) in enumerate(zip(prefixes, weights))
               for t in np.flatnonzero(cond[i] > 0)]
        prefixes, weights = [p for p, _ in nxt], np.array([w for _, w in nxt])
    return levels


def exact_marginals(model, sp, n):
    """Exact target distributions of generated tokens 1..n (each marginalised over the earlier ones)."""
    return [w @ cond for _, w, cond in exact_levels(model, sp, n)]


def exact_pairs(levels, i):
    """Exact joint distribution [V, V] of generated tokens (i, i + 1), 1-based, from `exact_levels`."""
    prefixes, weights, cond = levels[i]  # prefixes of length i end in token i
    V = cond.shape[1]
    last = np.zeros((len(prefixes), V))
    last[np.arange(len(prefixes)), [p[-1] for p in prefixes]] = weights
    return last.T @ cond


def chi2_pvalue(samples, probs):
    """Goodness of fit; bins with small expected counts are pooled into one."""
    counts = np.bincount(samples, minlength=len(probs)).astype(float)
    probs = np.asarray(probs, np.float64) / np.sum(probs, dtype=np.float64)
    exp = probs * len(samples)
    big = exp >= 5
    obs_b = np.append(counts[big], counts[~big].sum())
    exp_b = np.append(exp[big], exp[~big].sum())
    keep = exp_b > 0
    assert counts[probs == 0].sum() == 0, "sampled a token the target gives zero probability"
    return scipy.stats.chisquare(obs_b[keep], exp_b[keep]).pvalue


def check_distribution(samples, levels, n, what):
    """Chi-square of every token's marginal and every consecutive pair's joint among tokens 1..n."""
    samples = np.asarray(samples)  # [runs, >= n]
    V = levels[0][2].shape[1]
    for i in range(n):
        p = chi2_pvalue(samples[:, i], levels[i][1] @ levels[i][2])
        assert p > 1e-3, f"{what}: token {i + 1} marginal, p = {p:.2e}"
    for i in range(1, n):
        p = chi2_pvalue(samples[:, i - 1] * V + samples[:, i], exact_pairs(levels, i).reshape(-1))
        assert p > 1e-3, f"{what}: tokens ({i}, {i + 1}) joint, p = {p:.2e}"


SMALL = dict(vocab_size=128, max_position_embeddings=512, eos_token_id=None, bos_token_id=None)  # PROMPT's vocab
SAMPLING_FAMILIES = {
    "qwen3": lambda: dense_config_from_dict({**BASE, **TINY["qwen3"]}),
    # hybrid: GDN, GDN, attention layers, each followed by a sparse MoE (4 experts, top 2) and a shared expert
    "qwen3_next": lambda: hybrid_config_from_dict({**GDN, **SMALL, "model_type": "qwen3_next", "num_experts": 4,
                                                   "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                                   "shared_expert_intermediate_size": 32}),
    # MLA + MoE (group-limited routing): verify (at most 1 + 8 nodes) runs the absorbed attention and gathers
    # experts; the exact reference (17-token forwards, batches of 256) runs the expanded form and ragged experts
    "deepseek_v3": lambda: deepseek_config_from_dict({**MLA, **SMALL, "model_type": "deepseek_v3"}).replace(
        absorb_max_tokens=9),
}


def sampling_target(scale, seed=7, family="qwen3"):
    """A random target with its params scaled: larger scale = more peaked, so deep acceptance happens. DeepSeek's
    router also gets a random correction bias (selection only), as a real checkpoint has."""
    m = jaxspec.random_model(SAMPLING_FAMILIES[family](), seed=seed)
    m.params = jax.tree.map(lambda x: x * scale, m.params)
    if family == "deepseek_v3":
        for layer in range(m.config.first_k_dense_replace, m.config.num_layers):
            bias = m.params["layers"][layer]["mlp"]["gate"]["e_score_correction_bias"]
            bias.set_value(jax.random.normal(jax.random.key(layer), bias.shape) * 0.3)
    return m


# ------------------------------------------------------------------------------------------ AR


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.6, 8, 0.9), (1.5, 20, 0.8)])
def test_ar_sampling_exact(temperature, top_k, top_p):
    """AR sampling: tokens 1-3 (marginals and consecutive pairs) follow the exact filtered target probabilities
    computed from model.logits; 2000 samples = 100 fixed seeds x a batch of 20 copies of the prompt (the rows
    of a batch must be independent draws too)."""
    model = sampling_target(3.0)
    sp = SamplingParams(temperature, top_k, top_p)
    levels = exact_levels(model, sp, 3)
    samples = []
    for seed in range(100):
        samples += jaxspec.generate(model, input_ids=[PROMPT] * 20, method="ar", max_new_tokens=3,
                                    temperature=temperature, top_k=top_k, top_p=top_p, seed=seed).token_ids
    check_distribution(samples, levels, 3, f"ar T={temperature} k={top_k} p={top_p}")


# ---------------------------------------------------------------------------------- speculative


@pytest.mark.parametrize("method,budget,noise", [("dflash", None, 0.0), ("ddtree", 8, 0.5)])
def test_lossless_sampling(method, budget, noise):
    """Committed tokens follow the target distribution (chi-square per position, 2000 fixed seeds, p > 1e-3)."""
    model = tiny_target("qwen3", seed=7)
    model.params = jax.tree.map(lambda x: x * 3.0, model.params)  # a likely greedy path, yet 4+ plausible tokens
    sp = SamplingParams(temperature=1.0, top_k=12, top_p=0.95)
    greedy = jaxspec.generate(model, input_ids=PROMPT, max_new_tokens=16).token_ids
    d = oracle_drafter(model, PROMPT + greedy, noise=noise, max_rank=2, block_size=4)  # ddtree: demoted = sibling
    samples, accepted = [], 0
    for seed in range(2000):
        r = jaxspec.generate(model, input_ids=PROMPT, drafter=d, method=method, budget=budget, max_new_tokens=3,
                             temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, seed=seed)
        samples.append(r.token_ids)
        accepted += r.stats["accepted_length_histogram"][0] == 0  # token 2 came from an accepted draft
    assert accepted > 200  # the draft path is exercised, not just the bonus
    for i, probs in enumerate(exact_marginals(model, sp, 3)):  # token 3 checks the samples at non-root nodes
        assert chi2_pvalue(np.array([t[i] for t in samples]), probs) > 1e-3, f"token {i + 1}"


SPEC_SEEDS = 1500
SPEC_BLOCK = 4  # 3 draft depths: "fully accepted" (k = 3) is reachable and the bonus after it is token 5
# A prompt after which this target (scale 5, seed 11) repeats a token (greedy 112, 112, 112, 14, ...) with
# several alternatives each time: consecutive positions share plausible tokens, which is where noise shared
# between tree nodes (or rounds) would bias the output. On PROMPT their supports are almost disjoint.
REPEAT_PROMPT = [13, 21, 80, 118, 81, 94, 112, 49, 51, 14, 30, 10, 85]


@functools.lru_cache(maxsize=1)
def spec_target(family, scale, seed):
    return sampling_target(scale, seed, family)  # shared by consecutive cases of one target


@functools.lru_cache(maxsize=1)
def spec_levels(family, scale, seed, temperature, top_k, top_p, prompt):
    """Exact levels of tokens 1-5 and the greedy continuation read off them (the argmax always survives the
    filter): no AR run to compile. Tokens past the 5th are never emitted, so the oracle needs no more."""
    levels = exact_levels(spec_target(family, scale, seed), SamplingParams(temperature, top_k, top_p),
                          SPEC_BLOCK + 1, list(prompt))
    greedy = ()
    for prefixes, _, cond in levels:
        greedy += (int(np.argmax(cond[prefixes.index(greedy)])),)
    return levels, list(greedy)


@pytest.mark.parametrize("family,method,budget,noise,temperature,top_k,top_p,scale,seed,prompt,runs,lookup", [
    ("qwen3", "dflash", None, 0.0, 0.7, 6, 0.9, 4.0, 7, PROMPT, SPEC_SEEDS, False),
    # noise: the right token is often a second child
    ("qwen3", "ddtree", 8, 0.5, 0.5, 8, 0.9, 4.0, 7, PROMPT, SPEC_SEEDS, False),
    ("qwen3", "ddtree", 8, 0.5, 1.3, 10, 0.95, 5.0, 11, REPEAT_PROMPT, SPEC_SEEDS, False),
    # prompt lookup with a random drafter: the accepted drafts are chains copied from the repeating context
    ("qwen3", "ddtree", 8, None, 0.8, 10, 0.95, 5.0, 11, REPEAT_PROMPT + [112, 112], 2000, True),
    # hybrid GDN + MoE: a tree node's GDN state and conv window follow its ancestors only (never its siblings), and
    # the commit folds the accepted path's writes into the state; a chain runs the chunked causal form instead
    ("qwen3_next", "ddtree", 8, 0.5, 0.7, 6, 0.9, 2.5, 1, PROMPT, SPEC_SEEDS, False),
    ("qwen3_next", "dflash", None, 0.0, 0.7, 6, 0.9, 2.5, 1, PROMPT, 1000, False),
    # MLA + MoE: absorbed verify against the expanded reference, group-limited routing with a biased selection
    ("deepseek_v3", "ddtree", 8, 0.5, 1.2, 8, 0.9, 2.0, 0, PROMPT, SPEC_SEEDS, False),
    ("deepseek_v3", "dflash", None, 0.0, 1.2, 8, 0.9, 2.0, 0, PROMPT, 1000, False),
], ids=["dflash", "ddtree", "ddtree-repeat", "ddtree-repeat-lookup", "qwen3_next-ddtree", "qwen3_next-dflash",
        "deepseek_v3-ddtree", "deepseek_v3-dflash"])
def test_lossless_sampling_pairs(family, method, budget, noise, temperature, top_k, top_p, scale, seed, prompt, runs,
                                 lookup):
    """Speculative sampling with temperature, top-k and top-p: tokens 1-5, and each consecutive pair of them,
    follow the exact target distribution (`runs` fixed seeds; fewer for the other families' DFlash chains, whose
    tree-free verify the DDTree cases' chi-square does not need to repeat at full power). With blocks of 4, round 1
    emits tokens 2-4 from tree depths 1-3 and, when all 3 drafts are accepted, token 5 as the bonus after the full
    path; the histogram shows both deep and full acceptances happen often enough to matter. The targets are peaked
    enough that the greedy path (the oracle's proposal) is often sampled, with several plausible tokens per step.
    One test for every family: the exact reference is model.logits (a plain causal forward), never the engine."""
    model = spec_target(family, scale, seed)
    levels, greedy = spec_levels(family, scale, seed, temperature, top_k, top_p, tuple(prompt))
    d = (oracle_drafter(model, prompt + greedy, noise=noise, max_rank=2, block_size=SPEC_BLOCK) if noise is not None
         else jaxspec.init_drafter(model, num_layers=1, block_size=SPEC_BLOCK, seed=0))
    samples, hist, full_first = [], np.zeros(64, int), 0  # a lookup chain may reach past the block
    for s in range(runs):
        r = jaxspec.generate(model, input_ids=prompt, drafter=d, method=method, budget=budget,
                             max_new_tokens=SPEC_BLOCK + 1, temperature=temperature, top_k=top_k, top_p=top_p, seed=s,
                             lookup=lookup)
        samples.append(r.token_ids)
        h = r.stats["accepted_length_histogram"]
        hist[:len(h)] += h
        full_first += r.stats["rounds"] == 1  # 1 round = round 1 accepted all drafts: token 5 is its bonus
    check_distribution(samples, levels, SPEC_BLOCK + 1, f"{family} {method} T={temperature} k={top_k} p={top_p}")
    assert hist[2:].sum() >= 150, hist  # rounds that accepted a node at depth >= 2
    assert hist[SPEC_BLOCK - 1:].sum() >= 100, hist  # fully accepted blocks (or deeper chains), then a bonus
    assert full_first >= 100, full_first


# ------------------------------------------------------------------------------------ per-row settings


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_row_filter_equals_the_static_one(ties):
    """Per-row settings (arrays) filter each row exactly as the static SamplingParams of that row does: every
    FILTER_CASES setting on its own rows of one batch, top-k off / top-p off included."""
    rng = np.random.RandomState(7 + ties)
    cases = FILTER_CASES + [(0.8, 0, 1.0)]
    logits = (rng.randn(len(cases), 32, V_FILTER) * 3).astype(np.float32)
    if ties:
        logits = (np.round(logits * 2) / 2).astype(np.float32)
    rows = RowSampling.of([SamplingParams(*c) for c in cases])
    ours = np.asarray(row_filtered_logits(jnp.asarray(logits), rows))
    for i, c in enumerate(cases):
        np.testing.assert_array_equal(ours[i], np.asarray(filtered_logits(jnp.asarray(logits[i]), SamplingParams(*c))))


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_per_row_settings_decode_each_row_as_its_own(method):
    """A per-row decoder whose rows all ask for one setting draws exactly the static decoder's tokens (same keys,
    same filtered logits); a greedy row among sampled ones gets its greedy answer."""
    model, rows, n = tiny_target("qwen3"), [PROMPT, PROMPT[:7]], 24
    refs = [r + jaxspec.generate(model, input_ids=r, max_new_tokens=n).token_ids for r in rows]
    drafter = None if method == "ar" else oracle_drafter(model, refs)
    budget = None if method == "ar" else 6
    run_of = lambda dec, **kw: dec.decode(dec.prefill(rows, n, jax.random.key(3), **kw), n)  # noqa: E731
    per_row = Decoder(model, drafter, method=method, budget=budget, sampling=SamplingParams(per_row=True))
    for sp in (SamplingParams(1.3), SamplingParams(0.9, 20, 0.9)):  # the branches without and with filters
        static = Decoder(model, drafter, method=method, budget=budget, sampling=sp)
        expect = static.tokens(run_of(static))
        assert per_row.tokens(run_of(per_row, sampling=[sp, sp])) == expect
    greedy = Decoder(model, drafter, method=method, budget=budget)
    mixed = per_row.tokens(run_of(per_row, sampling=[SamplingParams(), sp]))
    assert mixed[0] == greedy.tokens(run_of(greedy))[0]
    assert mixed[0] != expect[0]  # the sampled answer differs, so the greedy row's equality means something
