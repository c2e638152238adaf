"""The float32 CPU matmul kernel (`cpu_kernel.dense`, `cpu_matmul.cc`): every tile shape and tail against a
float64 product, where it is used and where it must not be (a mesh, a GPU lowering, too many rows), and its
gradient. The packed-weight kernel is tested in test_quant.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.models import cpu_kernel
from jaxspec.models.layers import Linear
from jaxspec.sharding import make_mesh

needs_kernel = pytest.mark.skipif(not cpu_kernel.available(), reason="no C++ compiler")


def assert_product(got, x, w):
    """got equals x @ w up to float32 summation error: within 1e-5 of sum |x| |w| (float64 reference)."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    err = np.abs(np.asarray(got, np.float64) - x @ w)
    assert got.shape == err.shape and (err <= 1e-5 * (np.abs(x) @ np.abs(w)) + 1e-30).all(), err.max()


@needs_kernel
@pytest.mark.parametrize("layout", ["kn", "nk", "nk_rows"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 11, 13, 17])
def test_dense_kernel_tiles_tails_and_threads(layout, rows):
    """Groups of 1-5 (W [K, N]) or 1-6 (W [V, K]) input rows, several groups split evenly, 70 inputs (a partial
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
    assert cpu_kernel.DENSE not in hlo(cpu_kernel.dense, x(1), w)
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
