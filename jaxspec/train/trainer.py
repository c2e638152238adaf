"""DFlash drafter training: block-parallel masked prediction against a frozen target.

Each step takes `batch` sequences and `anchors` random anchor positions per sequence (response tokens
only). A block is `[x_a, MASK x (B-1)]` at positions a..a+B-1 and sees the target's taps strictly before
a; slot k predicts x_{a+k} with weight exp(-(k-1)/gamma) (early slots matter most: a draft is only
as good as its prefix). AdamW with warm-up + cosine decay and gradient clipping (optax).

Labels: the data's own next tokens (hard), optionally mixed with the target's next-token distribution
after x_{a+k-1} (soft, its SOFT_K most likely tokens; `soft_weight`). The soft label carries the target's
ranking of the alternatives, which a draft tree spends its budget on, and many more bits per position than
one token: a regulariser for a drafter that would otherwise memorise a small self-distillation set.

Runs are resumable: the batch and anchors of step i are a pure function of (seed, i), and Orbax keeps
the parameters, optimiser state and step, so a run killed at any point and resumed ends where an
uninterrupted run ends.

Held-out early stopping: every `eval_every` steps the drafter decodes held-out prompts with DDTree and
its acceptance length is measured; the best-scoring parameters are kept (on disk, so a resumed run keeps
them too) and returned, and training stops once `patience` evaluations in a row have not beaten the best.
A drafter overfits its self-distillation data long before the training loss stops falling, and
acceptance, not loss, is what makes decoding fast.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from jaxspec.api import generate
from jaxspec.drafter import Drafter
from jaxspec.model import Model
from jaxspec.train.data import Dataset


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch: int = 8  # sequences per step
    anchors: int = 16  # blocks per sequence
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of steps
    weight_decay: float = 0.01
    clip: float = 1.0
    gamma: float = 7.0  # position decay of the loss
    seed: int = 0
    ckpt_every: int = 100
    eval_every: int = 250
    eval_tokens: int = 64
    patience: int = 0  # evaluations without a new best before stopping; 0: never stop early
    soft_weight: float = 0.0  # loss = (1 - w) hard CE + w soft CE (needs soft labels)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    warmup = max(1, int(cfg.warmup * cfg.steps))
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1), cfg.lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(cfg.clip), optax.adamw(sched, weight_decay=cfg.weight_decay))


def sample_batch(data: Dataset, step: int, cfg: TrainConfig, block_size: int):
    """Sequence ids [batch] and anchors [batch, A] (+ keep mask) for `step`: a pure function of (seed, step)."""
    N, S = data.tokens.shape
    rng = np.random.default_rng([cfg.seed, step])
    seqs = rng.choice(N, size=cfg.batch, replace=N < cfg.batch)
    anchors = np.zeros((cfg.batch, cfg.anchors), np.int32)
    keep = np.zeros((cfg.batch, cfg.anchors), bool)
    for b, i in enumerate(seqs):
        # an anchor is a committed token whose next token is a training target
        cand = np.flatnonzero(data.loss_mask[i, 1:] & (np.arange(1, S) < data.lengths[i]))
        take = rng.choice(cand, size=min(len(cand), cfg.anchors), replace=False) if len(cand) else cand
        anchors[b, : len(take)], keep[b, : len(take)] = np.sort(take), True
    return seqs, anchors, keep


def block_loss(target, drafter, taps, tokens, loss_mask, anchors, keep, mask_token_id, gamma, soft=None,
               soft_weight=0.0):
    """Weighted cross-entropy of the drafter's block predictions, and its top-1 accuracy (same weights).

    soft: (ids, probs) [Bs, S, K], the target's top-K next-token distribution after each position; with it
    the cross-entropy is (1 - soft_weight) * hard + soft_weight * soft."""
    Bs, S = tokens.shape
    Bk = drafter.config.block_size
    k = jnp.arange(Bk)
    idx = anchors[..., None] + k  # [Bs, A, Bk]
    inside = idx < S
    idxc = jnp.minimum(idx, S - 1)
    labels = jnp.take_along_axis(tokens[:, None, :], idxc, axis=2)  # x_{a+k}
    block = jnp.where(k == 0, labels, mask_token_id)  # [x_a, MASK...]
    h = drafter.train_forward(taps, target.embed(block), anchors)  # [Bs, A, Bk, H]
    logits = drafter.head(target, h[:, :, 1:])  # [Bs, A, Bk-1, K]
    labels = labels[..., 1:]
    vocab = drafter.config.draft_vocab
    # target ids -> draft-vocabulary rows; -1 for tokens the drafter can never propose
    to_draft = lambda ids: ids  # noqa: E731
    if vocab:
        t2d = jnp.full((drafter.config.vocab_size,), -1, jnp.int32).at[jnp.asarray(vocab)].set(jnp.arange(len(vocab)))
        to_draft = lambda ids: t2d[ids]  # noqa: E731
    labels = to_draft(labels)
    w = jnp.exp(-(k[1:] - 1) / gamma) * inside[..., 1:] * jnp.take_along_axis(loss_mask[:, None, :], idxc, 2)[..., 1:]
    w = w * keep[..., None]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
    acc = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)  # out-of-vocabulary slots count as misses
    w_ce = w * (labels >= 0)
    loss = (w_ce * ce).sum() / (w_ce.sum() + 1e-6)
    if soft is not None:
        A = anchors.shape[1]
        after = idxc[..., 1:].reshape(Bs, -1) - 1  # slot k's distribution: the one after x_{a+k-1}
        ids, probs = (jnp.take_along_axis(x, after[..., None], axis=1).reshape(Bs, A, Bk - 1, -1) for x in soft)
        ids = to_draft(ids)
        q = probs * (ids >= 0)
        mass = q.sum(-1)
        q = q / (mass[..., None] + 1e-9)  # over the tokens the drafter can propose
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), jnp.maximum(ids, 0), axis=-1)
        soft_ce = -(q * logp).sum(-1)
        w_soft = w * (mass > 0)
        loss = (1 - soft_weight) * loss + soft_weight * (w_soft * soft_ce).sum() / (w_soft.sum() + 1e-6)
    return loss, (w * acc).sum() / (w.sum() + 1e-6)


def train(model: Model, drafter: Drafter, data: Dataset, taps: np.ndarray, cfg: TrainConfig, *, ckpt_dir: Path,
          soft: tuple[np.ndarray, np.ndarray] | None = None, heldout: list | None = None, log=print) -> Drafter:
    """Train `drafter` for `model`, resuming from the newest checkpoint in ckpt_dir if there is one.

    soft: compute_taps' soft labels (needed when cfg.soft_weight > 0). With `heldout` prompts, returns the
    parameters of the best held-out evaluation (see the module doc)."""
    if cfg.soft_weight and soft is None:
        raise ValueError("soft_weight > 0 needs the target's soft labels (compute_taps(..., soft=True))")
    ckpt_dir = Path(ckpt_dir).absolute()
    opt = make_optimizer(cfg)
    params = drafter.params
    opt_state = opt.init(params)
    mgr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
    best_mgr = (ocp.CheckpointManager(ckpt_dir / "best",
                                      options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True))
                if heldout else None)
    best_file = ckpt_dir / "best.json"  # {"step", "acceptance_length"} of the parameters in best/
    best = json.loads(best_file.read_text()) if best_file.exists() else None
    start = 0
    if mgr.latest_step() is not None:
        start = mgr.latest_step()
        state = mgr.restore(start, args=ocp.args.StandardRestore({"params": params, "opt_state": opt_state}))
        params, opt_state = state["params"], state["opt_state"]
        log(f"resumed from {ckpt_dir} at step {start}")
    dg, tg, tp = drafter.graphdef, model.graphdef, model.params
    mask_id = drafter.config.mask_token_id

    def stale(done):  # patience evaluations since the best one
        return (bool(heldout) and cfg.patience > 0 and best is not None
                and done - best["step"] >= cfg.patience * cfg.eval_every)

    @jax.jit
    def step_fn(params, opt_state, taps, tokens, loss_mask, anchors, keep, soft):
        def loss_fn(p):
            return block_loss(nnx.merge(tg, tp), nnx.merge(dg, p), taps, tokens, loss_mask, anchors, keep, mask_id,
                              cfg.gamma, soft, cfg.soft_weight)

        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    Bk = drafter.config.block_size
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="train", unit="step", mininterval=2.0)
    t0, seen = time.perf_counter(), 0
    for step in ([] if stale(start) else bar):
        seqs, anchors, keep = sample_batch(data, step, cfg, Bk)
        labels = tuple(jnp.asarray(x[seqs]) for x in soft) if cfg.soft_weight else None
        params, opt_state, loss, acc = step_fn(params, opt_state, jnp.asarray(taps[seqs]),
                                               jnp.asarray(data.tokens[seqs]), jnp.asarray(data.loss_mask[seqs]),
                                               jnp.asarray(anchors), jnp.asarray(keep), labels)
        seen += int(keep.sum()) * (Bk - 1)
        bar.set_postfix(loss=f"{float(loss):.3f}", acc=f"{float(acc):.3f}",
                        tok_s=f"{seen / (time.perf_counter() - t0):.0f}", refresh=False)
        done = step + 1
        if heldout and (done % cfg.eval_every == 0 or done == cfg.steps):
            al = acceptance_length(model, dataclasses.replace(drafter, params=params), heldout, cfg.eval_tokens)
            if best is None or al > best["acceptance_length"]:
                best_mgr.save(done, args=ocp.args.StandardSave(params))
                best_mgr.wait_until_finished()
                best = dict(step=done, acceptance_length=al)
                best_file.write_text(json.dumps(best))
            bar.write(f"step {done}: held-out acceptance length {al:.2f} (ddtree, budget 16, greedy); "
                      f"best {best['acceptance_length']:.2f} at step {best['step']}")
        if done % cfg.ckpt_every == 0 or done == cfg.steps or stale(done):
            mgr.save(done, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
            mgr.wait_until_finished()
        if stale(done):
            bar.write(f"early stop at step {done}: no better held-out acceptance in {cfg.patience} evaluations")
            break
    mgr.close()
    if heldout and best is not None:
        params = best_mgr.restore(best["step"], args=ocp.args.StandardRestore(params))
        log(f"keeping the parameters of step {best['step']} "
            f"(held-out acceptance length {best['acceptance_length']:.2f})")
    if best_mgr:
        best_mgr.close()
    return dataclasses.replace(drafter, params=params)


def acceptance_length(model: Model, drafter: Drafter, prompts: list, max_new_tokens: int, budget: int = 16) -> float:
    """Mean DDTree acceptance length over held-out prompts (greedy)."""
    als = [generate(model, p, drafter=drafter, method="ddtree", budget=budget, max_new_tokens=max_new_tokens)
           .stats["acceptance_length"] for p in prompts]
    return float(np.mean(als))
