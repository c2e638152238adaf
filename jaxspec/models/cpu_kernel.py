"""The packed-weight matmul for XLA:CPU (`packed_matmul_cpu.cc`, called through the XLA FFI): built with the
system C++ compiler on first use, cached, registered with JAX.

Why a native kernel: XLA:CPU has no fused form that reads packed weights at memory speed (see quant.py), and
a batch-1 decode step is bound by the weight bytes it reads, so this is what makes packed weights pay off on
a CPU. Compiled for the host (`-march=native`) into jaxspec's cache directory (`~/.cache/jaxspec`;
`$JAXSPEC_CACHE_DIR` moves it), keyed by the source, the compiler flags, the jax version and the CPU, so an
upgrade or another machine rebuilds it. Without a compiler (or with JAXSPEC_CPU_KERNEL=0) packed products fall back to XLA's fused loop:
same results, slower; the reason is printed once.
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
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.budget import cache_dir

SOURCE = Path(__file__).with_name("packed_matmul_cpu.cc")
TARGET = "jaxspec_packed_matmul"


def _host() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in info if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def _build() -> Path:
    cxx = os.environ.get("CXX", "c++")
    flags = ["-O3", "-march=native", "-std=c++17", "-fopenmp-simd", "-shared", "-fPIC",
             f"-I{jax.ffi.include_dir()}"]
    key = hashlib.sha256(b"\0".join(s.encode() for s in (SOURCE.read_text(), cxx, *flags[:-1], jax.__version__,
                                                          _host()))).hexdigest()[:16]
    cache = cache_dir()
    lib = cache / f"packed_matmul_cpu-{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # build aside, then rename: never a half-written .so
            out = Path(tmp) / lib.name
            subprocess.run([cxx, *flags, str(SOURCE), "-o", str(out)], check=True, capture_output=True, text=True)
            os.replace(out, lib)
    return lib


@functools.cache
def available() -> bool:
    """Build (or find) and register the kernel once per process; False if that is impossible or disabled."""
    if os.environ.get("JAXSPEC_CPU_KERNEL", "1") == "0":
        return False
    try:
        lib = ctypes.CDLL(str(_build()))
    except subprocess.CalledProcessError as e:
        why = (e.stderr or "").strip().splitlines()[-1:] or [f"exit code {e.returncode}"]
        return _unavailable(f"compiling {SOURCE.name} failed: {why[0]}")
    except OSError as e:
        return _unavailable(str(e))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.jaxspec_packed_matmul), platform="cpu")
    return True


def _unavailable(why: str) -> bool:
    print(f"jaxspec: the packed-weight CPU kernel is unavailable ({why}); packed matmuls run XLA's fused loop "
          "(same results, slower). Install a C++ compiler (g++) to enable it.", file=sys.stderr)
    return False


def packed_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array, offset: jax.Array | None) -> jax.Array:
    """x float32 [M, K] @ W.T -> [M, N] on the CPU kernel, W packed as in quant.py: codes int8 [N, K] or
    uint8 [N, K / 2] (4-bit, GGUF block order), scale / offset float32 [N, G], K / G a multiple of 32."""
    if not available():
        raise RuntimeError("the packed-weight CPU kernel is unavailable (see the notice above); use quant.matmul")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], codes.shape[0]), jnp.float32),
                            vmap_method="sequential")
    bits = 4 if codes.dtype == jnp.uint8 else 8
    return call(x, codes, scale, scale if offset is None else offset, bits=np.int64(bits),
                with_offset=offset is not None)
