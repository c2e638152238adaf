"""Token sampling: greedy, temperature, top-k, top-p, with explicit PRNG keys.

The same `sample` serves AR decoding and the per-node target samples of speculative verification, so
both draw from exactly the same filtered distribution (the premise of the lossless sampling rule).
Order of the filters follows transformers: temperature, then top-k, then top-p.

A batch either shares one static `SamplingParams` (one compile per setting; greedy compiles to an argmax) or,
with `SamplingParams(per_row=True)`, reads each row's own settings from a `RowSampling` carried in the decode
state: a server batches requests that ask for different temperatures, and a greedy request among sampled ones
still gets the argmax.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxspec import kernels


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    per_row: bool = False  # the numbers above are ignored: each row's come from a RowSampling

    def __post_init__(self):
        if not 0 <= self.temperature < math.inf:  # nan fails too: it would sample garbage
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 and not self.per_row


@jax.tree_util.register_dataclass
@dataclass
class RowSampling:
    """Each row's own settings (SamplingParams(per_row=True)); every field is [B]."""

    temperature: jax.Array  # float32, 0 = greedy
    top_k: jax.Array  # int32, 0 = off
    top_p: jax.Array  # float32, 1 = off

    @staticmethod
    def of(params: list[SamplingParams]) -> RowSampling:
        return RowSampling(jnp.asarray([p.temperature for p in params], jnp.float32),
                           jnp.asarray([p.top_k for p in params], jnp.int32),
                           jnp.asarray([p.top_p for p in params], jnp.float32))


def filtered_logits(logits: jax.Array, p: SamplingParams) -> jax.Array:
    """float32 logits [..., V] -> tempered logits with filtered-out tokens at -inf."""
    x = logits.astype(jnp.float32) / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, p.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if p.top_p < 1.0:
        srt = jnp.sort(x, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(srt, axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
        # keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p
        keep = (cum - probs) < p.top_p
        cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < cutoff, -jnp.inf, x)
    return x


def argmax(logits: jax.Array) -> jax.Array:
    """`jnp.argmax(logits, -1)` as int32 (the first maximum; the first NaN if any): a greedy round takes one over
    every node's logits (`kernels.argmax`)."""
    return kernels.argmax(logits)


def row_filtered_logits(logits: jax.Array, rows: RowSampling) -> jax.Array:
    """filtered_logits with settings that are arrays broadcasting against logits' leading dimensions (a greedy
    row is left untempered: its token is the argmax). Same filters and same order, so equal settings give the
    same logits as the static path; both filters always run, on one sort."""
    t, k, p = _settings(rows, logits.shape[:-1])
    x = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)
    srt = jnp.sort(x, axis=-1)[..., ::-1]
    kth = jnp.take_along_axis(srt, jnp.clip(k - 1, 0, x.shape[-1] - 1), axis=-1)
    off = (k <= 0) | (k >= x.shape[-1])
    x = jnp.where(off | (x >= kth), x, -jnp.inf)
    srt = jnp.where(off | (srt >= kth), srt, -jnp.inf)  # still sorted: the top-k filter cut its tail
    probs = jax.nn.softmax(srt, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < p
    cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((p >= 1.0) | (x >= cutoff), x, -jnp.inf)


def _settings(rows: RowSampling, lead: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """Each setting [B] as [*lead, 1] (row b's value on every logits row of b)."""
    def expand(a):
        a = jnp.asarray(a)
        return jnp.broadcast_to(a.reshape(a.shape + (1,) * (len(lead) - a.ndim)), lead)[..., None]
    return expand(rows.temperature), expand(rows.top_k), expand(rows.top_p)


def sample_per_row(logits: jax.Array, key: jax.Array, rows: RowSampling) -> jax.Array:
    """logits [B, ..., V] -> tokens [B, ...], row b with its own settings rows[b]; key: one key, or one per row
    [B] (each row's own stream). A batch of greedy rows skips sampling, and one without top-k / top-p skips the
    sort (XLA's sort is slow on CPU and, over B x nodes x V, not free on a GPU); these are whole-batch branches,
    so the draws are the same whichever is taken."""
    t, k, p = _settings(rows, logits.shape[:-1])
    V = logits.shape[-1]

    def drawn(x):
        tok = (jax.random.categorical(key, x, axis=-1) if key.shape == () else
               jax.vmap(lambda kk, xx: jax.random.categorical(kk, xx, axis=-1))(key, x))
        return jnp.where(t[..., 0] == 0, argmax(logits), tok.astype(jnp.int32))

    filters = jnp.any(((k > 0) & (k < V)) | (p < 1.0))
    return jax.lax.cond(
        jnp.all(t == 0), lambda: argmax(logits),
        lambda: jax.lax.cond(filters, lambda: drawn(row_filtered_logits(logits, rows)),
                             lambda: drawn(logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0))))


def sample(logits: jax.Array, key: jax.Array, p: SamplingParams, rows: RowSampling | None = None) -> jax.Array:
    """logits [..., V] -> int32 tokens [...]; one independent draw per leading index. rows: the settings of
    SamplingParams(per_row=True) (then logits are [B, ..., V]: see sample_per_row)."""
    if p.greedy:
        return argmax(logits)
    if p.per_row:
        return sample_per_row(logits, key, rows)
    return jax.random.categorical(key, filtered_logits(logits, p), axis=-1).astype(jnp.int32)
