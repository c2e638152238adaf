"""KV commit (accepted-path compaction): XLA reference vs a numpy loop, Pallas kernel vs reference.

Every jitted function takes start/n as traced scalars, so one compile per shape serves all random cases.
"""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kv_commit import (
    GPU_INTERPRET,
    effective_impl,
    gpu_fits,
    kv_commit,
    kv_commit_mosaic_gpu,
    kv_commit_pallas,
    kv_commit_reference,
    latent_commit,
)


def random_case(rng, shape, P, dtype):
    """A random cache (T on axis -2), accepted path [P] (strictly increasing from 0, garbage past n), start, n.

    The path points into N = 2P tree slots: in a wide tree an accepted node's index exceeds the depth.
    """
    T, N = shape[-2], 2 * P
    n = int(rng.integers(1, P + 1))
    path = rng.integers(0, N, size=P)  # padding past n may hold anything in [0, N)
    path[:n] = [0, *sorted(rng.choice(np.arange(1, N), size=n - 1, replace=False))]
    start = int(rng.integers(0, T - N + 1))
    cache = jnp.asarray(rng.standard_normal(shape), dtype)
    return cache, jnp.asarray(path, jnp.int32), jnp.int32(start), jnp.int32(n)


def numpy_commit(cache, path, start, n):
    out = np.array(cache.astype(jnp.float32))  # exact for bf16
    for i in range(int(n)):
        out[..., start + i, :] = out[..., start + path[i], :]
    return out


def as_f32(x):
    return np.asarray(x.astype(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("B", [1, 2])
def test_reference_matches_numpy_loop(B, dtype):
    rng = np.random.default_rng(B)
    ref = jax.jit(kv_commit_reference)
    for _ in range(6):
        cache, path, start, n = random_case(rng, (B, 3, 24, 4), 6, dtype)
        out = ref(cache, path, start, n)
        want = numpy_commit(cache, np.asarray(path), int(start), int(n))
        k = int(start + n)  # rows past start+n are scratch
        np.testing.assert_array_equal(as_f32(out)[..., :k, :], want[..., :k, :])
        assert out.dtype == dtype


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_interpret_matches_reference(dtype):
    rng = np.random.default_rng(7)
    pallas = jax.jit(lambda c, p, s, n: kv_commit_pallas(c, p, s, n, interpret=True))
    for _ in range(6):
        cache, path, start, n = random_case(rng, (2, 2, 40, 8), 9, dtype)
        k = int(start + n)
        out, want = pallas(cache, path, start, n), kv_commit_reference(cache, path, start, n)
        np.testing.assert_array_equal(as_f32(out)[..., :k, :], as_f32(want)[..., :k, :])


def test_pallas_tpu_simulator_matches_reference():
    """The TPU simulator poisons uninitialised memory, so this also checks the aliased output starts as the cache."""
    cache = jnp.asarray(np.random.default_rng(3).standard_normal((1, 2, 32, 8)), jnp.float32)
    path, start, n = jnp.array([0, 2, 3, 4, 1], jnp.int32), jnp.int32(9), jnp.int32(4)  # one padding entry
    out = kv_commit_pallas(cache, path, start, n, interpret=pltpu.InterpretParams())
    want = kv_commit_reference(cache, path, start, n)
    k = int(start + n)
    np.testing.assert_array_equal(np.asarray(out)[..., :k, :], np.asarray(want)[..., :k, :])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_latent_commit(impl):
    rng = np.random.default_rng(11)
    commit = jax.jit(lambda c, p, s, n: latent_commit(c, p, s, n, impl=impl))
    for _ in range(3):
        cache, path, start, n = random_case(rng, (2, 20, 16), 6, jnp.bfloat16)  # [B, T, C]
        out = commit(cache, path, start, n)
        assert out.shape == cache.shape
        want = numpy_commit(cache, np.asarray(path), int(start), int(n))
        k = int(start + n)
        np.testing.assert_array_equal(as_f32(out)[:, :k], want[:, :k])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_donated_commit_in_place_leaves_prefix(impl):
    """Under jit with a donated cache the output reuses the cache's buffer; slots < start are intact."""
    cache = jnp.asarray(np.random.default_rng(5).standard_normal((2, 2, 32, 8)), jnp.float32)
    path, start, n = jnp.array([0, 1, 3, 4, 6, 2, 0], jnp.int32), jnp.int32(10), jnp.int32(5)
    before = np.array(cache)  # a copy: a live numpy view of the cache would block the donation
    want = numpy_commit(cache, np.asarray(path), 10, 5)
    commit = jax.jit(lambda c, p, s, n: kv_commit(c, p, s, n, impl=impl), donate_argnums=0)
    ptr = cache.unsafe_buffer_pointer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable" would fail here
        out = commit(cache, path, start, n)
    assert cache.is_deleted() and out.unsafe_buffer_pointer() == ptr
    out = np.asarray(out)
    np.testing.assert_array_equal(out[..., :10, :], before[..., :10, :])
    np.testing.assert_array_equal(out[..., :15, :], want[..., :15, :])


def test_unknown_impl_raises():
    with pytest.raises(ValueError):
        kv_commit(jnp.zeros((1, 1, 8, 2)), jnp.zeros((2,), jnp.int32), 0, 1, impl="cuda")


@pytest.mark.parametrize("shape,dtype", [((1, 8, 64, 128), jnp.bfloat16),  # KV: 8 heads of 128
                                         ((2, 1, 48, 576), jnp.bfloat16),  # MLA latent [c_kv | k_pe] of DeepSeek-V3
                                         ((1, 2, 32, 64), jnp.float32)])
def test_mosaic_gpu_kernel_lowers_in_place(shape, dtype):
    """On this CPU-only machine the GPU kernel is checked by lowering for CUDA: one Mosaic GPU custom call whose
    output aliases the cache operand (in place), and no Triton call."""
    cache = jax.ShapeDtypeStruct(shape, dtype)
    args = (cache, jax.ShapeDtypeStruct((16,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.int32))
    exported = jax.export.export(jax.jit(kv_commit_mosaic_gpu, donate_argnums=0), platforms=("cuda",))(*args)
    text = exported.mlir_module()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and "@mosaic_gpu" in calls[0] and "triton" not in text
    assert "output_operand_aliases" in calls[0]


@pytest.mark.skipif(GPU_INTERPRET is None, reason="this JAX has no Mosaic GPU interpreter")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mosaic_gpu_interpret_matches_reference(dtype):
    """The GPU kernel itself (TMA copies, SMEM stage, barrier) under JAX's Mosaic GPU interpreter; latent-shaped
    rows ([B, 1, T, C]) and KV-shaped ones, paths into wide trees (path[i] up to 2P)."""
    rng = np.random.default_rng(13)
    commit = jax.jit(lambda c, p, s, n: kv_commit_mosaic_gpu(c, p, s, n, interpret=GPU_INTERPRET))
    for shape in ((2, 1, 40, 192), (1, 2, 40, 64)):
        for _ in range(2):
            cache, path, start, n = random_case(rng, shape, 6, dtype)
            k = int(start + n)
            out, want = commit(cache, path, start, n), kv_commit_reference(cache, path, start, n)
            np.testing.assert_array_equal(as_f32(out)[..., :k, :], as_f32(want)[..., :k, :])


def test_mosaic_gpu_kernel_refuses_rows_it_cannot_copy():
    with pytest.raises(ValueError, match="multiple of 128 bytes"):
        jax.eval_shape(kv_commit_mosaic_gpu, jnp.zeros((1, 1, 8, 24)), jnp.zeros((4,), jnp.int32), 0, 1)


def test_effective_impl_reports_the_gpu_kernel(monkeypatch):
    """On a Hopper GPU the kernel runs where it copies the rows; on any other GPU the commit is XLA's, and says
    so (an A100 or a B200 would otherwise fail to compile the kernel)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for capability, want in (("9.0", "pallas (Mosaic GPU"), ("8.0", "xla (the Mosaic GPU commit needs a Hopper"),
                             ("10.0", "xla (the Mosaic GPU commit needs a Hopper")):
        monkeypatch.setattr(jax, "devices", lambda c=capability: [SimpleNamespace(compute_capability=c)])
        assert effective_impl("pallas").startswith(want) and effective_impl("xla") == "xla", capability
    assert gpu_fits(jnp.zeros((1, 1, 8, 64), jnp.bfloat16)) and not gpu_fits(jnp.zeros((1, 1, 8, 32), jnp.bfloat16))


def per_row_case(rng, B, shape, P, dtype):
    """B rows, each with its own random path, start and n (random_case's row by row)."""
    rows = [random_case(rng, (1, *shape), P, dtype) for _ in range(B)]
    cache = jnp.concatenate([r[0] for r in rows])
    return cache, *(jnp.stack([r[i] for r in rows]) for i in (1, 2, 3))


def per_row_numpy(cache, path, start, n):
    return np.concatenate([numpy_commit(cache[b: b + 1], np.asarray(path[b]), int(start[b]), int(n[b]))
                           for b in range(cache.shape[0])])


KERNELS = {"reference": kv_commit_reference,
           "pallas": lambda c, p, s, n: kv_commit_pallas(c, p, s, n, interpret=True),
           "pallas_tpu_sim": lambda c, p, s, n: kv_commit_pallas(c, p, s, n, interpret=pltpu.InterpretParams()),
           "mosaic_gpu": lambda c, p, s, n: kv_commit_mosaic_gpu(c, p, s, n, interpret=GPU_INTERPRET)}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_rows_commit_their_own_paths(kernel):
    """A batch whose rows accepted different paths at different lengths: every row as the numpy loop alone."""
    if kernel == "mosaic_gpu" and GPU_INTERPRET is None:
        pytest.skip("this JAX has no Mosaic GPU interpreter")
    rng = np.random.default_rng(11)
    commit = jax.jit(KERNELS[kernel])
    for _ in range(3):
        cache, path, start, n = per_row_case(rng, 3, (2, 40, 32), 6, jnp.float32)
        out, want = as_f32(commit(cache, path, start, n)), per_row_numpy(cache, path, start, n)
        for b in range(3):
            k = int(start[b] + n[b])
            np.testing.assert_array_equal(out[b, :, :k], want[b, :, :k])
