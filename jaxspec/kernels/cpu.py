"""The CPU backend of the kernel seam: native kernels for XLA:CPU (`cpu_matmul.cc`, called through the XLA
FFI): products of few rows over float32 weights, over weights in this backend's column tiles (`Tiles`) and over
packed weights, a row-wise argmax, and the attention of few new tokens over a KV cache. Built with the system
C++ compiler on first use, cached, registered with JAX. Model code never calls this module: `jaxspec.kernels`
does, when a handle runs on the CPU backend.

Why native kernels: a decode step or a small tree verify is bound by the weight bytes it reads, and XLA:CPU
reads them at memory speed only for one row of float weights. For packed weights it has no fused form that
does; for float32 weights and 2 to a few dozen rows it repacks the weight for its GEMM on every call, so a
small tree verify costs about what as many decode steps' products do. The kernels read each weight once per
call. A Linear's [K, N] kernel is read fastest in column tiles (`tile`, `Tiles`): one contiguous stream per
tile instead of K short pieces, so a product of up to 9 rows (a budget-8 verify) costs what one row does
(bench/cpu/tiles.py); `to_layout` puts a parameter state's float kernels that way, in bfloat16 where every
value is one (a bfloat16 checkpoint: half the bytes, the same results).

The kernels are AVX-512 code; with AVX2 and FMA only (most desktop CPUs) just the column tiles' products run
(`level`), and on other CPUs (ARM) none, since plain loops in their place ran slower than XLA's forms.
Compiled for the host (`-march=native`) into jaxspec's cache directory (`~/.cache/jaxspec`;
`$JAXSPEC_CACHE_DIR` moves it), keyed by the source, the compiler flags, the jax version and the CPU, so an
upgrade or another machine rebuilds it. Without a compiler (or with JAXSPEC_CPU_KERNEL=0) products run XLA's
forms (`jaxspec.kernels.xla`): same results up to float32 summation order, slower; the reason is printed once.
Under a multi-device mesh or when lowering for another platform they run XLA's forms too (`usable`, `on_cpu`).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.kernels import xla as xla_forms
from jaxspec.sharding import on_one_device
from jaxspec.usercache import cache_dir

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
TARGET = "jaxspec_packed_matmul"
DENSE = "jaxspec_dense_matmul"
DENSE_MANY = "jaxspec_dense_many"
ARGMAX = "jaxspec_argmax"
ATTENTION = "jaxspec_cache_attention"


def _host() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in info if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp-simd", "-shared", "-fPIC")


def build_key() -> str:
    """What a build depends on: the source, the compiler and flags, the jax version and the CPU."""
    parts = (SOURCE.read_text(), os.environ.get("CXX", "c++"), *FLAGS, jax.__version__, _host())
    return hashlib.sha256(b"\0".join(s.encode() for s in parts)).hexdigest()[:16]


def _build() -> Path:
    cxx = os.environ.get("CXX", "c++")
    lib = cache_dir() / f"cpu_matmul-{build_key()}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:  # build aside, then rename: never a half-written .so
            out = Path(tmp) / lib.name
            subprocess.run([cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(out)], check=True,
                           capture_output=True, text=True)
            os.replace(out, lib)
    return lib


def available() -> bool:
    """Whether any kernel runs here (built and registered once per process): False if that is impossible or
    disabled."""
    return level() > 0


@functools.cache
def level() -> int:
    """Build (or find) the library and register its kernels once per process -> 2: all of them (AVX-512); 1: the
    products of weights in column tiles only (AVX2 and FMA: `dense_many_tiled`); 0: none."""
    if os.environ.get("JAXSPEC_CPU_KERNEL", "1") == "0":
        return 0
    try:
        lib = ctypes.CDLL(str(_build()))
    except subprocess.CalledProcessError as e:
        lines = (e.stderr or "").strip().splitlines() or [f"exit code {e.returncode}"]
        why = next((ln for ln in lines if "error" in ln), lines[-1])  # the first error, not a caret line
        return _unavailable(f"compiling {SOURCE.name} failed: {why.strip()}", "Install a working C++ compiler (g++)")
    except OSError as e:  # no compiler, or a cache directory that cannot be written
        no_cxx = e.filename == os.environ.get("CXX", "c++")
        return _unavailable(str(e), "Install a C++ compiler (g++)" if no_cxx else
                            "Point JAXSPEC_CACHE_DIR at a writable directory")
    vectorised = lib.jaxspec_vectorised()  # what the compiler could build for this CPU (cpu_matmul.cc)
    # plain loops in the kernels' place ran slower than XLA's forms (docs/benchmarks/cpu.md, "Which CPUs run
    # jaxspec's kernels")
    if not vectorised:
        return _unavailable("this CPU has neither AVX-512 nor AVX2, which they are written for", None)
    jax.ffi.register_ffi_target(DENSE, jax.ffi.pycapsule(lib.jaxspec_dense_matmul), platform="cpu")
    jax.ffi.register_ffi_target(DENSE_MANY, jax.ffi.pycapsule(lib.jaxspec_dense_many), platform="cpu")
    if vectorised == 1:
        print("jaxspec: this CPU has no AVX-512: of the CPU kernels only the products of column-tiled weights run "
              "(AVX2); the LM head, attention and packed weights run XLA's forms (same results, slower).",
              file=sys.stderr)
        return 1
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.jaxspec_packed_matmul), platform="cpu")
    jax.ffi.register_ffi_target(ARGMAX, jax.ffi.pycapsule(lib.jaxspec_argmax), platform="cpu")
    jax.ffi.register_ffi_target(ATTENTION, jax.ffi.pycapsule(lib.jaxspec_cache_attention), platform="cpu")
    return 2


def _unavailable(why: str, fix: str | None) -> int:
    """One notice (with the fix where the user has one) -> level 0."""
    tail = f"(same results, slower). {fix} to enable them." if fix else "(same results)."
    print(f"jaxspec: the CPU matmul kernels are unavailable ({why}); matmuls run XLA's forms {tail}", file=sys.stderr)
    return 0


def packed_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array, offset: jax.Array | None) -> jax.Array:
    """x float32 [M, K] @ W.T -> [M, N] on the CPU kernel, W packed as in quant.py: codes int8 [N, K] or
    uint8 [N, K / 2] (4-bit, GGUF block order), scale / offset float32 [N, G], K / G a multiple of 32.
    The kernel reads each packed byte once per call and, with AVX-512 VNNI, multiplies in integers (the
    activations split into int8 limbs, float32-exact)."""
    if level() < 2:
        raise RuntimeError("the packed-weight CPU kernel is unavailable (see the notice above); use quant.matmul")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], codes.shape[0]), jnp.float32),
                            vmap_method="sequential")
    bits = 4 if codes.dtype == jnp.uint8 else 8
    return call(x, codes, scale, scale if offset is None else offset, bits=np.int64(bits),
                with_offset=offset is not None)


# Rows up to which the kernel beats XLA's product, per weight layout: W [K, N], W [V, K] (a tied LM head) and W's
# rows gathered (a draft vocabulary); measured by bench/cpu/cpu_matmul.py. At one row the two are level alone,
# but inside a decode step XLA's matrix-vector products run slower than alone and the kernel wins.
ROWS = {"kn": (1, 48), "nk": (1, 24), "nk_rows": (1, 48)}

# Rows up to which the packed kernel beats dequantise-then-dot (a budget-64 verify fits; bench/quant.py).
PACKED_MAX_ROWS = 80

# Columns per tile of a weight kept in column tiles (`tile`; cpu_matmul.cc's kTile).
TILE = 48


def usable(*weights, tiles: bool = False) -> bool:
    """Whether a product with these weights may run a kernel here: a CPU backend, the kernel built (for weights
    in column tiles, `tiles`: also without AVX-512), and no weight split over a mesh of several devices (the
    partitioner cannot split a custom call: it would gather the whole weight onto every device)."""
    return jax.default_backend() == "cpu" and on_one_device(*weights) and level() >= (1 if tiles else 2)


def on_cpu(kernel, xla, *args):
    """kernel(*args) when lowered for a CPU, xla(*args) for any other platform (e.g. a GPU export traced on
    this machine), so a CPU custom call never reaches another backend's program."""
    return jax.lax.platform_dependent(*args, cpu=kernel, default=xla)


def packed_fits(x, codes, scale, offset) -> bool:
    """The packed kernel's cases: one [out, in] weight, at most PACKED_MAX_ROWS rows, float32 throughout,
    groups of a multiple of 32 inputs, where it may run here."""
    f32 = all(a.dtype == jnp.float32 for a in (x, scale) + (() if offset is None else (offset,)))
    cols = codes.shape[-1] * (2 if codes.dtype == jnp.uint8 else 1)
    rows = int(np.prod(x.shape[:-1]))
    return (codes.ndim == 2 and f32 and rows <= PACKED_MAX_ROWS and (cols // scale.shape[-1]) % 32 == 0
            and usable(codes))


def dense(x: jax.Array, w: jax.Array, *, nk: bool = False, rows: jax.Array | None = None,
          preferred_element_type=None) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N]; with nk, w [V, K] is used transposed (a tied embedding as the LM
    head), and only its rows `rows` [N] when given (a draft vocabulary: no gathered copy of the rows).

    Float32 products of ROWS rows (a decode step, a tree verify, a draft block) run the kernel, which reads w
    once at close to memory speed; XLA:CPU's product costs about one matrix-vector product per row there (it
    repacks w for its GEMM on every call). Differentiable (the gradient is XLA's).
    preferred_element_type: XLA's accumulation and output type (float32 logits from bf16 weights)."""
    m, K = int(np.prod(x.shape[:-1])), x.shape[-1]
    lo, hi = ROWS["kn" if not nk else "nk" if rows is None else "nk_rows"]
    if not (x.dtype == w.dtype == jnp.float32 and lo <= m <= hi and usable(w)):
        return _dense_xla(x, w, rows, nk, preferred_element_type)
    kernel = lambda x2, w, rows: dense_kernel(x2, w, nk=nk, rows=rows)  # noqa: E731
    xla = lambda x2, w, rows: _dense_xla(x2, w, rows, nk)  # noqa: E731
    y = on_cpu(kernel, xla, x.reshape(m, K), w, rows)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def dense_many(x: jax.Array, ws: list[jax.Array]) -> list[jax.Array]:
    """[dense(x, w) for w in ws] for weights w [K, N_i] that share the input x [..., K] (a layer's q, k, v, or
    gate and up): one kernel call for all of them where `dense` would run the kernel for each, which saves a
    call and a hand-off to the threads per weight. Differentiable (the gradient is XLA's)."""
    m, K = int(np.prod(x.shape[:-1])), x.shape[-1]
    lo, hi = ROWS["kn"]
    if not (len(ws) > 1 and x.dtype == jnp.float32 and all(w.dtype == jnp.float32 for w in ws) and lo <= m <= hi
            and usable(*ws)):
        return [dense(x, w) for w in ws]
    ys = on_cpu(_dense_many_kernel, _dense_many_xla, x.reshape(m, K), *ws)
    return [y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys]


def tile(w: jax.Array, dtype=None) -> jax.Array:
    """W [K, N] -> its column tiles [ceil(N / TILE), K, TILE] (tile t holds W[:, TILE t : TILE (t + 1)], zeros past
    N): the layout in which the kernel reads a weight as one contiguous stream, so that a product of up to 9
    rows costs what one row does (cpu_matmul.cc, `kt_tile`). dtype: the tiles' (bfloat16 for a float32 W whose
    every value is one: `bf16_exact`), else W's."""
    K, N = w.shape
    T = -(-N // TILE)
    w = jnp.pad(w.astype(dtype or w.dtype), ((0, 0), (0, T * TILE - N)))
    return jnp.transpose(w.reshape(K, T, TILE), (1, 0, 2))


def untile(tiles: jax.Array, n: int) -> jax.Array:
    """`tile`'s inverse: tiles [T, K, TILE] -> W [K, n], float32 (bfloat16 tiles widen exactly)."""
    T, K, _ = tiles.shape
    return jnp.transpose(tiles, (1, 0, 2)).reshape(K, T * TILE)[:, :n].astype(jnp.float32)


def bf16_exact(w) -> bool:
    """Whether every value of the concrete float32 array w is a bfloat16 (a bfloat16 checkpoint loaded in float32):
    its tiles can then be kept in bfloat16, which the kernel widens exactly, so products read half the bytes and
    give the float32 tiles' results bit for bit. A prefix is tried first, so other weights cost little to rule out."""
    w = np.asarray(w)
    if w.dtype != np.float32:
        return False
    flat = w.reshape(-1)
    return all(np.array_equal(part, part.astype(jnp.bfloat16).astype(np.float32)) for part in (flat[:4096], flat))


def dense_tiled(x: jax.Array, tiles: jax.Array, n: int) -> jax.Array:
    """x [..., K] @ W [K, n], W given as its column tiles (`tile`): the kernel for float32 products of any number
    of rows where it may run (it matches or beats XLA's product on the plain [K, n] from one row to a prefill's
    thousand: bench/cpu/tiles.py), else XLA's product on the untiled weight. Differentiable (the gradient is
    XLA's)."""
    return dense_many_tiled(x, [tiles], [n])[0]


def dense_many_tiled(x: jax.Array, tiles: list[jax.Array], ns: list[int]) -> list[jax.Array]:
    """[dense_tiled(x, t, n) for t, n in zip(tiles, ns)] in one kernel call (a layer's q, k, v or gate and up)."""
    m, K = int(np.prod(x.shape[:-1])), x.shape[-1]
    x2, ns = x.reshape(m, K), tuple(ns)
    if x.dtype == jnp.float32 and all(t.dtype in (jnp.float32, jnp.bfloat16) for t in tiles) and m >= 1 \
            and usable(*tiles, tiles=True):
        ys = on_cpu(lambda x2, *ts: _tiled_kernel(ns, x2, *ts), lambda x2, *ts: _tiled_xla(ns, x2, *ts), x2, *tiles)
    else:
        ys = _tiled_xla(ns, x2, *tiles)
    return [y.reshape(*x.shape[:-1], n) for y, n in zip(ys, ns)]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Tiles:
    """A float32 Linear kernel W [K, N] in this backend's layout: its column tiles [ceil(N / TILE), K, TILE]
    (`tile`), float32, or bfloat16 where every value of W is one (`bf16_exact`). It stands in a Param in W's
    place (`to_layout`), so the parameter tree keeps its paths, types and axes; only the products in
    `jaxspec.kernels` look inside."""

    tiles: jax.Array
    n: int = field(metadata=dict(static=True))  # W's columns (the last tile is zero-padded)

    shape = property(lambda self: (self.tiles.shape[1], self.n))
    dtype = property(lambda self: jnp.dtype(jnp.float32))  # W's, whatever the tiles are stored in
    ndim = 2

    def __getitem__(self, index):  # `param[...]` hands the layout on to the product
        if index is not Ellipsis:
            raise TypeError("a weight in column tiles is read whole (param[...]); kernels.plain gives the array")
        return self

    def weight(self) -> jax.Array:
        """W [K, N], float32."""
        return untile(self.tiles, self.n)

    def columns(self, idx: jax.Array) -> jax.Array:
        """W's columns idx [M] as rows [M, K], float32 (a draft vocabulary's slice of an untied LM head)."""
        return self.tiles[idx // TILE, :, idx % TILE].astype(jnp.float32)


def _is_linear_kernel(path, var) -> bool:
    """A Linear's float32 [in, out] kernel: the only Params named `kernel` (packed ones are modules)."""
    return path[-1] == "kernel" and isinstance(var, nnx.Param) and var.ndim == 2 and var.dtype == jnp.float32


def to_layout(state, compact: bool = True):
    """A parameter state with every Linear kernel in column tiles (`Tiles`) where the tiled product runs here,
    else the state as it is. compact: bfloat16 tiles for kernels whose every value is one (needs concrete
    values)."""
    if not usable(tiles=True):
        return state

    def put(path, var):
        if not _is_linear_kernel(path, var) or isinstance(var[...], Tiles):
            return var
        w = var[...]
        return var.replace(Tiles(tile(w, jnp.bfloat16 if compact and bf16_exact(w) else None), int(w.shape[1])))

    return nnx.map_state(put, state)


def from_layout(state):
    """`to_layout`'s inverse: every `Tiles` back to its float32 [in, out] array."""
    return nnx.map_state(lambda _, var: var.replace(var[...].weight()) if isinstance(var[...], Tiles) else var,
                         state)


def dense_kernel(x: jax.Array, w: jax.Array, *, nk: bool = False, rows: jax.Array | None = None) -> jax.Array:
    """`dense` on the kernel whatever the number of rows: x float32 [M, K] -> [M, N]."""
    if level() < 2:
        raise RuntimeError("the CPU matmul kernel is unavailable (see the notice above)")
    idx = jnp.zeros((1,), jnp.int32) if rows is None else rows.astype(jnp.int32)
    return _dense_kernel(x, w, idx, nk, rows is not None)


def argmax(x: jax.Array, xla) -> jax.Array:
    """Row-wise argmax of float32 x [..., V] -> int32 [...] on the kernel (the first maximum, the first NaN if
    any: jnp.argmax's rule) where it may run here, else `xla(x)`."""
    if not (x.dtype == jnp.float32 and x.shape[-1] >= 1 and usable(x)):
        return xla(x)
    m = int(np.prod(x.shape[:-1]))

    def kernel(x):
        call = jax.ffi.ffi_call(ARGMAX, jax.ShapeDtypeStruct((m,), jnp.int32), vmap_method="sequential")
        return call(x.reshape(m, x.shape[-1])).reshape(x.shape[:-1])

    return on_cpu(kernel, xla, x)


# New tokens per forward up to which the attention kernel runs (decode steps, tree verifies up to budget 63);
# a prefill's long blocks keep XLA's batched products.
ATTENTION_ROWS = 64


def cache_attention(q, k_old, v_old, k_new, v_new, length, mask, scale: float, softcap: float | None, xla):
    """Attention of q [B, N, H, D] over the cache k_old, v_old [B, KVH, T, D] (row b's slots < length[b]) and this
    forward's k_new, v_new [B, N, KVH, D], mask [B, N, M] over the written cache (M = T, or T + N for a ring) ->
    [B, N, H, D], on the kernel where it may run here (float32, N <= ATTENTION_ROWS, D a multiple of 16, no
    multi-device mesh), else `xla(...)` on the same arguments (attention.attend_and_write's reference form). The
    kernel reads only the committed slots, where XLA's products and softmax run over the whole buffer."""
    args = (q, k_old, v_old, k_new, v_new, length, mask)
    if not (all(x.dtype == jnp.float32 for x in args[:5]) and q.shape[1] <= ATTENTION_ROWS
            and q.shape[-1] % 16 == 0 and usable(q, k_old, v_old)):
        return xla(*args)

    def kernel(q, k_old, v_old, k_new, v_new, length, mask):
        call = jax.ffi.ffi_call(ATTENTION, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
        return call(q, k_old, v_old, k_new, v_new, mask, jnp.broadcast_to(jnp.asarray(length, jnp.int32), q.shape[:1]),
                    scale=np.float32(scale), softcap=np.float32(softcap or 0.0))

    return on_cpu(kernel, xla, *args)


def _dense_xla(x, w, rows, nk, preferred_element_type=None):
    return xla_forms.dense(x, w, transposed=nk, select=rows if nk else None, out_dtype=preferred_element_type)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _dense_kernel(x, w, idx, nk, gather):
    n = (idx.shape[0] if gather else w.shape[0]) if nk else w.shape[1]
    call = jax.ffi.ffi_call(DENSE, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32), vmap_method="sequential")
    return call(x, w, idx, nk=nk, gather=gather)


def _dense_fwd(x, w, idx, nk, gather):
    return _dense_kernel(x, w, idx, nk, gather), (x, w, idx)


def _dense_bwd(nk, gather, res, g):
    x, w, idx = res
    _, vjp = jax.vjp(lambda x, w: _dense_xla(x, w, idx if gather else None, nk), x, w)
    return (*vjp(g), None)


_dense_kernel.defvjp(_dense_fwd, _dense_bwd)


@jax.custom_vjp
def _dense_many_kernel(x, *ws):
    shapes = [jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32) for w in ws]
    return list(jax.ffi.ffi_call(DENSE_MANY, shapes, vmap_method="sequential")(x, *ws))


def _dense_many_fwd(x, *ws):
    return _dense_many_kernel(x, *ws), (x, ws)


def _dense_many_xla(x, *ws):
    return [_dense_xla(x, w, None, False) for w in ws]


def _dense_many_bwd(res, gs):
    x, ws = res
    _, vjp = jax.vjp(_dense_many_xla, x, *ws)
    return vjp(list(gs))


_dense_many_kernel.defvjp(_dense_many_fwd, _dense_many_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tiled_kernel(ns, x, *tiles):
    shapes = [jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32) for n in ns]
    if len(tiles) == 1:
        call = jax.ffi.ffi_call(DENSE, shapes[0], vmap_method="sequential")
        return [call(x, tiles[0], jnp.zeros((1,), jnp.int32), nk=False, gather=False)]
    return list(jax.ffi.ffi_call(DENSE_MANY, shapes, vmap_method="sequential")(x, *tiles))


def _tiled_xla(ns, x, *tiles):
    """x [M, K] @ each weight [K, n], untiled first: a copy of every weight per call (XLA's einsum over the
    tiles themselves costs about the same), so it runs only where the kernel cannot (another platform's
    lowering, the gradient)."""
    return [x @ untile(t, n) for t, n in zip(tiles, ns)]


def _tiled_fwd(ns, x, *tiles):
    return _tiled_kernel(ns, x, *tiles), (x, tiles)


def _tiled_bwd(ns, res, gs):
    x, tiles = res
    _, vjp = jax.vjp(lambda x, *ts: _tiled_xla(ns, x, *ts), x, *tiles)
    return vjp(list(gs))


_tiled_kernel.defvjp(_tiled_fwd, _tiled_bwd)
