"""The float32 CPU matmul kernel (`cpu_kernel.dense`, `cpu_matmul.cc`): every tile shape and tail against a
float64 product, where it is used and where it must not be (a mesh, a GPU lowering, too many rows), and its
gradient. The packed-weight kernel is tested in test_quant.py."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.kernels import cpu as cpu_kernel
from jaxspec.models import quant
from jaxspec.models.layers import Linear, lm_logits, project
from jaxspec.sharding import make_mesh

needs_kernel = pytest.mark.skipif(cpu_kernel.level() < 2, reason="no C++ compiler or no AVX-512")


def tile_linears(module, compact=True):
    """The CPU backend's layout for a module's Linear kernels, in place (as jaxspec.load keeps them)."""
    nnx.update(module, cpu_kernel.to_layout(nnx.state(module), compact))
    return module


def untile_linears(module):
    nnx.update(module, cpu_kernel.from_layout(nnx.state(module)))
    return module


def assert_product(got, x, w):
    """got equals x @ w up to float32 summation error: within 1e-5 of sum |x| |w| (float64 reference)."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    err = np.abs(np.asarray(got, np.float64) - x @ w)
    assert got.shape == err.shape and (err <= 1e-5 * (np.abs(x) @ np.abs(w)) + 1e-30).all(), err.max()


@needs_kernel
@pytest.mark.parametrize("layout", ["kn", "nk", "nk_rows"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 11, 13, 17])
def test_dense_kernel_tiles_tails_and_threads(layout, rows):
    """Groups of 1-6 input rows (W [K, N] and W [V, K]), several groups split evenly, 70 inputs (a partial
    32-input block and a partial 16-lane vector), 1500 outputs (partial 64-column tiles, a 4-row tail) split
    over XLA's threads, and a gathered row subset with a repeated index."""
    rng = np.random.default_rng(rows)
    K, N = 70, 1500
    x = rng.normal(size=(rows, K)).astype(np.float32)
    w = rng.normal(size=(K, N)).astype(np.float32)  # the product's [K, N]
    if layout == "kn":
        got = jax.jit(cpu_kernel.dense_kernel)(x, w)
    elif layout == "nk":
        got = jax.jit(lambda x, wt: cpu_kernel.dense_kernel(x, wt, nk=True))(x, w.T.copy())
    else:
        idx = rng.integers(0, N, 611).astype(np.int32)
        idx[7] = idx[3]
        got = jax.jit(lambda x, wt, i: cpu_kernel.dense_kernel(x, wt, nk=True, rows=i))(x, w.T.copy(), idx)
        w = w[:, idx]
    assert_product(got, x, w)


def hlo(f, *args) -> str:
    return jax.jit(f).lower(*args).as_text()


@needs_kernel
@pytest.mark.parametrize("march,level", [("haswell", 1), ("x86-64", 0)])
def test_builds_without_avx512(tmp_path, march, level):
    """Built for a CPU without AVX-512, in a fresh process and cache directory: with AVX2 and FMA (haswell) only
    the products of column-tiled weights run the kernel, float32 and bfloat16 tiles, 1 to 13 rows, equal to a
    float64 product; everything else lowers to XLA's forms. With neither (baseline x86-64) nothing runs it and
    Linear kernels stay untiled. One notice each."""
    code = f"""
from jaxspec.kernels import cpu as cpu_kernel
cpu_kernel.FLAGS = tuple("-march={march}" if f == "-march=native" else f for f in cpu_kernel.FLAGS)
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jaxspec.models.layers import Linear
lin = Linear(64, 96, ("embed", "ffn"), rngs=nnx.Rngs(0))
nnx.update(lin, cpu_kernel.to_layout(nnx.state(lin)))
plain = jax.jit(lambda x: cpu_kernel.dense(x, jnp.ones((64, 96)))).lower(jnp.ones((3, 64))).as_text()
worst, rng = 0.0, np.random.default_rng(0)
for rows in (1, 2, 3, 9, 13):
    x = rng.normal(size=(rows, 70)).astype(np.float32)
    w = jnp.asarray(rng.normal(size=(70, 130)), jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
    ref = x.astype(np.float64) @ np.asarray(w, np.float64)
    for dt in (None, jnp.bfloat16):
        y = jax.jit(lambda x, t: cpu_kernel.dense_tiled(x, t, 130))(x, cpu_kernel.tile(w, dt))
        worst = max(worst, float(np.max(np.abs(np.asarray(y) - ref) / (np.abs(x) @ np.abs(np.asarray(w)) + 1e-30))))
tiled = jax.jit(lambda x: cpu_kernel.dense_tiled(x, cpu_kernel.tile(jnp.ones((64, 96))), 96)).lower(jnp.ones((3, 64)))
print(cpu_kernel.level(), cpu_kernel.DENSE in plain, cpu_kernel.DENSE in tiled.as_text(),
      type(lin.kernel[...]).__name__, worst < 1e-5)
"""
    env = {**os.environ, "JAXSPEC_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(level), "False", str(level == 1), "Tiles" if level else "ArrayImpl", "True"]
    notices = [ln for ln in run.stderr.splitlines() if ln.startswith("jaxspec:")]
    assert len(notices) == 1 and "AVX-512" in notices[0], run.stderr


@needs_kernel
def test_dense_runs_the_kernel_only_where_it_pays():
    """ROWS rows on one CPU device: the kernel; other rows, a weight split over a mesh, or a program lowered
    for a GPU (exported from this machine): XLA's dot, and no CPU custom call in it."""
    K, N = 64, 96
    w, wt, idx = jnp.ones((K, N)), jnp.ones((N, K)), jnp.arange(8, dtype=jnp.int32)
    x = lambda m: jnp.ones((1, m, K))  # noqa: E731
    assert cpu_kernel.DENSE in hlo(cpu_kernel.dense, x(5), w)
    assert cpu_kernel.DENSE in hlo(lambda x, w: cpu_kernel.dense(x, w, nk=True), x(1), wt)
    assert cpu_kernel.DENSE in hlo(lambda x, w: cpu_kernel.dense(x, w, nk=True, rows=idx), x(16), wt)
    assert cpu_kernel.DENSE not in hlo(cpu_kernel.dense, x(cpu_kernel.ROWS["kn"][1] + 1), w)
    assert cpu_kernel.DENSE in hlo(cpu_kernel.dense, x(1), w)  # a decode step's projections
    too_many = x(cpu_kernel.ROWS["nk"][1] + 1)
    assert cpu_kernel.DENSE not in hlo(lambda x, w: cpu_kernel.dense(x, w, nk=True), too_many, wt)
    assert cpu_kernel.DENSE not in hlo(cpu_kernel.dense, x(5).astype(jnp.bfloat16), w.astype(jnp.bfloat16))

    mesh = make_mesh(tp=8)
    sharded = jax.device_put(w, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tp")))
    assert cpu_kernel.DENSE not in hlo(cpu_kernel.dense, x(5), sharded)

    gpu = jax.export.export(jax.jit(cpu_kernel.dense), platforms=("cuda",))(x(5), w)
    assert cpu_kernel.DENSE not in gpu.mlir_module()

    lin = Linear(K, N, ("embed", "ffn"), rngs=nnx.Rngs(0))
    assert cpu_kernel.DENSE in hlo(lambda x: lin(x), x(3))


@needs_kernel
@pytest.mark.parametrize("nk", [False, True])
def test_dense_gradient_equals_xlas(nk):
    """Training through a few-row product (a drafter's block) differentiates like XLA's dot."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 3, 40)).astype(np.float32))
    w = jnp.asarray(rng.normal(size=(50, 40) if nk else (40, 50)).astype(np.float32))
    rows = jnp.asarray([4, 1, 1, 30], jnp.int32) if nk else None

    def loss(f):
        return lambda x, w: jnp.sum(jnp.sin(f(x, w)))

    ours = jax.jit(jax.grad(loss(lambda x, w: cpu_kernel.dense(x, w, nk=nk, rows=rows)), argnums=(0, 1)))(x, w)
    ref_w = (lambda w: jnp.take(w, rows, axis=0).T) if nk else (lambda w: w)
    ref = jax.grad(loss(lambda x, w: x @ ref_w(w)), argnums=(0, 1))(x, w)
    assert cpu_kernel.DENSE in hlo(jax.grad(loss(lambda x, w: cpu_kernel.dense(x, w, nk=nk, rows=rows))), x, w)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_dense_many_equals_float64(rows):
    """Several weights over one x in one call (q, k, v; gate and up): widths that are not whole 64-column
    tiles (each weight padded to its own tiles), enough work to be split over XLA's threads, and the gradient
    of a loss through all outputs against XLA's."""
    rng = np.random.default_rng(rows)
    K = 70
    x = jnp.asarray(rng.normal(size=(1, rows, K)).astype(np.float32))
    ws = [jnp.asarray(rng.normal(size=(K, n)).astype(np.float32)) for n in (1000, 70, 130, 64)]
    got = jax.jit(cpu_kernel.dense_many)(x, ws)
    assert cpu_kernel.DENSE_MANY in hlo(cpu_kernel.dense_many, x, ws)
    for y, w in zip(got, ws):
        assert_product(y[0], x[0], w)

    def loss(f):
        return lambda x, ws: sum(jnp.sum(jnp.sin(y) * (i + 1)) for i, y in enumerate(f(x, ws)))

    ours = jax.jit(jax.grad(loss(cpu_kernel.dense_many), argnums=(0, 1)))(x, ws)
    ref = jax.grad(loss(lambda x, ws: [x @ w for w in ws]), argnums=(0, 1))(x, ws)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@needs_kernel
def test_project_merges_float_linears_only():
    """layers.project: float Linears in one kernel call, biases added after; a packed one runs each alone."""
    rngs = nnx.Rngs(0)
    lins = [Linear(64, n, ("embed", "ffn"), bias=b, rngs=rngs) for n, b in ((96, False), (32, True))]
    lins[1].bias[...] = jnp.arange(32.0)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 2, 64)).astype(np.float32))
    f = lambda x: project(x, *lins)  # noqa: E731
    for y, lin in zip(f(x), lins):
        bias = 0 if lin.bias is None else lin.bias[...]
        np.testing.assert_allclose(np.asarray(y), np.asarray(x @ lin.kernel[...] + bias), rtol=1e-5, atol=1e-5)
    assert cpu_kernel.DENSE_MANY in hlo(f, x)
    quant.pack_module(lins[0], {"kernel": quant.scheme_of("int8")}, fill=True)
    assert cpu_kernel.DENSE_MANY not in hlo(lambda x: project(x, *lins), x)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 10, 13, 17, 19, 100])
def test_tiled_kernel_equals_float64(rows):
    """Weights in column tiles (`cpu_kernel.tile`): groups of 1-9 input rows and several groups split evenly
    (10 = 5 + 5, 19 = 7 + 6 + 6, 100 = 12 groups), 70 inputs, widths that end inside a tile (1000 = 20 tiles +
    40; 70; 130), four weights in one call split over XLA's threads and one alone, all on the kernel; XLA's
    form (another platform's) on the same weights. `untile` gives the weight back exactly, and the gradient is
    XLA's."""
    rng = np.random.default_rng(rows)
    K, ns = 70, [1000, 70, 130, 48]
    x = jnp.asarray(rng.normal(size=(1, rows, K)).astype(np.float32))
    ws = [rng.normal(size=(K, n)).astype(np.float32) for n in ns]
    tiles = [cpu_kernel.tile(jnp.asarray(w)) for w in ws]
    for t, w, n in zip(tiles, ws, ns):
        assert t.shape == (-(-n // cpu_kernel.TILE), K, cpu_kernel.TILE)
        np.testing.assert_array_equal(np.asarray(cpu_kernel.untile(t, n)), w)
    many = lambda x, ts: cpu_kernel.dense_many_tiled(x, ts, ns)  # noqa: E731
    one = lambda x, t: cpu_kernel.dense_tiled(x, t, ns[0])  # noqa: E731
    for y, w in zip(jax.jit(many)(x, tiles), ws):
        assert_product(y[0], x[0], w)
    assert_product(jax.jit(one)(x, tiles[0])[0], x[0], ws[0])
    assert cpu_kernel.DENSE_MANY in hlo(many, x, tiles) and cpu_kernel.DENSE in hlo(one, x, tiles[0])
    for y, w in zip(jax.jit(lambda x, ts: cpu_kernel._tiled_xla(tuple(ns), x, *ts))(x[0], tiles), ws):
        assert_product(y, x[0], w)

    def loss(f):
        return lambda x, ts: sum(jnp.sum(jnp.sin(y) * (i + 1)) for i, y in enumerate(f(x, ts)))

    ours = jax.jit(jax.grad(loss(many), argnums=(0, 1)))(x, tiles)
    ref = jax.grad(loss(lambda x, ts: [x @ cpu_kernel.untile(t, n) for t, n in zip(ts, ns)]), argnums=(0, 1))(x, tiles)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):  # sums of ~1000 terms: error scales with the largest
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 9, 13, 100])
def test_bfloat16_tiles_give_the_float32_tiles_results(rows):
    """Weights whose every value is a bfloat16 (a bfloat16 checkpoint loaded in float32) may be tiled in
    bfloat16: the kernel widens them exactly, so its results equal the float32 tiles' bit for bit, alone and
    mixed with float32 tiles in one call, and XLA's form gives the float32 product; `bf16_exact` tells such
    weights from others, also when the one value that is no bfloat16 lies past the prefix it tries first."""
    rng = np.random.default_rng(rows)
    K, ns = 70, [1000, 130]
    x = jnp.asarray(rng.normal(size=(rows, K)).astype(np.float32))
    ws = [jnp.asarray(rng.normal(size=(K, n)).astype(np.float32)).astype(jnp.bfloat16).astype(jnp.float32) for n in ns]
    assert all(cpu_kernel.bf16_exact(w) for w in ws)
    late = ws[0].at[-1, -1].add(1e-3)
    assert not cpu_kernel.bf16_exact(late) and not cpu_kernel.bf16_exact(ws[0] + 1e-3)
    f32, bf16 = [cpu_kernel.tile(w) for w in ws], [cpu_kernel.tile(w, jnp.bfloat16) for w in ws]
    assert bf16[0].dtype == jnp.bfloat16 and cpu_kernel.untile(bf16[0], ns[0]).dtype == jnp.float32
    many = jax.jit(lambda x, ts: cpu_kernel.dense_many_tiled(x, ts, ns))
    want = many(x, f32)
    one = jax.jit(cpu_kernel.dense_tiled, static_argnums=2)
    for got in (many(x, bf16), many(x, [bf16[0], f32[1]]), [one(x, bf16[0], ns[0])]):
        for g, w in zip(got, want):
            assert g.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    for y, w in zip(cpu_kernel._tiled_xla(tuple(ns), x, *bf16), ws):
        assert y.dtype == jnp.float32
        assert_product(y, x, w)


@needs_kernel
def test_tile_linears_round_trip():
    """tile_linears puts float Linear kernels (not packed ones) in column tiles, in bfloat16 where every value
    is one (the second kernel): the same outputs through `Linear` and `project` (one kernel call for all tiled
    ones), `weight()` the same float32 matrix, and untile_linears gives back the original float32 parameters
    bit for bit with their axes."""
    rngs = nnx.Rngs(0)
    lins = [Linear(64, n, ("embed", "ffn"), bias=b, rngs=rngs) for n, b in ((96, False), (40, True))]
    lins[1].bias[...] = jnp.arange(40.0)
    lins[1].kernel[...] = lins[1].kernel[...].astype(jnp.bfloat16).astype(jnp.float32)
    packed = Linear(64, 32, ("embed", "ffn"), rngs=rngs)
    quant.pack_module(packed, {"kernel": quant.scheme_of("int8")}, fill=True)
    model = nnx.Module()
    model.a, model.b, model.c = *lins, packed
    before = [np.asarray(lin.kernel[...]) for lin in lins]
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 3, 64)).astype(np.float32))
    ref = [lin(x) for lin in lins]
    tile_linears(model)
    assert [type(lin.kernel[...]) for lin in lins] + [type(model.c.kernel)] == [cpu_kernel.Tiles] * 2 + [quant.Packed]
    assert [lin.kernel[...].tiles.dtype for lin in lins] == [jnp.float32, jnp.bfloat16]
    assert all(lin.kernel.dtype == jnp.float32 for lin in lins)
    assert cpu_kernel.DENSE_MANY in hlo(lambda x: project(x, *lins), x)
    for y, lin, r, w in zip(project(x, *lins), lins, ref, before):
        np.testing.assert_allclose(np.asarray(y), np.asarray(r), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(lin(x)), np.asarray(r), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(lin.weight()), w)
    untile_linears(model)
    for lin, w in zip(lins, before):
        assert isinstance(lin.kernel, nnx.Param) and lin.kernel.out_sharding == ("embed", "ffn")
        assert lin.kernel.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(lin.kernel[...]), w)
    tile_linears(model, compact=False)
    assert [lin.kernel[...].tiles.dtype for lin in lins] == [jnp.float32, jnp.float32]


@needs_kernel
def test_tiled_lm_head_over_a_draft_vocabulary():
    """An untied LM head in column tiles (float32 or bfloat16) over a draft vocabulary's columns: their logits,
    on the kernel (the gathered columns are float32 for it whatever the tiles hold)."""
    rng = np.random.default_rng(0)
    head = Linear(64, 300, ("embed", "vocab"), rngs=nnx.Rngs(0))
    head.kernel[...] = jnp.asarray(rng.normal(size=(64, 300)), jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
    w = np.asarray(head.kernel[...])
    vocab = jnp.asarray([299, 0, 47, 48, 150, 7], jnp.int32)
    h = jnp.asarray(rng.normal(size=(3, 64)).astype(np.float32))
    for compact in (False, True):
        module = nnx.Module()
        module.head = Linear(64, 300, ("embed", "vocab"), rngs=nnx.Rngs(0))
        module.head.kernel[...] = head.kernel[...]
        tile_linears(module, compact=compact)
        assert module.head.kernel[...].tiles.dtype == (jnp.bfloat16 if compact else jnp.float32)
        f = lambda h: lm_logits(h, None, module.head, vocab)  # noqa: E731
        assert_product(jax.jit(f)(h), h, w[:, np.asarray(vocab)])
        assert cpu_kernel.DENSE in hlo(f, h)


def attention_f64(q, k_old, v_old, k_new, v_new, length, mask, scale, softcap):
    """Float64 reference of the cache attention: old slot j seen when j < length and mask[j], new key i when
    mask[s0 + i] (s0 = length clamped to M - N for a mask of M columns, as XLA's dynamic slice does); nothing
    seen: the mean of all T + N values (a -1e30 fill's softmax)."""
    q, k_old, v_old, k_new, v_new = (np.asarray(x, np.float64) for x in (q, k_old, v_old, k_new, v_new))
    B, N, H, D = q.shape
    KVH, T = k_old.shape[1], k_old.shape[2]
    s0 = min(max(length, 0), mask.shape[-1] - N)
    out = np.zeros_like(q)
    for b in range(B):
        for n in range(N):
            seen = np.concatenate([mask[b, n, :T] & (np.arange(T) < length), mask[b, n, s0:s0 + N]])
            for h in range(H):
                kvh = h // (H // KVH)
                keys = np.concatenate([k_old[b, kvh], k_new[b, :, kvh]])
                vals = np.concatenate([v_old[b, kvh], v_new[b, :, kvh]])
                if not seen.any():
                    out[b, n, h] = vals.mean(0)
                    continue
                s = keys @ q[b, n, h] * scale
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                p = np.where(seen, np.exp(s - s[seen].max()), 0.0)
                out[b, n, h] = p @ vals / p.sum()
    return out


@needs_kernel
@pytest.mark.parametrize("B,N,H,KVH,T,D,length,softcap,ring", [
    (1, 1, 9, 3, 256, 64, 150, None, False),     # a decode step: dot products as stored
    (1, 9, 9, 3, 256, 64, 150, None, False),     # a 9-node verify: keys transposed, 4-row groups with a tail
    (2, 33, 8, 2, 300, 48, 250, 5.0, False),     # batch rows over threads, softcap, keys past a 16-lane vector
    (1, 5, 4, 4, 64, 128, 62, None, False),      # length + N > T: the new keys' mask columns clamp
    (3, 4, 6, 2, 32, 16, 0, None, False),        # an empty cache
    (2, 9, 4, 2, 16, 32, 16, None, True),        # a ring: mask [B, N, T + N], new keys past every slot
    (1, 40, 4, 2, 16, 32, 16, None, True),       # a ring shorter than the forward (a long prefill)
])
def test_cache_attention_equals_float64(B, N, H, KVH, T, D, length, softcap, ring):
    """The kernel against a float64 softmax attention, with a random visibility mask that hides some rows
    entirely (padding rows: the mean of every value) and shows the others a random subset."""
    rng = np.random.default_rng(N * 100 + T)
    q = rng.normal(size=(B, N, H, D)).astype(np.float32)
    k_old, v_old = (rng.normal(size=(B, KVH, T, D)).astype(np.float32) for _ in range(2))
    k_new, v_new = (rng.normal(size=(B, N, KVH, D)).astype(np.float32) for _ in range(2))
    mask = rng.random((B, N, T + N if ring else T)) < 0.7
    if B * N > 1:  # a decode step's only row keeps its scores tested
        mask[0, 0] = False
    unused = lambda *a: jnp.full(a[0].shape, jnp.nan)  # noqa: E731  (the XLA branch, not taken on a CPU)
    got = jax.jit(lambda *a: cpu_kernel.cache_attention(*a, 0.3, softcap, unused))(
        q, k_old, v_old, k_new, v_new, jnp.int32(length), mask)
    want = attention_f64(q, k_old, v_old, k_new, v_new, length, mask, 0.3, softcap)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_attention_runs_the_kernel_only_where_it_pays():
    """attend_and_write on a CPU: the kernel for a decode or verify forward, XLA's products for a long prefill
    block, and none in a program lowered for a GPU."""
    from jaxspec.cache import KVEntry
    from jaxspec.models.attention import attend_and_write

    def f(n):
        entry = KVEntry.init(1, 128, 2, 16, jnp.float32)
        q, kv = jnp.ones((1, n, 4, 16)), jnp.ones((1, n, 2, 16))
        return lambda: attend_and_write(q, entry, kv, kv, jnp.int32(3), jnp.ones((1, n, 128), bool), 0.25)[0]

    assert cpu_kernel.ATTENTION in hlo(f(9))
    assert cpu_kernel.ATTENTION not in hlo(f(cpu_kernel.ATTENTION_ROWS + 1))
    assert cpu_kernel.ATTENTION not in jax.jit(f(9)).trace().lower(lowering_platforms=("cuda",)).as_text()
