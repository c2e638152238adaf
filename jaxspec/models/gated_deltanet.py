"""Gated DeltaNet (Yang et al., "Gated Delta Networks"), as in Qwen3-Next / Qwen3.5: the mixer, its cache
entry, and exact tree verification without per-node state snapshots.

Per value head, with a state S [dk, dv], log-decay g_t <= 0 and write strength beta_t:

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = S_t^T q_t

Unrolled from a start state S_0 over a run of tokens with cumulative log-decay Gamma_i = sum_{j<=i} g_j:

    S_i = exp(Gamma_i) S_0 + sum_{j<=i} exp(Gamma_i - Gamma_j) k_j u_j^T                                 (1)
    u   = (I + L)^{-1} (beta V - (beta K * exp(Gamma)) S_0),  L_ij = beta_i k_i.k_j exp(Gamma_i - Gamma_j), j < i
    o_i = exp(Gamma_i) q_i S_0 + sum_{j<=i} exp(Gamma_i - Gamma_j) (q_i.k_j) u_j

u_j depends only on the tokens j continues from. In a tree, node i continues from its *ancestors*, so the
same block form is exact when every "j <= i" reads "j is i or an ancestor of i" and Gamma_i sums g along
node i's path (`delta_block`): siblings never see each other's writes, nodes in BFS order keep the solve
triangular, and no per-node state is ever formed. Commit then needs only the accepted nodes' k, u and
Gamma: (1) with i = the last accepted node gives the new state in closed form (`GDNEntry.commit`).

Causal runs (prefill) are scanned in chunks of 64 with one state carried between chunks; a single token
(AR decode) is the recurrent step. The short causal conv takes its K-1 previous inputs along the parent
chain, so a tree node reads its ancestors' inputs and a root reads the committed window.

q, k and v stay apart through the projections and the conv: HF fuses them (in_proj_qkv's rows and conv1d's
channels run [q | k | v]), but the conv is depthwise, each channel its own, and apart each splits over tp by its
own heads (q and k by key head, v by value head). Fused, a tp shard's contiguous slice of the [q | k | v] columns
held parts of other shards' heads, and each GDN layer paid 11 collective-permutes a step to regroup them.

Modes (static, on the family config): "exact" (the block form above), "reference" (per-node states stepped
depth by depth from the parent's state: the test oracle), "leaky" (one flat causal scan over the BFS-ordered
tree: siblings leak into each other's state, as in the seed's engine; for benchmarks only).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.models.layers import Linear, param, project
from jaxspec.segment import Segment

CHUNK = 64  # prefill chunk, as in the reference kernels
MODES = ("exact", "reference", "leaky")
_HI = jax.lax.Precision.HIGHEST  # float32 state math: no TF32 on GPU


# ------------------------------------------------------------------------------------------ cache entry


@jax.tree_util.register_dataclass
@dataclass
class GDNPending:
    """What one forward appended, kept until `advance` or `commit` folds it into the entry."""

    conv: tuple[jax.Array, ...]  # q, k, v conv windows [B, K-1, C_i] after the last real token (for advance)
    state: jax.Array  # [B, Hv, dk, dv] f32: state after the last real token (for advance)
    x: tuple[jax.Array, ...]  # q, k, v conv inputs [B, N, C_i] of the new tokens (commit keeps the path's)
    k: jax.Array  # [B, N, Hk, dk] f32: normalised keys
    u: jax.Array  # [B, N, Hv, dv] f32: delta-rule corrections (intrinsic to each node's path)
    gamma: jax.Array  # [B, N, Hv] f32: log-decay summed along each node's path from the committed state


@jax.tree_util.register_dataclass
@dataclass
class GDNEntry:
    """One Gated DeltaNet layer's recurrent cache: the committed conv windows and state (no seq axis)."""

    conv_q: jax.Array  # [B, K-1, Hk * dk]: the last K-1 conv inputs of q
    conv_k: jax.Array  # [B, K-1, Hk * dk]: of k
    conv_v: jax.Array  # [B, K-1, Hv * dv]: of v
    state: jax.Array  # [B, Hv, dk, dv] float32
    pending: GDNPending | None = None  # set by a forward, consumed by advance / commit
    AXES: ClassVar[dict[str, tuple[str, ...]]] = {
        "conv_q": ("batch", "conv_kernel", "gdn_key_heads"),
        "conv_k": ("batch", "conv_kernel", "gdn_key_heads"),
        "conv_v": ("batch", "conv_kernel", "gdn_heads"),
        "state": ("batch", "gdn_heads", "gdn_key_dim", "gdn_value_dim"),
    }

    @staticmethod
    def init(batch: int, s: "GDNSpec", dtype) -> "GDNEntry":
        kd, vd = s.num_key_heads * s.key_dim, s.num_value_heads * s.value_dim
        window = lambda c: jnp.zeros((batch, s.conv_kernel - 1, c), dtype)  # noqa: E731
        return GDNEntry(window(kd), window(kd), window(vd),
                        jnp.zeros((batch, s.num_value_heads, s.key_dim, s.value_dim), jnp.float32))

    @property
    def conv(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The q, k and v conv windows."""
        return self.conv_q, self.conv_k, self.conv_v

    def advance(self, n, length) -> "GDNEntry":
        """Adopt the state after the forward's real tokens. The forward folded exactly `segment.lengths`
        tokens per row, so n must be those lengths (the engine always advances by them)."""
        return GDNEntry(*self.pending.conv, self.pending.state)

    def commit(self, path, n, length, impl: str) -> "GDNEntry":
        """Keep each row's tree nodes path[b, :n[b]] (path [B, P], n [B]): eq. (1) with i = path[b, n[b]-1] over
        the accepted nodes (closed form, no per-node states), and the conv window = the last K-1 inputs of
        [old window | accepted inputs]. `length` and `impl` address KV slots; a recurrent entry has none."""
        p = self.pending
        r = p.u.shape[2] // p.k.shape[2]

        def take(x):  # x [B, N, ...] -> the path's nodes [B, P, ...]
            return jnp.take_along_axis(x, path.reshape(path.shape + (1,) * (x.ndim - 2)), axis=1)

        on = jnp.arange(path.shape[1])[None, :] < n[:, None]  # [B, P]
        last = jnp.take_along_axis(path, jnp.maximum(n - 1, 0)[:, None], axis=1)  # [B, 1]
        g_last = jnp.take_along_axis(p.gamma, last[:, :, None], axis=1)[:, 0]  # [B, Hv]
        k = jnp.repeat(take(p.k), r, axis=2)  # [B, P, Hv, dk]
        state = state_at(self.state, k, take(p.u), take(p.gamma), on, g_last)
        K1 = self.conv_q.shape[1]

        def window(old, x):  # the last K-1 of [old window | accepted inputs] [B, K-1+P, C]
            ext = jnp.concatenate([old, take(x).astype(old.dtype)], axis=1)
            return jax.vmap(lambda e, m: jax.lax.dynamic_slice_in_dim(e, m, K1, axis=0))(ext, n)

        return GDNEntry(*map(window, self.conv, p.x), state)


# ------------------------------------------------------------------------------------------ functional core


def l2norm(x, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def conv_taps(parents, K: int):
    """For every new token, the indices of its K inputs in [window (K-1) | new (N)], oldest first.

    parents [B, N] (-1 = continues from the committed window) -> [B, N, K]; -1 = before the window (zero).
    Walking parent pointers makes the same code a causal conv for chains and an ancestor conv for trees."""
    B, N = parents.shape
    up = jnp.concatenate([jnp.broadcast_to(jnp.arange(K - 1) - 1, (B, K - 1)),  # window slot w -> w - 1
                          jnp.where(parents < 0, K - 2, parents + K - 1)], axis=1)  # [B, K-1+N]
    idx = [jnp.broadcast_to(jnp.arange(N) + K - 1, (B, N))]
    for _ in range(K - 1):
        prev = idx[-1]
        idx.append(jnp.where(prev < 0, -1, jnp.take_along_axis(up, jnp.maximum(prev, 0), axis=1)))
    return jnp.stack(idx[::-1], axis=-1)


def gather_tokens(ext, idx):
    """ext [B, T, C], idx [B, ...] (-1 = zero) -> [B, ..., C]."""
    B, C = ext.shape[0], ext.shape[-1]
    flat = idx.reshape(B, -1)
    out = jnp.take_along_axis(ext, jnp.maximum(flat, 0)[..., None], axis=1)
    return jnp.where(flat[..., None] >= 0, out, 0).reshape(*idx.shape, C)


def short_conv(window, x, taps, weight):
    """Depthwise causal conv (no bias) along each token's parent chain, then SiLU.

    window [B, K-1, C] committed inputs; x [B, N, C] new inputs; taps [B, N, K] (`conv_taps`); weight [C, K]
    (weight[:, K-1] multiplies the token itself). Returns (out [B, N, C], [window | x] [B, K-1+N, C])."""
    ext = jnp.concatenate([window, x.astype(window.dtype)], axis=1)
    cols = gather_tokens(ext, taps)  # [B, N, K, C]
    out = jnp.einsum("bnkc,ck->bnc", cols.astype(jnp.float32), weight.astype(jnp.float32), precision=_HI)
    return jax.nn.silu(out).astype(x.dtype), ext


def state_at(S0, k, u, gamma, sel, gamma_e):
    """Eq. (1): S0 [B, H, dk, dv] advanced over the selected tokens. k [B, n, H, dk]; u [B, n, H, dv];
    gamma [B, n, H]; sel [B, n] (the end node and its ancestors); gamma_e [B, H] (the end node's)."""
    w = jnp.where(sel[..., None], jnp.exp(jnp.minimum(gamma_e[:, None] - gamma, 0.0)), 0.0)
    return jnp.exp(gamma_e)[..., None, None] * S0 + jnp.einsum("bnh,bnhk,bnhv->bhkv", w, k, u, precision=_HI)


def delta_block(q, k, v, g, beta, visible, S0):
    """The gated delta rule over one block of tokens whose dependencies are `visible` (causal or ancestors).

    q, k [B, n, H, dk] (l2-normalised, q scaled); v [B, n, H, dv]; g, beta [B, n, H] f32;
    visible [B, n, n] bool (i continues from j: j is i or an ancestor); S0 [B, H, dk, dv] f32.
    Returns o [B, n, H, dv], u [B, n, H, dv], gamma [B, n, H] (see the module docstring)."""
    n = q.shape[1]
    vis = visible.astype(jnp.float32)
    gamma = jnp.einsum("bij,bjh->bih", vis, g, precision=_HI)  # log-decay along each path
    diff = gamma[:, :, None, :] - gamma[:, None, :, :]  # [B, i, j, H]
    decay = jnp.where(visible[..., None], jnp.exp(jnp.where(visible[..., None], diff, 0.0)), 0.0)  # 0 off-path
    # strictly lower in effect: non-ancestors have no decay, and the solve ignores the diagonal
    L = (jnp.einsum("bihd,bjhd->bhij", k, k, precision=_HI) * decay.transpose(0, 3, 1, 2)
         * beta.transpose(0, 2, 1)[..., None])
    eg = jnp.exp(gamma)  # [B, n, H]
    rhs = beta[..., None] * (v - eg[..., None] * jnp.einsum("bihd,bhde->bihe", k, S0, precision=_HI))
    u = jax.scipy.linalg.solve_triangular(L + jnp.eye(n, dtype=L.dtype), rhs.transpose(0, 2, 1, 3), lower=True,
                                          unit_diagonal=True)  # [B, H, n, dv]
    qk = jnp.einsum("bihd,bjhd->bhij", q, k, precision=_HI) * decay.transpose(0, 3, 1, 2)
    o = eg[..., None] * jnp.einsum("bihd,bhde->bihe", q, S0, precision=_HI) + \
        jnp.einsum("bhij,bhje->bihe", qk, u, precision=_HI)
    return o, u.transpose(0, 2, 1, 3), gamma


def recurrent_step(S, q, k, v, g, beta):
    """One token from state S [B, H, dk, dv]: q, k [B, H, dk]; v [B, H, dv]; g, beta [B, H].
    Returns (o [B, H, dv], u [B, H, dv], S')."""
    S = jnp.exp(g)[..., None, None] * S
    u = beta[..., None] * (v - jnp.einsum("bhkv,bhk->bhv", S, k, precision=_HI))
    S = S + k[..., :, None] * u[..., None, :]
    return jnp.einsum("bhkv,bhk->bhv", S, q, precision=_HI), u, S


def chunked(q, k, v, g, beta, S0, chunk: int = CHUNK):
    """A causal run scanned in chunks, one state carried across. Shapes as `delta_block` (n any length);
    tokens padded to a multiple of `chunk` are identity steps (g = beta = 0, k = q = 0)."""
    B, n, H, dk = k.shape
    C = min(chunk, n)
    pad = -n % C

    def split(a):
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return a.reshape(B, -1, C, *a.shape[2:]).swapaxes(0, 1)  # [chunks, B, C, ...]

    causal = jnp.broadcast_to(jnp.tril(jnp.ones((C, C), bool)), (B, C, C))

    def body(S, blk):
        qc, kc, vc, gc, bc = blk
        o, u, gamma = delta_block(qc, kc, vc, gc, bc, causal, S)
        S = state_at(S, kc, u, gamma, jnp.ones((B, C), bool), gamma[:, -1])
        return S, (o, u, gamma)

    S, (o, u, gamma) = jax.lax.scan(body, S0, tuple(split(a) for a in (q, k, v, g, beta)))
    merge = lambda a: a.swapaxes(0, 1).reshape(B, -1, *a.shape[3:])[:, :n]  # noqa: E731
    offset = jnp.cumsum(gamma[:, :, -1], axis=0) - gamma[:, :, -1]  # [chunks, B, H]: decay before each chunk
    return merge(o), merge(u), merge(gamma + offset[:, :, None]), S


def tree_reference(q, k, v, g, beta, parents, S0):
    """Test oracle: every node's own state, stepped depth by depth from its parent's state.
    parents [B, n] (-1 = the committed state). Returns o, u, gamma like `delta_block`, and the per-node
    states [B, n, H, dk, dv] (memory n x H x dk x dv: fine for tests, what production avoids)."""
    B, n, H = g.shape
    depth = [jnp.zeros((B,), jnp.int32)]
    for i in range(1, n):  # parents precede children
        d_par = jnp.stack(depth, 1)[jnp.arange(B), jnp.maximum(parents[:, i], 0)]
        depth.append(jnp.where(parents[:, i] < 0, 0, d_par + 1))
    depth = jnp.stack(depth, 1)  # [B, n]
    slot = parents + 1  # parent's slot in `states` / `gammas`; slot 0 holds the committed state
    step = jax.vmap(recurrent_step, in_axes=1, out_axes=1)  # every node at once, from its parent's state
    states = jnp.concatenate([S0[:, None], jnp.zeros((B, n, *S0.shape[1:]), S0.dtype)], axis=1)
    gammas = jnp.zeros((B, n + 1, H), jnp.float32)
    o = u = jnp.zeros(v.shape, jnp.float32)
    for d in range(n):
        at = depth == d  # [B, n]: this depth's nodes; their parents are final
        o_d, u_d, S_d = step(jnp.take_along_axis(states, slot[..., None, None, None], axis=1), q, k, v, g, beta)
        o = jnp.where(at[..., None, None], o_d, o)
        u = jnp.where(at[..., None, None], u_d, u)
        states = states.at[:, 1:].set(jnp.where(at[..., None, None, None], S_d, states[:, 1:]))
        gamma_d = jnp.take_along_axis(gammas, slot[..., None], 1) + g
        gammas = gammas.at[:, 1:].set(jnp.where(at[..., None], gamma_d, gammas[:, 1:]))
    return o, u, gammas[:, 1:], states[:, 1:]


# ------------------------------------------------------------------------------------------ the mixer


@dataclass(frozen=True)
class GDNSpec:
    hidden_size: int
    num_key_heads: int  # Hk
    num_value_heads: int  # Hv (a multiple of Hk: value head j reads key head j // (Hv / Hk))
    key_dim: int  # dk
    value_dim: int  # dv
    conv_kernel: int  # K
    eps: float
    fused: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba, in HF's key-head-grouped layout
    mode: str = "exact"


class GatedRMSNorm(nnx.Module):
    """w * rmsnorm(o) * silu(z) per head (plain weight, ones at init), as Qwen3NextRMSNormGated."""

    def __init__(self, dim: int, eps: float, dtype):
        self.eps = eps
        self.weight = param(jnp.ones((dim,), dtype), ("gdn_value_dim",))

    def __call__(self, o, z):
        o32 = o.astype(jnp.float32)
        on = (o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, -1, keepdims=True) + self.eps)).astype(z.dtype)
        return (self.weight[...] * on * jax.nn.silu(z.astype(jnp.float32))).astype(z.dtype)


def _linear(kernel, axes) -> Linear:
    """A Linear holding `kernel` [in, out], drawn by the caller."""
    lin = Linear(*kernel.shape, axes, dtype=kernel.dtype, rngs=nnx.Rngs(0))
    lin.kernel = param(kernel, axes)
    return lin


class GatedDeltaNet(nnx.Module):
    def __init__(self, spec: GDNSpec, *, dtype=jnp.float32, rngs: nnx.Rngs):
        if spec.mode not in MODES:
            raise ValueError(f"unknown gdn mode {spec.mode!r}; use one of {', '.join(MODES)}")
        self.spec = s = spec
        H, Hv, kd, vd = s.hidden_size, s.num_value_heads, s.num_key_heads * s.key_dim, s.num_value_heads * s.value_dim
        axes = ("gdn_key_heads", "gdn_key_heads", "gdn_heads")  # q, k, v
        # HF fuses q, k and v in in_proj_qkv and conv1d; here they are apart (checkpoint/qwen3_next.py splits them),
        # but each is drawn as the fused matrix and cut, so a random model keeps the weights it had fused
        if s.fused:
            self.in_proj_qkvz = Linear(H, 2 * kd + 2 * vd, ("embed", "gdn_key_heads"), dtype=dtype, rngs=rngs)
            self.in_proj_ba = Linear(H, 2 * Hv, ("embed", "gdn_key_heads"), dtype=dtype, rngs=rngs)
        else:
            qkv = jnp.split(jax.random.normal(rngs.params(), (H, 2 * kd + vd), dtype) * H**-0.5, [kd, 2 * kd], axis=1)
            self.in_proj_q, self.in_proj_k, self.in_proj_v = (_linear(w, ("embed", a)) for w, a in zip(qkv, axes))
            self.in_proj_z = Linear(H, vd, ("embed", "gdn_heads"), dtype=dtype, rngs=rngs)
            self.in_proj_b = Linear(H, Hv, ("embed", "gdn_heads"), dtype=dtype, rngs=rngs)
            self.in_proj_a = Linear(H, Hv, ("embed", "gdn_heads"), dtype=dtype, rngs=rngs)
        K = s.conv_kernel
        conv = jnp.split(jax.random.normal(rngs.params(), (2 * kd + vd, K), dtype) * K**-0.5, [kd, 2 * kd])
        self.conv_q, self.conv_k, self.conv_v = (param(w, (a, "conv_kernel")) for w, a in zip(conv, axes))
        # HF draws A from U(0.01, 16); a narrower range keeps random models' states alive across many tokens
        A = jax.random.uniform(rngs.params(), (Hv,), jnp.float32, 0.05, 1.0)
        self.A_log = param(jnp.log(A).astype(dtype), ("gdn_heads",))
        self.dt_bias = param(jnp.ones((Hv,), dtype), ("gdn_heads",))
        self.norm = GatedRMSNorm(s.value_dim, s.eps, dtype)
        self.out_proj = Linear(vd, H, ("gdn_heads", "embed"), dtype=dtype, rngs=rngs)

    def project(self, x):
        """x [B, N, H] -> conv inputs q, k [B, N, Hk * dk] and v [B, N, Hv * dv], z [B, N, Hv, dv], b, a [B, N, Hv].

        The fused projections keep HF's layout, grouped by key head g: qkvz = [q_g | k_g | v_g | z_g] and
        ba = [b_g | a_g] per group (value head g*r + j), so a shard of key heads is a contiguous column block."""
        s = self.spec
        B, N, _ = x.shape
        Hk, Hv, dk, dv = s.num_key_heads, s.num_value_heads, s.key_dim, s.value_dim
        r = Hv // Hk
        if s.fused:
            qkvz = self.in_proj_qkvz(x).reshape(B, N, Hk, 2 * dk + 2 * r * dv)
            q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
            b, a = jnp.split(self.in_proj_ba(x).reshape(B, N, Hk, 2 * r), 2, axis=-1)
            q, k, v, z, b, a = (t.reshape(B, N, -1) for t in (q, k, v, z, b, a))
        else:
            q, k, v, z, b, a = project(x, self.in_proj_q, self.in_proj_k, self.in_proj_v, self.in_proj_z,
                                       self.in_proj_b, self.in_proj_a)
        return (q, k, v), z.reshape(B, N, Hv, dv), b, a

    def __call__(self, x, segment: Segment, entry: GDNEntry, real):
        """x [B, N, H]; real [B, N] bool (False: left or right padding, an identity step).
        Returns (out [B, N, H], entry with `pending` set)."""
        s = self.spec
        B, N, _ = x.shape
        Hk, Hv, dk, dv = s.num_key_heads, s.num_value_heads, s.key_dim, s.value_dim
        if s.mode == "leaky":  # the seed's bug: the tree's BFS order read as one causal run
            segment = Segment.causal(segment.positions, segment.lengths)
        xs, z, b, a = self.project(x)
        xs = tuple(jnp.where(real[..., None], t, 0) for t in xs)  # padding never reaches a window or a state
        taps = conv_taps(segment.parents, s.conv_kernel)
        weights = (self.conv_q[...], self.conv_k[...], self.conv_v[...])
        (q, ext_q), (k, ext_k), (v, ext_v) = map(short_conv, entry.conv, xs, (taps,) * 3, weights)
        q = l2norm(q.astype(jnp.float32).reshape(B, N, Hk, dk)) * dk**-0.5
        k = l2norm(k.astype(jnp.float32).reshape(B, N, Hk, dk))
        v = v.astype(jnp.float32).reshape(B, N, Hv, dv)
        beta = jnp.where(real[..., None], jax.nn.sigmoid(b.astype(jnp.float32)), 0.0)
        f32 = lambda t: t.astype(jnp.float32)  # noqa: E731
        g = -jnp.exp(f32(self.A_log[...])) * jax.nn.softplus(f32(a) + f32(self.dt_bias[...]))
        g = jnp.where(real[..., None], g, 0.0)
        qr, kr = (jnp.repeat(t, Hv // Hk, axis=2) for t in (q, k))
        last = jnp.maximum(segment.lengths - 1, 0)  # [B] the last real token
        has = (segment.lengths > 0)[:, None]
        if N == 1:
            o, u, S = recurrent_step(entry.state, qr[:, 0], kr[:, 0], v[:, 0], g[:, 0], beta[:, 0])
            o, u, gamma = o[:, None], u[:, None], g
        elif segment.chain:
            o, u, gamma, S = chunked(qr, kr, v, g, beta, entry.state)  # right padding: identity steps
        elif s.mode == "reference":
            o, u, gamma, states = tree_reference(qr, kr, v, g, beta, segment.parents, entry.state)
            S = jnp.where(has[..., None, None], states[jnp.arange(B), last], entry.state)
        else:
            o, u, gamma = delta_block(qr, kr, v, g, beta, segment.visible, entry.state)
            sel = jnp.take_along_axis(segment.visible, last[:, None, None], axis=1)[:, 0] & has  # [B, N]
            S = state_at(entry.state, kr, u, gamma, sel, jnp.take_along_axis(gamma, last[:, None, None], 1)[:, 0] * has)
        # the conv window after the last real token: its K-1 newest inputs along its parent chain
        end = jnp.take_along_axis(taps, last[:, None, None], axis=1)[:, 0, 1:]  # [B, K-1]
        end = jnp.where(has, end, jnp.arange(s.conv_kernel - 1)[None])  # no real token: the window stays
        conv = tuple(gather_tokens(e, end) for e in (ext_q, ext_k, ext_v))
        pending = GDNPending(conv=conv, state=S, x=xs, k=k, u=u, gamma=gamma)
        y = self.norm(o.astype(x.dtype), z)
        return self.out_proj(y.reshape(B, N, Hv * dv)), replace(entry, pending=pending)
