"""Pretrain a small hybrid Gated DeltaNet target (Qwen3.5 text layout) on the Python standard library.

    python scripts/pretrain_hybrid.py --out runs/hybrid/target --work runs/hybrid [--minutes 45]

The corpus is the `.py` sources of the running interpreter's standard library (no tests), available on
every machine without a download. Files are split by a hash of their relative path: 1 in 20 is held out,
never trained on, and its first lines become the held-out prompts (`heldout.jsonl` in --out) on which the
drafter's acceptance is measured. A byte-level BPE tokenizer (HF `tokenizers`) is trained on the training
files only.

The model is a `qwen3_5_text` config: 8 layers (GDN, GDN, GDN, gated attention) x 2, hidden 256, tied
embeddings, 4096-token vocabulary. Training is plain next-token cross-entropy through jaxspec's own forward
(the chunked gated delta rule, differentiated by JAX), AdamW with warm-up and cosine decay, for --steps or
until --minutes run out. The result is written as a HF directory (config.json, model.safetensors in
bfloat16, tokenizer) that `jaxspec.load` and transformers both read; --work keeps the tokenized corpus and
Orbax checkpoints, so a rerun resumes.
"""
from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxspec  # noqa: E402
from jaxspec.models.qwen3_next import hybrid_config_from_dict  # noqa: E402
from jaxspec.segment import Segment  # noqa: E402

EOS = "<|endoftext|>"


def hf_config(vocab_size: int, eos_id: int) -> dict:
    return dict(
        model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], vocab_size=vocab_size, hidden_size=256,
        intermediate_size=512, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=True, hidden_act="silu", eos_token_id=eos_id, bos_token_id=None, pad_token_id=eos_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        torch_dtype="bfloat16")


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(train, held-out) stdlib sources, sorted; tests and vendored packages left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    held = [p for p in files if zlib.crc32(str(p.relative_to(root)).encode()) % 20 == 0]
    return [p for p in files if p not in set(held)], held


def heldout_prompts(files: list[Path], n: int, lines: int = 24) -> list[dict]:
    """The opening `lines` non-empty lines of each held-out file that has that many (a module header and
    its imports, from which a code model continues)."""
    out = []
    for p in files:
        text = p.read_text(errors="replace").splitlines()
        body = [t for t in text if t.strip()]
        if len(body) >= 3 * lines:
            out.append({"prompt": "\n".join(text[: text.index(body[lines - 1]) + 1]) + "\n", "source": p.name})
        if len(out) == n:
            break
    return out


def drafter_data(files: list[Path], work: Path, n_prompts: int, text_tokens: int, tok, seed: int = 0) -> None:
    """What the drafter trains on, from training files only: `train_prompts.jsonl` (16-line windows at random
    line offsets, for self-distillation) and `text_files.txt` (files in a seeded random order up to about
    `text_tokens` tokens, for plain-text training)."""
    rng = np.random.default_rng(seed)
    prompts = []
    while len(prompts) < n_prompts:
        lines = files[rng.integers(len(files))].read_text(errors="replace").splitlines()
        if len(lines) > 64:
            at = int(rng.integers(0, len(lines) - 16))
            window = "\n".join(lines[at : at + 16]) + "\n"
            if window.strip():
                prompts.append({"prompt": window})
    (work / "train_prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    chosen, total = [], 0
    for i in rng.permutation(len(files)):
        if total >= text_tokens:
            break
        chosen.append(str(files[i]))
        total += len(tok.encode(files[i].read_text(errors="replace")))
    (work / "text_files.txt").write_text("\n".join(chosen) + "\n")


def train_tokenizer(files: list[Path], vocab_size: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((p.read_text(errors="replace") for p in files), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.save_pretrained(str(out))
    return fast


def export(model: jaxspec.Model, cfg: dict, out: Path) -> None:
    """jaxspec parameters -> HF safetensors names (the inverse of jaxspec/checkpoint/qwen3_next.py)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    params = {".".join(str(p) for p in path): np.asarray(leaf.get_value() if hasattr(leaf, "get_value") else leaf.value,
                                                         np.float32)
              for path, leaf in nnx.to_flat_state(model.params)}
    for gdn in {n[: n.index("linear_attn.") + len("linear_attn.")] for n in params if "linear_attn." in n}:
        # HF fuses what jaxspec keeps apart: in_proj_qkv's columns and conv1d's channels run [q | k | v]
        params[gdn + "in_proj_qkv.kernel"] = np.concatenate([params.pop(f"{gdn}in_proj_{p}.kernel") for p in "qkv"], 1)
        params[gdn + "conv1d"] = np.concatenate([params.pop(f"{gdn}conv_{p}") for p in "qkv"], 0)
    tensors = {}
    for name, w in params.items():
        if name.endswith(".kernel"):
            name, w = name[: -len(".kernel")] + ".weight", w.T
        elif name.endswith("linear_attn.conv1d"):
            name, w = name + ".weight", w[:, None, :]
        elif name == "embed_tokens":
            name = "embed_tokens.weight"
        tensors["model." + name] = np.ascontiguousarray(w).astype(ml_dtypes.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=550)
    ap.add_argument("--minutes", type=float, default=60.0, help="stop (and export) after this much training time")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--heldout-prompts", type=int, default=16)
    ap.add_argument("--drafter-prompts", type=int, default=512, help="self-distillation prompts written to --work")
    ap.add_argument("--drafter-text-tokens", type=int, default=300_000, help="plain text listed for the drafter")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out, work = Path(args.out), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)

    train_files, held_files = corpus_files()
    tok = train_tokenizer(train_files, args.vocab, out)
    eos = tok.convert_tokens_to_ids(EOS)
    held_prompts = heldout_prompts(held_files, args.heldout_prompts)
    (out / "heldout.jsonl").write_text("".join(json.dumps(p) + "\n" for p in held_prompts))
    drafter_data(train_files, work, args.drafter_prompts, args.drafter_text_tokens, tok, args.seed)
    ids_file = work / "corpus.npy"
    if not ids_file.exists():
        ids = []
        for p in train_files:
            ids += tok.encode(p.read_text(errors="replace")) + [eos]
        np.save(ids_file, np.asarray(ids, np.uint16))
    ids = np.load(ids_file)
    print(f"corpus: {len(train_files)} files, {len(ids)} tokens; held out {len(held_files)} files", file=sys.stderr)

    cfg_dict = hf_config(len(tok), eos)
    model = jaxspec.random_model(hybrid_config_from_dict(cfg_dict), seed=args.seed)
    graphdef = model.graphdef
    S, B = args.seq_len, args.batch
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 25), args.steps, args.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
    params, opt_state = model.params, opt.init(model.params)

    def loss_fn(p, tokens):
        m = nnx.merge(graphdef, p)
        pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        idx = pos[:, : S - 1]
        logits, _, _ = m(tokens, Segment.causal(pos), m.init_cache(B, S), logits_idx=idx)  # [B, S-1, V]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def step_fn(p, o, tokens):
        loss, g = jax.value_and_grad(loss_fn)(p, tokens)
        upd, o = opt.update(g, o, p)
        return optax.apply_updates(p, upd), o, loss

    mgr = ocp.CheckpointManager((work / "checkpoints").absolute(),
                                options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True))
    start = 0
    if mgr.latest_step() is not None:
        start = mgr.latest_step()
        st = mgr.restore(start, args=ocp.args.StandardRestore({"params": params, "opt_state": opt_state}))
        params, opt_state = st["params"], st["opt_state"]
        print(f"resumed at step {start}", file=sys.stderr)
    t0, losses, step = time.perf_counter(), [], start
    for step in range(start, args.steps):
        rng = np.random.default_rng([args.seed, step])
        offs = rng.integers(0, len(ids) - S, B)
        tokens = jnp.asarray(np.stack([ids[o : o + S] for o in offs]).astype(np.int32))
        params, opt_state, loss = step_fn(params, opt_state, tokens)
        losses.append(float(loss))
        if (step + 1) % 50 == 0:
            el = time.perf_counter() - t0
            print(f"step {step + 1}: loss {np.mean(losses[-50:]):.3f} ({el / (step + 1 - start):.2f} s/step)",
                  file=sys.stderr, flush=True)
            mgr.save(step + 1, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
            if el > args.minutes * 60:
                print(f"time budget of {args.minutes} min reached at step {step + 1}", file=sys.stderr)
                break
    mgr.wait_until_finished()
    mgr.close()
    model.params = params
    export(model, cfg_dict, out)
    (out / "pretrain.json").write_text(json.dumps(dict(steps=step + 1, tokens_seen=(step + 1) * B * S, batch=B,
                                                       seq_len=S, final_loss=round(float(np.mean(losses[-50:])), 4),
                                                       corpus_tokens=len(ids)), indent=2))
    print(f"exported the target to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
