"""Routed-expert computation on CPU: gathering the chosen experts vs `jax.lax.ragged_dot`, by token count.

Shape: H 1024, I 256, E 64, k 8 (a scaled-down DeepSeek-V3 MoE layer), float32, random routing from the real
router. Each number is the median of 5 timed calls after a warm-up (compile) call, in one run, so compare the
ratio of the two columns, not absolute times across machines.

    python bench/cpu/moe_experts.py     # prints one row per token count
"""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for its sibling mla.py

from jaxspec.models.moe import experts_gather, experts_ragged, route  # noqa: E402
from mla import timed  # noqa: E402

H, I, E, K = 1024, 256, 64, 8


def main():
    keys = jax.random.split(jax.random.key(0), 5)
    gate, up = (jax.random.normal(k, (E, H, I)) * H**-0.5 for k in keys[:2])
    down = jax.random.normal(keys[2], (E, I, H)) * I**-0.5
    w_gate = jax.random.normal(keys[3], (H, E)) * H**-0.5
    print(f"{'tokens':>6} {'pairs':>6} {'gather ms':>10} {'ragged ms':>10} {'gather/ragged':>14}")
    for T in (1, 4, 8, 17, 33, 65, 256):
        x = jax.random.normal(keys[4], (T, H))
        w, idx = route(x, w_gate, jnp.zeros(E), top_k=K, n_group=8, topk_group=4, norm_topk_prob=True, scaling=2.5)
        g = timed(jax.jit(experts_gather), x, w, idx, gate, up, down)
        r = timed(jax.jit(experts_ragged), x, w, idx, gate, up, down)
        print(f"{T:>6} {T * K:>6} {g * 1e3:>10.3f} {r * 1e3:>10.3f} {g / r:>14.2f}")


if __name__ == "__main__":
    main()
