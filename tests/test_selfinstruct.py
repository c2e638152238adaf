"""Self-instruct prompts: replies are cut to one prompt, near-copies of held-out prompts never get through,
duplicates are dropped, and the shipped self-instruct set keeps clear of the held-out set."""
import random
from types import SimpleNamespace

import pytest

import jaxspec.api
from jaxspec.train import selfinstruct
from jaxspec.train.data import SHIPPED, read_prompt_records, read_prompts
from jaxspec.train.selfinstruct import Index, clean, near_copy, shingles

HELD = "A bakery sells muffins for $3 each. How much do 7 muffins cost?"


@pytest.mark.parametrize("candidate,copy", [
    (HELD, True),
    ("A bakery sells muffins for $4 each. How much do 12 muffins cost?", True),  # other numbers
    ("Hi! A bakery sells muffins for $3 each. How much do 7 muffins cost in total, please?", True),  # padded
    ("A shop sells pencils for $2 each. How many can I buy with $10?", False),
    ("Write a Python function that reverses a list.", False),
])
def test_near_copy(candidate, copy):
    assert Index([HELD]).has_near_copy(shingles(candidate)) is copy
    assert near_copy(shingles(candidate), shingles(HELD)) is copy


@pytest.mark.parametrize("reply,want", [
    ("Write a Python function that counts the vowels in a word.\n\nHere is how: ...",
     "Write a Python function that counts the vowels in a word."),
    ("4. How many minutes are there in 3 hours?", "How many minutes are there in 3 hours?"),
    ('Sure, here is one:\n"What is the tallest animal in the world?"', "What is the tallest animal in the world?"),
    ("Question: Why do leaves change colour in autumn?", "Why do leaves change colour in autumn?"),
    ("Here is a new example of a task.", None),  # meta-prompt leftovers
    ("Hi!", None),  # too short
])
def test_clean(reply, want):
    assert clean(reply, "chat", random.Random(0)) == want


def test_clean_summaries_wraps_a_passage():
    passage = ("Bees live in large groups called colonies. Each colony has a queen that lays the eggs. "
               "Worker bees collect nectar from flowers and turn it into honey.")
    got = clean(passage + " They also", "summaries", random.Random(0))  # an unfinished last sentence is cut
    assert passage in got and "They also" not in got and got != passage


def test_self_instruct_filters(monkeypatch):
    """With canned replies: near-copies of held-out prompts and duplicates are rejected, categories rotate."""
    replies = iter([
        ["A bakery sells muffins for $5 each. How much do 9 muffins cost?",  # held-out near-copy
         "Write a shell command that counts the lines in notes.txt.",
         "Write a shell command that counts the lines in notes.txt!"],  # duplicate
        ["If a train travels 60 km in 1 hour, how far does it go in 4 hours?", "ok", "What is 15% of 80 apples?"],
    ] + [["Nothing here."] * 3] * 10)
    calls = []

    def fake_generate(model, *, input_ids, max_new_tokens, **kw):
        calls.append(max_new_tokens)
        return SimpleNamespace(text=next(replies))

    monkeypatch.setattr(jaxspec.api, "generate", fake_generate)
    monkeypatch.setattr(jaxspec.api, "encode_prompt", lambda model, prompt, chat: [1, 2, 3])
    seeds = [dict(category="code", prompt="Write a Python function that adds two numbers."),
             dict(category="math", prompt="What is 3 + 4?")]
    got = selfinstruct.self_instruct(None, seeds, [HELD], 3, batch=3, max_rounds=2)
    assert [g["prompt"] for g in got] == ["Write a shell command that counts the lines in notes.txt.",
                                          "If a train travels 60 km in 1 hour, how far does it go in 4 hours?",
                                          "What is 15% of 80 apples?"]
    assert [g["category"] for g in got] == ["code", "math", "math"]


def test_shipped_sets_are_clear_of_heldout_and_of_each_other():
    """Every shipped self-instruct prompt passes the near-copy check against every held-out prompt, and each
    later set (the same run resumed) repeats neither the sets before it nor the written training prompts."""
    held = Index(read_prompts("heldout"))
    sets = [read_prompt_records(s) for s in SHIPPED if s.startswith("selfinstruct")]  # in the order they were made
    assert [len(s) for s in sets] == [1046, 210, 1000, 527]
    assert not [r["prompt"] for s in sets for r in s if held.has_near_copy(shingles(r["prompt"]))]
    for i in range(1, len(sets)):
        earlier = Index(read_prompts("train") + [r["prompt"] for s in sets[:i] for r in s])
        assert not [r["prompt"] for r in sets[i] if earlier.has_near_copy(shingles(r["prompt"]))]


def test_written_sets_are_clear_of_heldout():
    """The written training prompts (`train`, and `train2`'s templates over written parts) never come near a
    held-out prompt either: numbers are folded, so a templated word problem counts as a copy of a held-out one
    with other numbers."""
    held = Index(read_prompts("heldout"))
    for name, n in [("train", 400), ("train2", 594)]:
        prompts = read_prompts(name)
        assert len(prompts) == n
        assert not [p for p in prompts if held.has_near_copy(shingles(p))]
