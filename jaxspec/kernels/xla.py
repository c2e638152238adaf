"""The seam's ops in plain JAX: the reference every backend is tested against, and the form that runs on any
platform without a kernel of its own (GPUs today, a sharded model, a lowering for another platform).

Shapes follow the seam (`jaxspec.kernels`): weights are [in, out] (`transposed`: [out, in], a tied embedding
as the LM head), packed weights [out, in] as in `jaxspec.models.quant`, the KV cache [B, KVH, T, D].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1e30  # finite, so fully masked padding rows give a uniform softmax instead of NaN


def dense(x: jax.Array, w: jax.Array, *, transposed: bool = False, select: jax.Array | None = None,
          out_dtype=None) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N]; `transposed`: w is [N, K]; `select` [M]: only those outputs (columns of
    w, rows when transposed) -> [..., M]. out_dtype: the accumulation and output type (float32 logits from bf16
    weights)."""
    if not transposed:
        w = w if select is None else jnp.take(w, select, axis=1)
        return jnp.matmul(x, w, preferred_element_type=out_dtype)
    w = w if select is None else jnp.take(w, select, axis=0)
    return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=out_dtype)


def argmax(logits: jax.Array) -> jax.Array:
    """`jnp.argmax(logits, -1)` as int32 (the first maximum; the first NaN if any), as two plain reductions:
    XLA:CPU runs them faster than argmax's (value, index) reduction."""
    m = jnp.max(logits, axis=-1, keepdims=True)  # NaN if any is
    hit = (logits == m) | jnp.isnan(logits)
    V = logits.shape[-1]
    return jnp.min(jnp.where(hit, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def attention(q, k, v, mask, scale: float, softcap: float | None = None):
    """Softmax attention in float32 over a whole KV buffer. q: [B, N, H, D]; k, v: [B, KVH, T, D] (GQA: H a
    multiple of KVH); mask: [B, N, T] -> [B, N, H, D].

    Each KV head's query group is laid out as one [G * N, D] matrix first, so both products are plain batched
    matmuls over (row, KV head); XLA:CPU runs the 5-d einsum over (g, n) several times slower. k and v are
    used as stored: a reshape of the freshly written cache makes XLA copy it every step."""
    B, N, H, D = q.shape
    KVH, T = k.shape[1], k.shape[2]
    G = H // KVH
    qg = q.reshape(B, N, KVH, G, D).transpose(0, 2, 3, 1, 4).reshape(B, KVH, G * N, D)
    s = jnp.einsum("bkqd,bktd->bkqt", qg, k, preferred_element_type=jnp.float32) * scale
    s = s.reshape(B, KVH, G, N, T)
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(mask[:, None, None, :, :], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype).reshape(B, KVH, G * N, T)
    o = jnp.einsum("bkqt,bktd->bkqd", p, v, preferred_element_type=jnp.float32)
    return o.reshape(B, KVH, G, N, D).transpose(0, 3, 1, 2, 4).reshape(B, N, H, D).astype(q.dtype)


def latent_attention(q, latent, mask, scale: float, value_dim: int):
    """MLA's absorbed attention: every head attends over one shared key, the latent row [c_kv | k_pe], and
    reads one shared value, its first `value_dim` entries (c_kv). q: [B, N, H, C] (W_UK already folded in);
    latent: [B, T, C]; mask: [B, N, T] -> [B, H, N, value_dim] in q's dtype (heads beside the batch axis:
    XLA:CPU has no bf16 x bf16 -> f32 dot for the other output order). Softmax in float32, cast back (HF)."""
    s = jnp.einsum("bnhc,btc->bhnt", q, latent, preferred_element_type=jnp.float32) * scale
    p = jax.nn.softmax(jnp.where(mask[:, None], s, NEG_INF), axis=-1).astype(latent.dtype)
    return jnp.einsum("bhnt,btr->bhnr", p, latent[..., :value_dim], preferred_element_type=jnp.float32).astype(q.dtype)


def expanded_latent_attention(q, latent, mask, w_kvb, scale: float, nope_dim: int):
    """MLA's expanded form (HF's): every slot's latent is up-projected through kv_b_proj into per-head keys
    [c_kv W_UK | k_pe] and values c_kv W_UV, then multi-head attention. q: [B, N, H, dn + dr] ([q_nope | q_pe]);
    latent: [B, T, r + dr]; mask: [B, N, T]; w_kvb: [r, H * (dn + dv)]; nope_dim: dn -> [B, N, H, dv] in q's dtype.
    The expansion is once per slot whatever N is: the cheaper form for long prefill chunks (models/mla.py)."""
    B, N, H, _ = q.shape
    T, r = latent.shape[1], w_kvb.shape[0]
    kv = (latent[..., :r] @ w_kvb).reshape(B, T, H, -1)
    k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]
    k_pe = jnp.broadcast_to(latent[:, :, None, r:], (B, T, H, latent.shape[-1] - r))
    s = jnp.einsum("bnhd,bthd->bhnt", q, jnp.concatenate([k_nope, k_pe], -1), preferred_element_type=jnp.float32)
    p = jax.nn.softmax(jnp.where(mask[:, None], s * scale, NEG_INF), axis=-1).astype(v.dtype)
    return jnp.einsum("bhnt,bthd->bnhd", p, v, preferred_element_type=jnp.float32).astype(q.dtype)


def cache_attention(q, k_old, v_old, k_new, v_new, length, mask, scale: float, softcap: float | None = None):
    """Softmax attention (float32) of q [B, N, H, D] over the committed slots of the cache k_old, v_old
    [B, KVH, T, D] (row b's slot t where t < length[b] and mask[b, :, t]) and this forward's k_new, v_new
    [B, N, KVH, D] (new key i where mask[b, :, s0 + i], s0 = clip(length[b], 0, M - N)) -> [B, N, H, D].

    mask [B, N, M] is laid out over the written cache: M = T for a slot-addressed cache (the new keys' columns
    are the slots they are written to), M = T + N for a ring (`cache.RingKVEntry`), whose new keys never share
    a column with a committed slot. The new keys sit beside the cache instead of being written first: the
    caller writes them after this read, so XLA updates the buffer in place (attention.attend_and_write). Each
    KV head's query group is one [G * N, D] matrix, so both products are plain batched matmuls over (row, KV
    head)."""
    B, N, H, D = q.shape
    KVH, T = k_old.shape[1], k_old.shape[2]
    M = mask.shape[-1]
    G = H // KVH
    qg = q.reshape(B, N, KVH, G, D).transpose(0, 2, 3, 1, 4).reshape(B, KVH, G * N, D)
    kn, vn = k_new.transpose(0, 2, 1, 3).astype(k_old.dtype), v_new.transpose(0, 2, 1, 3).astype(v_old.dtype)
    s = jnp.concatenate([jnp.einsum("bkqd,bktd->bkqt", qg, k_old, preferred_element_type=jnp.float32),
                         jnp.einsum("bkqd,bktd->bkqt", qg, kn, preferred_element_type=jnp.float32)], -1) * scale
    s = s.reshape(B, KVH, G, N, T + N)
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    length = jnp.broadcast_to(jnp.asarray(length, jnp.int32), (B,))
    old = mask[..., :T] & (jnp.arange(T)[None, :] < length[:, None])[:, None, :]
    s0 = jnp.clip(length, 0, M - N)
    new = jnp.take_along_axis(mask, jnp.broadcast_to((s0[:, None] + jnp.arange(N))[:, None, :], (B, N, N)), axis=2)
    s = jnp.where(jnp.concatenate([old, new], -1)[:, None, None], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1).astype(v_old.dtype).reshape(B, KVH, G * N, T + N)
    o = (jnp.einsum("bkqt,bktd->bkqd", p[..., :T], v_old, preferred_element_type=jnp.float32)
         + jnp.einsum("bkqt,bktd->bkqd", p[..., T:], vn, preferred_element_type=jnp.float32))
    return o.reshape(B, KVH, G, N, D).transpose(0, 3, 1, 2, 4).reshape(B, N, H, D).astype(q.dtype)


def unpack_nibbles(packed):
    """uint8 [..., in / 2] (numpy or jax) -> the 4-bit codes [..., in] as uint8 in [0, 15] (GGUF's block order:
    in each block of 32 inputs byte j holds input j in its low nibble and input j + 16 in its high one)."""
    xp = np if isinstance(packed, np.ndarray) else jnp
    b = packed.reshape(*packed.shape[:-1], -1, 16)
    return xp.concatenate([b & 15, b >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def dequantize(codes, scale, offset=None, dtype=None) -> jax.Array:
    """codes, scale/offset [..., out, in / g] -> float weight [..., out, in] in the scale's dtype (the packed
    layout is described in jaxspec/models/quant.py)."""
    dtype = dtype or scale.dtype
    if codes.dtype == jnp.uint8:  # 4-bit: unpack; symmetric codes are stored + 8
        codes = unpack_nibbles(codes).astype(jnp.int8) - jnp.int8(0 if offset is not None else 8)
    *lead, out, cols = codes.shape
    ng = scale.shape[-1]
    w = codes.reshape(*lead, out, ng, cols // ng).astype(dtype) * scale[..., None].astype(dtype)
    if offset is not None:
        w = w + offset[..., None].astype(dtype)
    return w.reshape(codes.shape)


def packed_matmul(x, codes, scale, offset=None):
    """x [..., in] @ W.T -> [..., out] for a packed W [out, in], written as a matmul with an explicit transpose
    of the dequantised expression: for a single row XLA:CPU folds that transpose into one loop fusion over the
    codes (`copy_dot_fusion`). The same product as an einsum contracting `in` directly materialises the float
    weight; tests/test_quant.py checks the compiled HLO."""
    if codes.dtype == jnp.int8 and scale.shape[-1] == 1 and offset is None:  # per-channel int8
        return _matmul_limbs(x, codes, scale)
    # Inside a decode loop the weights are loop-invariant, and XLA's while-loop invariant code motion hoists
    # their int8 -> float conversion out of the loop: every float weight materialised (the memory packing
    # saves) and a slower transposed loop left inside. Clamping the codes to a bound XLA cannot see is
    # constant (127 = max(127, any int8)) keeps the conversion in the loop.
    top = jnp.iinfo(codes.dtype).max
    cap = jnp.maximum(codes.dtype.type(top), jax.lax.convert_element_type(jnp.sum(x[..., :1]), codes.dtype))
    return x @ dequantize(jnp.minimum(codes, cap), scale, offset, dtype=x.dtype).T


def _matmul_limbs(x, codes, scale, n: int = 3):
    """Per-channel int8: x is split into n int8 limbs (x ~ s (a0 + a1/256 + a2/256^2), s = max|x| / 127 per
    row, error ~ 2^-24 max|x| like float32 rounding) so the product is ONE int8 x int8 -> int32 dot over the
    codes, which XLA:CPU hands to its int8 GEMM, reading each code once."""
    s = jnp.max(jnp.abs(x), -1, keepdims=True).astype(jnp.float32) / 127.0  # [..., 1]
    r = x.astype(jnp.float32) / jnp.where(s > 0, s, 1.0)
    limbs = []
    for _ in range(n):
        a = jnp.round(r)
        limbs.append(a)
        r = (r - a) * 256.0
    a = jnp.stack(limbs, 0).astype(jnp.int8)  # [n, ..., K]
    y = jax.lax.dot_general(a, codes, (((a.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    y = y.astype(jnp.float32)  # [n, ..., N]
    y = sum(y[i] * (256.0 ** -i) for i in range(n))
    return (y * s * scale[:, 0]).astype(x.dtype)
