"""The trained hybrid GDN pair in bench/models/qwen3_5-stdlib (scripts/train_hybrid_pair.sh): its target is a
HF checkpoint that transformers reads with the same logits, and DDTree with its drafter is lossless and
accepts more than one token per round on held-out prompts."""
from pathlib import Path

import numpy as np
import pytest

import jaxspec
from jaxspec.model import encode_prompt
from jaxspec.train.data import read_prompts

PAIR = Path(__file__).resolve().parents[1] / "bench" / "models" / "qwen3_5-stdlib"


@pytest.fixture(scope="module")
def pair():
    model = jaxspec.load(PAIR / "target")
    prompts = [encode_prompt(model, p, None) for p in read_prompts(PAIR / "target" / "heldout.jsonl")[:2]]
    return model, jaxspec.load_drafter(PAIR / "drafter", model), prompts


def test_target_logits_match_transformers(pair):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, _, prompts = pair
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(PAIR / "target"), dtype=torch.float32).eval()
    ids = prompts[0][:100]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    got = model.logits(ids)[0]
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=2e-3)


def test_ddtree_lossless_and_accepting(pair):
    model, drafter, prompts = pair
    als = []
    for ids in prompts:
        ar = jaxspec.generate(model, input_ids=ids, method="ar", max_new_tokens=48)
        res = jaxspec.generate(model, input_ids=ids, drafter=drafter, method="ddtree", budget=32, max_new_tokens=48)
        assert res.token_ids == ar.token_ids
        als.append(res.stats["acceptance_length"])
    assert np.mean(als) > 1.5, als  # a random drafter accepts ~1.0 here
