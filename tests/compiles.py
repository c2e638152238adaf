"""Counting XLA compiles: a program that compiles again where it should be reused is a silent cost (seconds per
call on a CPU, minutes on a large GPU target), which only a count shows."""
from __future__ import annotations

import contextlib
from collections import Counter

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT


@contextlib.contextmanager
def compiles():
    """Counts XLA compiles by program name ("jit(spec_decode)") while the block runs."""
    counted = Counter()

    def count(event, _secs, fun_name="", **_):
        counted[fun_name] += event == COMPILE_EVENT

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        yield counted
    finally:
        jax.monitoring.unregister_event_duration_listener(count)


def engine_compiles(counted: Counter) -> dict[str, int]:
    """The engine's programs (prefill, decode loops, refills, reslots) among the counted compiles."""
    return {k: v for k, v in counted.items() if v and k.startswith("jit(") and k[4:-1].split("_")[0] in ("ar", "spec")}
