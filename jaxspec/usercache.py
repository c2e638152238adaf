"""The user's cache directory: what one run keeps so the next need not redo it.

`~/.cache/jaxspec` (`$XDG_CACHE_HOME/jaxspec`, or `$JAXSPEC_CACHE_DIR`) holds the CPU kernel's build, the
budget cost table, a GGUF's index and tokenizer, and the command's compiled programs. Everything in it can be
made again, so a directory that cannot be written only costs time.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


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
