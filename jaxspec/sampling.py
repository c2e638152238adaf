"""Token sampling: greedy, temperature, top-k, top-p, with explicit PRNG keys.

The same `sample` serves AR decoding and the per-node target samples of speculative verification, so
both draw from exactly the same filtered distribution (the premise of the lossless sampling rule).
Order of the filters follows transformers: temperature, then top-k, then top-p.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxspec import kernels


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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


def sample(logits: jax.Array, key: jax.Array, p: SamplingParams) -> jax.Array:
    """logits [..., V] -> int32 tokens [...]; one independent draw per leading index."""
    if p.greedy:
        return argmax(logits)
    return jax.random.categorical(key, filtered_logits(logits, p), axis=-1).astype(jnp.int32)
