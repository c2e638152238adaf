"""The user's cache directory: what one run keeps so the next need not redo it.

`~/.cache/jaxspec` (`$XDG_CACHE_HOME/jaxspec`, or `$JAXSPEC_CACHE_DIR`) holds the CPU kernel's build, the
budget cost table, a GGUF's index and tokenizer, and the command's compiled programs. Everything in it can be
made again, so a directory that cannot be written only costs time.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import jax


def cache_dir() -> Path:
    env = os.environ.get("JAXSPEC_CACHE_DIR")
    return Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxspec"


def derived_from(path: Path, kind: str, *parts) -> Path:
    """Where something derived from the file `path` is kept: cache_dir()/kind/<key>, the key naming the file
    (resolved path, size, modification time, so a changed or another file gets its own entry) and `parts`
    (the versions of what derived it)."""
    st = path.stat()
    key = repr((str(path.resolve()), st.st_size, st.st_mtime_ns, *parts))
    return cache_dir() / kind / hashlib.sha256(key.encode()).hexdigest()[:24]


def keep_compiled() -> None:
    """Let repeat runs load XLA's compiled prefill and decode loops instead of compiling them again: JAX's
    persistent compilation cache, in cache_dir()/xla unless JAX_COMPILATION_CACHE_DIR (or the program) names
    one, and not at all under JAXSPEC_COMPILATION_CACHE=0. `jaxspec.load` and the command call it; JAX decides
    on a process's first compile whether it uses the cache, so a program that compiled before loading a model
    keeps its own choice. A repeat run then skips most of "prefill + compile" (docs/benchmarks/cpu.md); on a
    GPU a large target's programs take minutes to compile."""
    if jax.config.jax_compilation_cache_dir is not None or os.environ.get("JAXSPEC_COMPILATION_CACHE") == "0":
        return
    path = cache_dir() / "xla"
    try:  # without a usable directory JAX would warn at every compile: compile every time instead
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    if not os.access(path, os.W_OK):
        return
    jax.config.update("jax_compilation_cache_dir", str(path))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
