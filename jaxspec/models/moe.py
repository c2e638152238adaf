"""Sparse MoE with a gated shared expert (Qwen3-Next, Qwen3.5-MoE).

    p = softmax(x W_router) over all experts; w, idx = top-k(p) (renormalised when norm_topk_prob)
    y = sum_k w_k expert_{idx_k}(x) + sigmoid(x w_sg) * shared_expert(x)

Experts are stacked ([E, ...], filled slice by slice by the loader) and run as grouped matmuls
(`lax.ragged_dot` over the token-expert pairs sorted by expert), so only the chosen experts are computed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.models.layers import MLP, Linear, param


class Experts(nnx.Module):
    def __init__(self, num_experts: int, d: int, d_ff: int, *, dtype, rngs: nnx.Rngs):
        init = lambda shape, fan_in: jax.random.normal(rngs.params(), shape, dtype) * fan_in**-0.5  # noqa: E731
        self.gate_proj = param(init((num_experts, d, d_ff), d), ("experts", "embed", "ffn"))
        self.up_proj = param(init((num_experts, d, d_ff), d), ("experts", "embed", "ffn"))
        self.down_proj = param(init((num_experts, d_ff, d), d_ff), ("experts", "ffn", "embed"))

    def __call__(self, x, idx, w):
        """x [T, H]; idx, w [T, k] chosen experts and their weights -> [T, H]."""
        T, k = idx.shape
        E = self.gate_proj.shape[0]
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # token-expert pairs grouped by expert
        tok = order // k
        sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
        xs = x[tok]
        dot = lambda a, b: jax.lax.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32).astype(x.dtype)  # noqa: E731
        h = jax.nn.silu(dot(xs, self.gate_proj[...])) * dot(xs, self.up_proj[...])
        y = dot(h, self.down_proj[...]) * w.reshape(-1)[order][:, None].astype(x.dtype)
        return jnp.zeros_like(x).at[tok].add(y)


class SparseMoeBlock(nnx.Module):
    def __init__(self, d: int, num_experts: int, top_k: int, d_ff: int, shared_d_ff: int, norm_topk_prob: bool, *,
                 dtype, rngs: nnx.Rngs):
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = Linear(d, num_experts, ("embed", "experts"), dtype=dtype, rngs=rngs)
        self.experts = Experts(num_experts, d, d_ff, dtype=dtype, rngs=rngs)
        self.shared_expert = MLP(d, shared_d_ff, "silu", dtype=dtype, rngs=rngs)
        self.shared_expert_gate = Linear(d, 1, ("embed", "shared_gate"), dtype=dtype, rngs=rngs)

    def __call__(self, x):
        """x [B, N, H] -> [B, N, H]."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        p = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)
        w, idx = jax.lax.top_k(p, self.top_k)
        if self.norm_topk_prob:
            w = w / jnp.sum(w, axis=-1, keepdims=True)
        y = self.experts(x, idx, w.astype(x.dtype))
        y = y + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y.reshape(shape)
