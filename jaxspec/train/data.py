"""Training data for DFlash drafters: token sequences with a loss mask, and the target's taps for them.

Two sources: (a) self-distillation, where the target answers prompts with jaxspec's batched AR
generation, so the drafter learns exactly the continuations it will be asked to draft; (b) plain text
files, chunked. Sequences are right-padded to one length S; `loss_mask` marks the tokens a drafter is
trained to predict (the response for (a), all text for (b)).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxspec.batching import generate_many
from jaxspec.decoder import round_up
from jaxspec.model import Model, encode_prompt
from jaxspec.segment import Segment

SHIPPED = ("train", "train2", "heldout", "selfinstruct", "selfinstruct2", "selfinstruct3", "selfinstruct4")


@dataclass
class Dataset:
    tokens: np.ndarray  # [N, S] int32, right-padded
    loss_mask: np.ndarray  # [N, S] bool
    lengths: np.ndarray  # [N] int32

    def save(self, path: Path, recipe: dict | None = None) -> None:
        """Compressed (mostly padding); `recipe`, how the data was made, is stored beside it as JSON."""
        extra = {"recipe": np.array(json.dumps(recipe))} if recipe is not None else {}
        np.savez_compressed(path, tokens=self.tokens, loss_mask=self.loss_mask, lengths=self.lengths, **extra)

    @staticmethod
    def load(path: Path) -> "Dataset":
        try:
            with np.load(path) as z:
                data = Dataset(z["tokens"], z["loss_mask"], z["lengths"])
        except (OSError, ValueError, KeyError, EOFError) as e:  # zipfile.BadZipFile is an OSError
            raise ValueError(f"{path} is not a jaxspec training data file ({e}); regenerate it") from e
        N, S = data.tokens.shape
        if data.loss_mask.shape != (N, S) or data.lengths.shape != (N,):
            raise ValueError(f"{path}: tokens {data.tokens.shape}, loss_mask {data.loss_mask.shape} and lengths "
                             f"{data.lengths.shape} do not match; regenerate it")
        return data


def read_prompt_records(source: str | Path) -> list[dict]:
    """A .jsonl of {"prompt": ..., ...} lines; 'train' / 'heldout' / 'selfinstruct' name the prompt sets shipped
    with jaxspec (prompts/README.md)."""
    if str(source) in SHIPPED:
        text = resources.files("jaxspec.train").joinpath(f"prompts/{source}.jsonl").read_text()
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"prompt file {path} not found; "
                                    "pass a .jsonl with one {\"prompt\": ...} per line")
        text = path.read_text()
    records = []
    for i, line in enumerate(text.splitlines()):
        if line.strip():
            try:
                record = json.loads(line)
                if not isinstance(record.get("prompt"), str):
                    raise KeyError("prompt")
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{source}: line {i + 1} is not a JSON object with a 'prompt' ({e})") from e
            records.append(record)
    if not records:
        raise ValueError(f"{source} holds no prompts")
    return records


def read_prompts(source: str | Path) -> list[str]:
    """The prompts of read_prompt_records(source)."""
    return [r["prompt"] for r in read_prompt_records(source)]


def self_distill(model: Model, prompts: list[str], seq_len: int, *, samples: int = 1, first_sample: int = 0,
                 temperature: float = 0.8, batch: int = 64, seed: int = 0) -> Dataset:
    """The target's own answers to `prompts` (chat template on), as training sequences of length seq_len.

    The first answer per prompt is greedy (what greedy decoding will ask the drafter for); each further one
    of `samples` is drawn at `temperature`, which multiplies the data without leaving the target's
    distribution; sample k is drawn with seed + k, so answers first_sample .. first_sample + samples - 1 can
    be made in separate calls. Prompts keep at most seq_len // 2 tokens and each answer has the rest of
    seq_len; continuous batching (jaxspec/batching.py) keeps `batch` rows busy."""
    rows, masks = [], []
    encoded = [encode_prompt(model, p, None)[: seq_len // 2] for p in prompts]
    for k in range(first_sample, first_sample + samples):
        with tqdm(total=len(encoded), desc=f"self-distillation, answer {k}", unit="prompt") as bar:
            answers = generate_many(model, encoded, [seq_len - len(p) for p in encoded], batch=batch,
                                    temperature=temperature if k else 0.0, seed=seed + k,
                                    on_done=lambda n: bar.update(n - bar.n))
        for p, out in zip(encoded, answers):
            rows.append(p + out)
            masks.append([False] * len(p) + [True] * len(out))
    return _pack(rows, masks, seq_len)


def from_text_files(model: Model, files: list[str | Path], seq_len: int) -> Dataset:
    """Plain text, tokenized and cut into seq_len chunks; every token is a training target."""
    ids: list[int] = []
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise FileNotFoundError(f"text file {path} not found")
        ids += model.tokenizer.encode(path.read_text(errors="replace"))
    rows = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len // 4, seq_len)]
    return _pack(rows, [[True] * len(r) for r in rows], seq_len)


def _pack(rows, masks, seq_len) -> Dataset:
    n = len(rows)
    tokens = np.zeros((n, seq_len), np.int32)
    loss = np.zeros((n, seq_len), bool)
    lengths = np.zeros((n,), np.int32)
    for i, (r, m) in enumerate(zip(rows, masks)):
        r, m = r[:seq_len], m[:seq_len]
        tokens[i, : len(r)], loss[i, : len(m)], lengths[i] = r, m, len(r)
    return Dataset(tokens, loss, lengths)


def frequent_tokens(data: Dataset, k: int, always=()) -> tuple[int, ...]:
    """The k token ids most frequent among the training targets (plus `always`, e.g. EOS), sorted: a draft
    vocabulary. Ties break towards lower ids, so the choice is deterministic."""
    counts = np.bincount(data.tokens[data.loss_mask], minlength=int(data.tokens.max()) + 1)
    order = np.argsort(-counts, kind="stable")
    ids = set(int(i) for i in always)
    for i in order:
        if len(ids) >= k:
            break
        ids.add(int(i))
    return tuple(sorted(ids))


SOFT_K = 8  # target probabilities kept per position for soft labels
TAPS_BUCKET = 64  # compute_taps rounds sequence lengths and answer spans to this


def compute_taps(model: Model, data: Dataset, taps: tuple[int, ...], *, batch: int = 4, soft: bool = False,
                 out: np.ndarray | None = None, labels: tuple[np.ndarray, np.ndarray] | None = None, done: int = 0,
                 progress=None) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """The frozen target's tap features for every sequence: [N, S, len(taps) * H] float32 (zero past each
    row's length), and with `soft` its own next-token distribution after every position t whose next token
    x_{t+1} is a training target, as the SOFT_K most likely tokens: ids [N, S, K] int32 and probabilities
    [N, S, K] float32 (soft labels, see trainer.block_loss; zero at the positions no loss reads).

    Computed once up front: the target is frozen, so neither ever changes during training, and the target
    forward costs far more than a drafter step. Two cuts keep it cheap: rows run in order of length, each
    batch cut to its longest row (causal attention: a position's taps never depend on what follows it), and
    the LM head runs only over each row's answer span (over half of the SmolLM2 data's positions are prompt
    or padding). Both round to TAPS_BUCKET so that a handful of shapes compile.

    out, labels: arrays to fill (memory-mapped files for data larger than memory). done: how many rows of the
    length order an earlier, interrupted call already filled into those same arrays; they are skipped, so a
    pass of hours on a CPU can go on across sessions. progress(rows_done) runs after every batch.
    """
    N, S = data.tokens.shape
    need = np.zeros((N, S), bool)
    need[:, :-1] = data.loss_mask[:, 1:]  # the distribution after x_t is a label iff x_{t+1} is a target
    first = need.argmax(1)  # [N] first labelled position (0 for a row without any)
    span = np.where(need.any(1), S - need[:, ::-1].argmax(1) - first, 1)  # [N] labelled positions' extent

    @jax.jit
    def fwd(params, tokens, idx):  # tokens [B, L], idx [B, W] positions to run the LM head at
        m = nnx.merge(model.graphdef, params)
        B, L = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
        logits, t, _ = m(tokens, Segment.causal(pos), m.init_cache(B, L), tap_layers=taps, logits_idx=idx)
        if not soft:
            return t, None
        logits = logits.astype(jnp.float32)  # [B, W, V]
        top, ids = jax.lax.top_k(logits, SOFT_K)
        return t, (ids, jnp.exp(top - jax.nn.logsumexp(logits, axis=-1, keepdims=True)))

    if out is None:
        out = np.zeros((N, S, len(taps) * model.config.hidden_size), np.float32)
    if not soft:
        labels = None
    elif labels is None:
        labels = (np.zeros((N, S, SOFT_K), np.int32), np.zeros((N, S, SOFT_K), np.float32))
    order = np.argsort(data.lengths, kind="stable")
    for i in tqdm(range(done, N, batch), desc="target taps", unit="batch", initial=done // batch, total=-(-N // batch)):
        rows = order[i : i + batch]  # [n]
        L = min(S, round_up(int(data.lengths[rows].max()), TAPS_BUCKET))
        W = min(L, round_up(int(span[rows].max()), TAPS_BUCKET)) if soft else 1
        idx = np.minimum(first[rows, None] + np.arange(W), L - 1)  # [n, W]
        pad = ((0, batch - len(rows)), (0, 0))
        t, lab = fwd(model.params, jnp.asarray(np.pad(data.tokens[rows, :L], pad)), jnp.asarray(np.pad(idx, pad)))
        out[rows, :L] = np.asarray(t)[: len(rows)]
        for r in rows:  # a shorter row's tail saw padding
            out[r, data.lengths[r] :] = 0
        if soft:
            for dst, src in zip(labels, lab):
                dst[rows[:, None], idx] = np.asarray(src)[: len(rows)]
        if progress is not None:
            progress(i + len(rows))
    if soft:  # positions the window covered but no loss reads are zeroed, so the labels say what they are for
        for x in labels:
            x[~need] = 0
    return out, labels
