"""Mixtures of experts: stacked routed experts shared by two blocks.

  * `MoE` (DeepSeek-V3, Kimi K2): a sigmoid router with group-limited top-k, plus shared experts.
  * `SparseMoeBlock` (Qwen3-Next, Qwen3.5-MoE): softmax top-k, plus one shared expert behind a sigmoid gate:
        p = softmax(x W_router); w, idx = top-k(p) (renormalised when norm_topk_prob)
        y = sum_k w_k expert_{idx_k}(x) + sigmoid(x w_sg) * shared_expert(x)

Gemma 4's MoE block (models/gemma4.py) has its own router but runs its experts through the same two
functions, with GeGLU and the fused gate_up layout its checkpoints store.

DeepSeek's router (`DeepseekV3TopkRouter`, float32 whatever the model dtype): s = sigmoid(x W_gate); the correction
bias is added for *selection only*: groups are ranked by the sum of their two best biased scores, the best
`topk_group` groups kept, the top `num_experts_per_tok` experts chosen among them; the weights are the
*unbiased* s of the chosen experts, renormalised (norm_topk_prob) and times `routed_scaling_factor`.

Experts are stacked, gate/up [E, H, I] and down [E, I, H], so one parameter holds every expert (the
checkpoint's per-expert tensors are stacked by the loader's `stack=` rules) and an `experts` mesh axis can
shard them. Two ways to run the routed experts, chosen by the number of (token, expert) pairs M = T k:

  * `experts_gather`: gather the M chosen experts' weights and apply each to its token. Reads M expert
    matrices, so it is right for few tokens (decode, tree verify), where most experts are idle.
  * `experts_ragged`: sort the M pairs by expert and run `jax.lax.ragged_dot` (a grouped matmul over
    contiguous groups). Reads each expert once: right for prefill.

On a CPU gathering wins for few pairs and loses past about 64 (bench/cpu/moe_experts.py times both by token
count; its figures are in docs/design/mla-moe.md). So gather up to 64 pairs (decode), ragged above.
"""
from __future__ import annotations

import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxspec import kernels
from jaxspec.models import quant
from jaxspec.models.layers import MLP, Linear, param

GATHER_MAX_PAIRS = 64  # (token, expert) pairs up to which gathering experts is used: the crossover that
# bench/cpu/moe_experts.py measures


def route(x, w_gate, bias, *, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool, scaling: float):
    """x [T, H]; w_gate [H, E] float32; bias [E] -> (weights [T, k] float32, expert ids [T, k] int32)."""
    T = x.shape[0]
    E = w_gate.shape[1]
    s = jax.nn.sigmoid(x.astype(jnp.float32) @ w_gate.astype(jnp.float32))  # [T, E]
    choice = s + bias.astype(jnp.float32)
    groups = choice.reshape(T, n_group, E // n_group)
    group_score = jax.lax.top_k(groups, 2)[0].sum(-1)  # [T, G]
    keep = jax.lax.top_k(group_score, topk_group)[1]  # [T, topk_group]
    group_mask = jnp.zeros((T, n_group), bool).at[jnp.arange(T)[:, None], keep].set(True)
    choice = jnp.where(jnp.repeat(group_mask, E // n_group, axis=1), choice, -jnp.inf)  # HF 5.x masks with -inf
    idx = jax.lax.top_k(choice, top_k)[1]  # [T, k]
    w = jnp.take_along_axis(s, idx, axis=1)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * scaling, idx.astype(jnp.int32)


def _glu(g, u, act):
    """act(gate) * up; u None: g holds both halves, [..., gate | up] (a fused gate_up projection)."""
    if u is None:
        g, u = jnp.split(g, 2, axis=-1)
    return act(g) * u


def experts_gather(x, w, idx, gate, up, down, act=jax.nn.silu, *, gathered: bool = False):
    """x [T, H], w/idx [T, k], gate/up [E, H, I], down [E, I, H] -> [T, H]: each pair's expert gathered.

    up None: gate is the fused [E, H, 2I] (gate | up) projection (Gemma 4), one matmul instead of two.
    gathered: gate/up/down are already the chosen experts' weights, [T, k, H, I] / [T, k, I, H]."""
    if not gathered:
        gate, up, down = gate[idx], None if up is None else up[idx], down[idx]
    g = jnp.einsum("th,tkhi->tki", x, gate)
    u = None if up is None else jnp.einsum("th,tkhi->tki", x, up)
    y = jnp.einsum("tki,tkih->tkh", _glu(g, u, act), down)  # [T, k, H]
    return jnp.einsum("tkh,tk->th", y, w.astype(y.dtype))


def experts_ragged(x, w, idx, gate, up, down, act=jax.nn.silu):
    """Same contract as `experts_gather`: pairs sorted by expert, one grouped product (`kernels.ragged_dot`) per
    projection.

    Experts split over a mesh (expert parallel: jaxspec.sharding gives each device E / tp whole experts) run in a
    shard_map: each device sorts its dp rows' pairs, takes the run of them its own experts hold, adds their outputs
    into its tokens, and one all-reduce of [T / dp, H] over tp sums the devices. The grouped product then holds one
    device's arrays, which a kernel (a custom call the partitioner cannot split) needs, and the all-reduce moves
    tokens rather than k times as many pairs."""
    weights = tuple(p for p in (gate, up, down) if p is not None)
    unpack = (lambda g, u, d: (g, u, d)) if up is not None else (lambda g, d: (g, None, d))
    names = _expert_axes(gate)
    if not names:
        return _own_experts(x, w, idx, 0, *unpack(*weights), act)
    mesh = jax.typeof(gate).sharding.mesh
    dp = mesh.shape.get("dp", 1)
    rows = P("dp") if dp > 1 and x.shape[0] % dp == 0 else P()

    # a device's own pairs run in pieces of twice the even share (a piece's grouped product costs all its rows): one
    # or two pieces with a router's usual balance, where the whole run of pairs would cost every device all of them
    M = idx.size // (dp if rows != P() else 1)  # one device's pairs
    share = -(-M // math.prod(mesh.shape[a] for a in names))
    piece = min(M, 64 * -(-2 * share // 64))  # twice the share, in whole 64-row tiles

    def local(x, w, idx, *weights):  # one device: its rows' pairs with experts d * G .. d * G + G - 1
        first = lax.axis_index(names) * weights[0].shape[0]
        return lax.psum(_own_experts(x, w, idx, first, *unpack(*weights), act, piece=piece), names)

    return jax.shard_map(local, mesh=mesh, in_specs=(rows,) * 3 + (P(names),) * len(weights), out_specs=rows,
                         check_vma=False)(x, w, idx, *weights)


def _own_experts(x, w, idx, first, gate, up, down, act, piece: int | None = None):
    """x [T, H], w/idx [T, k] -> [T, H]: the pairs routed to experts first .. first + G - 1 (gate/up [G, H, I],
    down [G, I, H]; all of them when first is 0 and G the router's E), sorted by expert, through one grouped
    product per projection. Other experts' pairs come after them and add nothing: they are masked, because a
    kernel may run them through the last group (`kernels.ragged_dot` leaves rows past the groups unspecified).

    piece: run the own pairs in pieces of this many rows, as many as they fill (a loop with a traced trip count),
    instead of all M pairs at once: under expert parallelism a device's own run is about M / devices long."""
    T, k = idx.shape
    G = gate.shape[0]
    flat = idx.reshape(-1)  # [M]
    M = flat.shape[0]
    key = jnp.where((flat >= first) & (flat < first + G), flat - first, G)  # own experts 0 .. G - 1, others G
    order = jnp.argsort(key, stable=True)  # own pairs by expert, then the others
    token = order // k  # the token of each sorted pair
    ws = w.reshape(-1)[order].astype(x.dtype)
    sizes = jnp.bincount(key, length=G).astype(jnp.int32)  # [G] pairs per own expert (key G is dropped)

    def run(rows, sizes, out):  # sorted pairs `rows` [R] in groups of sizes [G] (summing to at most R), into out
        xs = x[token[rows]]  # [R, H]
        u = None if up is None else kernels.ragged_dot(xs, up, sizes)
        h = _glu(kernels.ragged_dot(xs, gate, sizes), u, act)
        y = kernels.ragged_dot(h, down, sizes)  # [R, H]
        y = jnp.where((jnp.arange(rows.shape[0]) < sizes.sum())[:, None], y * ws[rows][:, None], 0)
        return out.at[token[rows]].add(y.astype(x.dtype))

    if piece is None or piece >= M:
        return run(jnp.arange(M), sizes, jnp.zeros_like(x))
    ends = jnp.cumsum(sizes)

    def one_piece(i, out):  # sorted pairs i * piece .. (i + 1) * piece - 1, each group cut to them
        at = i * piece
        cut = jnp.clip(ends - at, 0, piece) - jnp.clip(ends - sizes - at, 0, piece)
        return run(jnp.minimum(at + jnp.arange(piece), M - 1), cut, out)

    return lax.fori_loop(0, (sizes.sum() + piece - 1) // piece, one_piece, jnp.zeros_like(x))


def _expert_axes(w) -> tuple[str, ...]:
    """The mesh axes stacked experts w [E, ...] are split over inside jit (jaxspec.sharding's rule: tp, or both
    halves of its split view), or () when w is on one device or not split by expert."""
    mesh = getattr(getattr(jax.typeof(w), "sharding", None), "mesh", None)
    if mesh is None or mesh.empty or mesh.size == 1:
        return ()
    names = tuple(a for a in ("tp", "tp_kv", "tp_rep") if a in mesh.shape)
    n = math.prod(mesh.shape[a] for a in names)
    return names if n > 1 and w.shape[0] % n == 0 else ()


class MoE(nnx.Module):
    """DeepseekV3MoE: routed experts (stacked) + shared experts, parameters under HF's names."""

    def __init__(self, hidden: int, moe_intermediate: int, num_experts: int, num_shared: int, *, top_k: int,
                 n_group: int, topk_group: int, norm_topk_prob: bool, scaling: float, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        if num_experts % n_group or num_experts // n_group < 2:
            raise ValueError(f"n_routed_experts {num_experts} must split into n_group {n_group} groups of at least 2")
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.scaling = norm_topk_prob, scaling
        H, I, E = hidden, moe_intermediate, num_experts
        self.gate = Router(H, E, rngs=rngs)
        self.experts = Experts(E, H, I, dtype=dtype, rngs=rngs)
        self.shared_experts = MLP(H, I * num_shared, "silu", dtype=dtype, rngs=rngs)

    def __call__(self, x):
        """x [B, N, H] -> [B, N, H]."""
        B, N, H = x.shape
        flat = x.reshape(B * N, H)
        w, idx = route(flat, self.gate.weight[...], self.gate.e_score_correction_bias[...], top_k=self.top_k,
                       n_group=self.n_group, topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
                       scaling=self.scaling)
        return self.experts(flat, w, idx).reshape(B, N, H) + self.shared_experts(x)


class Router(nnx.Module):
    """`mlp.gate`: weight [H, E] and the selection bias [E], float32 always (HF keeps them in fp32)."""

    def __init__(self, hidden: int, num_experts: int, *, rngs: nnx.Rngs):
        self.weight = param(jax.random.normal(rngs.params(), (hidden, num_experts), jnp.float32) * hidden**-0.5,
                            ("embed", "experts"))
        self.e_score_correction_bias = param(jnp.zeros((num_experts,), jnp.float32), ("experts",))


def expert_weights(p, idx=None) -> jax.Array:
    """A stacked projection as float [E, in, out], or only the chosen experts' [T, k, in, out] for idx [T, k].
    A packed one ([E, out, in] codes) is gathered first, so only the chosen experts are dequantised."""
    if not isinstance(p, quant.Packed):
        return p[...] if idx is None else p[...][idx]
    parts = [None if a is None else (a if idx is None else a[idx]) for a in p.parts()]
    return jnp.swapaxes(quant.dequantize(*parts), -1, -2)


class Experts(nnx.Module):
    """`mlp.experts`: every routed expert's gate/up [E, H, I] and down [E, I, H] projections, stacked (or each
    packed by `quant.pack_module`: codes [E, out, in])."""

    packable: ClassVar[tuple[str, ...]] = ("gate_proj", "up_proj", "down_proj")  # what quant.linear_plan may pack

    def __init__(self, num_experts: int, hidden: int, d_ff: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        E, H, I = num_experts, hidden, d_ff
        normal = lambda shape, fan_in: jax.random.normal(rngs.params(), shape, dtype) * fan_in**-0.5  # noqa: E731
        self.gate_proj = param(normal((E, H, I), H), ("experts", "embed", "ffn"))
        self.up_proj = param(normal((E, H, I), H), ("experts", "embed", "ffn"))
        self.down_proj = param(normal((E, I, H), I), ("experts", "ffn", "embed"))

    def __call__(self, x, w, idx):
        """x [T, H], w/idx [T, k] -> [T, H], gathering experts for few (token, expert) pairs, ragged_dot above."""
        projs = (self.gate_proj, self.up_proj, self.down_proj)
        if idx.size <= GATHER_MAX_PAIRS:
            return experts_gather(x, w, idx, *(expert_weights(p, idx) for p in projs), gathered=True)
        return experts_ragged(x, w, idx, *(expert_weights(p) for p in projs))


class SparseMoeBlock(nnx.Module):
    """Qwen3-Next / Qwen3.5-MoE sparse block, parameters under HF's names."""

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
        y = self.experts(x, w.astype(x.dtype), idx)
        y = y + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y.reshape(shape)
