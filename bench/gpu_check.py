"""One prepared check for a lent GPU (bench/gpu_check.sh runs it): random-weight targets shaped like an 8B dense
Llama and Qwen3.6-27B (hybrid GDN), bf16, on one GPU (an H100 80 GB holds the 27B's 54 GB), in one run:

  * HBM bandwidth (a 4 GiB bf16 copy and a 4 GiB read), the roofline every time below is compared with;
  * the KV and latent commit kernels (Pallas, Mosaic GPU) against their XLA references, the flash-decoding
    kernel (Mosaic GPU; over a KV cache and over MLA's 576-wide latents) against the blocked loop it replaced, and
    JAX's grouped matmul for MoE experts against lax.ragged_dot (each turned off for the targets should it fail);
  * per target, the 8B first: one AR step and one tree verify (budgets 64, then 16 / 128 / 32) behind 500
    committed tokens, in a tight buffer (768 slots) and a realistic one (32k slots), since attention reads the
    whole buffer; the roofline of an AR step is the bytes it reads (the weights but the embedding table's unread
    rows, and the KV buffer) over the measured bandwidth; then AR and DDTree (budget 64, the oracle drafter
    proposing the target's greedy continuation, so deep paths are accepted) end to end: tokens/s, acceptance
    length, rounds/s; last, batches of 4 and 16 rows: an AR step and a verify of B trees of 16 nodes.

Survival on a 15-minute lease: the weights are rescaled leaf by leaf with donation (never two copies of the 54 GB),
every section runs in its own try/except that records the error and goes on, the JSON is rewritten after every
measurement (a crash or the shell's timeout keeps what was measured), and every step checks the time left
(`--minutes`; each target gets its share) and is recorded as skipped rather than overrunning. `--layers N`
truncates each target to N layers (full width). `--dry-run` runs the same code on tiny shapes in seconds (on the
CPU: tests/test_gpu_check.py). Prints a summary and writes `--out` (default $OUT/gpu_check_<backend>.json where
$OUT is set, else bench/results/).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import signal
import statistics
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxspec
from jaxspec.config import dense_config_from_dict
from jaxspec.kernels import gpu, use
from jaxspec.models.attention import cache_mask
from jaxspec.models.qwen3_next import hybrid_config_from_dict
from jaxspec.segment import Segment
from jaxspec.testing import interpreted_grouped_matmul, oracle_drafter
from jaxspec.tree import build_tree, tree_segment
from pallas_kernels.kv_commit import kv_commit, latent_commit

RESULTS = Path(__file__).parent / "results"
QWEN36_27B = dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                  num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                  linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                  max_position_embeddings=262144, eos_token_id=None, bos_token_id=None,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
LLAMA_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, eos_token_id=None,
                bos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
TARGETS = (("llama-8b", LLAMA_8B), ("qwen3.6-27b", QWEN36_27B))  # the 8B first: its numbers are the surest
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
            linear_value_head_dim=32, num_hidden_layers=2, full_attention_interval=2)  # hybrid: GDN + attention


@dataclasses.dataclass(frozen=True)
class Plan:
    """Sizes and counts: the GPU's, or the dry run's tiny ones (the same code runs both)."""

    dtype: str = "bfloat16"
    used: int = 500  # committed tokens behind every timed forward
    tight: int = 768  # slots of the tight buffer
    long: int = 32768  # slots of the realistic one
    reps: int = 5  # timed calls after the compile
    bandwidth_elems: int = 2 << 30  # bf16: 4 GiB
    commit_slots: int = 8192
    prompt: int = 64
    new_tokens: int = 128
    budget: int = 64  # verified at both buffers first, and DDTree's end to end
    more_budgets: tuple[int, ...] = (16, 128, 32)  # then these, if time allows
    batches: tuple[int, ...] = (4, 16)  # batched AR step and verify (B rows x (1 + batch_budget) nodes), last
    batch_budget: int = 16
    attention: tuple[int, int, int] = (24, 4, 256)  # the flash-decoding check's heads, KV heads, head_dim: Qwen3.6's
    latent: tuple[int, int, int] = (128, 576, 512)  # and over MLA's latents: heads, width, value width (DeepSeek-V3)
    # grouped matmul: (pairs, in, out, experts): a 1k prefill chunk's gate projection on one of 8 expert-parallel
    # devices of DeepSeek-V3; a 512-token chunk's fused gate_up of Gemma-4-26B-A4B's 128 experts on one device (the
    # kernel unrolls its group search over every group)
    grouped: tuple[tuple[int, int, int, int], ...] = ((8192, 7168, 2048, 32), (4096, 2816, 1408, 128))


DRY = Plan(dtype="float32", long=1024, reps=2, bandwidth_elems=1 << 20, commit_slots=512, new_tokens=24,
           more_budgets=(16,), batches=(2,), batch_budget=8, attention=(4, 2, 64), latent=(4, 192, 128),
           grouped=((150, 128, 256, 6),))


class Interrupted(BaseException):
    """SIGTERM (the shell's timeout): unwinds past the sections' `except Exception` to the final save."""


def on_sigterm(signum, frame):
    raise Interrupted("SIGTERM (timeout)")


class Clock:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def share(self, fraction: float) -> "Clock":
        """A clock that ends after `fraction` of the time left."""
        return Clock(max(0.0, self.left()) * fraction)


class Report:
    """The results as they are measured, rewritten to `path` after every step (atomically)."""

    def __init__(self, path: Path, meta: dict):
        self.path, self.data = path, dict(meta, sections={})
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)

    def section(self, parent: dict, name: str, fn, *args, need_s: float = 0.0, clock: Clock | None = None) -> dict:
        """parent[name] = a dict that fn(out, *args) fills as it measures; an exception is recorded in it (the
        partial numbers stay) and the run goes on. Skipped when the clock has under need_s left."""
        out = parent[name] = {}
        if clock is not None and clock.left() < need_s:
            out.update(status="skipped", reason=f"time: {clock.left():.0f} s left, ~{need_s:.0f} s needed")
            print(f"[  skip  ] {name}: {out['reason']}", flush=True)
            self.save()
            return out
        t = time.monotonic()
        try:
            fn(out, *args)
            out["status"] = "ok"
        except Interrupted:
            out.update(status="interrupted", seconds=time.monotonic() - t)
            raise
        except Exception as e:  # one failing section must not lose the others' numbers
            out.update(status="error", error=f"{type(e).__name__}: {str(e)[:1500]}",
                       trace=traceback.format_exc()[-3000:])
        out["seconds"] = time.monotonic() - t
        peak = memory_peak()
        if peak is not None:
            out["peak_gb_so_far"] = peak / 1e9
        brief = {k: v for k, v in out.items() if k != "trace" and not isinstance(v, dict)}  # nested: printed already
        print(f"[{out['seconds']:6.1f} s] {name}: {json.dumps(brief, default=str)[:500]}", flush=True)
        self.save()
        return out


def memory_peak() -> int | None:
    try:
        return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    except Exception:  # a backend without memory statistics
        return None


def timed(fn, *args, reps: int) -> tuple[float, float]:
    """(median seconds of `reps` calls, seconds of the first call: compile + run)."""
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), first


# ------------------------------------------------------------------------------------------ machine


def bandwidth(out: dict, plan: Plan) -> None:
    x = jnp.ones((plan.bandwidth_elems,), jnp.bfloat16)
    copy, _ = timed(jax.jit(lambda a: a * 2), x, reps=plan.reps)
    read, _ = timed(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), x, reps=plan.reps)
    out.update(bytes=x.nbytes, copy_gb_per_s=2 * x.nbytes / copy / 1e9, read_gb_per_s=x.nbytes / read / 1e9)
    out["gb_per_s"] = max(out["copy_gb_per_s"], out["read_gb_per_s"])  # the roofline's bandwidth
    x.delete()


def commits(out: dict, plan: Plan) -> None:
    """The commit kernels vs XLA on a 32-token accepted path (the worst case of one round)."""
    T = plan.commit_slots
    path, start, n = jnp.arange(0, 64, 2, dtype=jnp.int32), jnp.int32(T - 256), jnp.int32(32)
    out["rows"] = rows = []
    for name, f, shape in (("kv [1, 8, T, 128]", kv_commit, (1, 8, T, 128)),
                           ("latent [1, T, 576]", latent_commit, (1, T, 576))):
        row = dict(cache=name, T=T)
        rows.append(row)
        try:  # each kernel on its own: a Mosaic GPU failure of one keeps the other's numbers
            cache = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
            xla = jax.jit(lambda c, f=f: f(c, path, start, n, impl="xla"))
            row["xla_us"] = timed(xla, cache, reps=plan.reps)[0] * 1e6
            pallas = jax.jit(lambda c, f=f: f(c, path, start, n, impl="pallas"))
            row["same_as_xla"] = bool(jnp.array_equal(xla(cache), pallas(cache)))
            row["pallas_us"] = timed(pallas, cache, reps=plan.reps)[0] * 1e6
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:1000]}"
    failed = [r["cache"] for r in rows if "error" in r]
    if failed:
        raise RuntimeError(f"commit kernels failed: {', '.join(failed)}")


def decode_kernel(out: dict, plan: Plan) -> None:
    """The flash-decoding kernel that GPU programs read a layer's committed prefix with (gpu.cache_attention,
    ranged) against the blocked loop it replaced, in bf16 behind plan.used tokens of a plan.long-slot buffer: an AR
    step and a budget-64 verify, their outputs compared and both timed. If the kernel fails or disagrees it is
    turned off (gpu.FLASH_DECODE) for the targets after it, which then run the blocked loop, and the error is
    recorded. The dry run (a CPU) runs it under JAX's Mosaic GPU interpreter."""
    H, KVH, D = plan.attention
    T, used = plan.long, plan.used
    gpu.INTERPRET = jax.default_backend() == "cpu"
    out["rows"] = rows = []
    try:
        for N in (1, 65):
            ks = jax.random.split(jax.random.key(N), 5)
            q = jax.random.normal(ks[0], (1, N, H, D), jnp.bfloat16)
            k_old, v_old = (jax.random.normal(x, (1, KVH, T, D), jnp.bfloat16) for x in ks[1:3])
            k_new, v_new = (jax.random.normal(x, (1, N, KVH, D), jnp.bfloat16) for x in ks[3:5])
            length, start = jnp.full((1,), used, jnp.int32), jnp.zeros((1,), jnp.int32)
            visible = jnp.tril(jnp.ones((1, N, N), bool))
            mask, _ = cache_mask(used + jnp.arange(N)[None], length, start, visible, T)
            fns = {name: jax.jit(functools.partial(gpu.cache_attention, scale=D ** -0.5, ranged=ranged))
                   for name, ranged in (("kernel", True), ("blocked", False))}
            args = (q, k_old, v_old, k_new, v_new, length, mask)
            got, want = (np.asarray(f(*args), np.float32) for f in fns.values())
            row = dict(query_rows=H // KVH * N, slots=T, used=used, max_abs_diff=float(np.abs(got - want).max()))
            rows.append(row)
            for name, f in fns.items():  # (the interpreter's time means nothing)
                row[f"{name}_us"] = float("nan") if gpu.INTERPRET else timed(f, *args, reps=plan.reps)[0] * 1e6
            if not row["max_abs_diff"] < 0.05:  # bf16 probabilities: a few 1e-3 apart at most
                raise RuntimeError(f"the kernel differs from the blocked loop by {row['max_abs_diff']:.3g}")
        H, C, r = plan.latent  # MLA: the kernel's v=None form over the latents, values their first r columns
        for N in (1, 65):
            ks = jax.random.split(jax.random.key(N + 1), 2)
            q = jax.random.normal(ks[0], (1, N, H, C), jnp.bfloat16)
            latent = jax.random.normal(ks[1], (1, T, C), jnp.bfloat16)
            length, start = jnp.full((1,), used, jnp.int32), jnp.zeros((1,), jnp.int32)
            mask, _ = cache_mask(used + jnp.arange(N)[None], length, start, jnp.tril(jnp.ones((1, N, N), bool)), T)
            fns = {"kernel": jax.jit(lambda q, latent, mask: gpu.latent_attention(q, latent, mask, C ** -0.5, r,
                                                                                 length)),
                   "blocked": jax.jit(lambda q, latent, mask: gpu.latent_attention(q, latent, mask, C ** -0.5, r))}
            got, want = (np.asarray(f(q, latent, mask), np.float32) for f in fns.values())
            row = dict(latent=C, query_rows=H * N, slots=T, used=used, max_abs_diff=float(np.abs(got - want).max()))
            rows.append(row)
            for name, f in fns.items():
                row[f"{name}_us"] = (float("nan") if gpu.INTERPRET else
                                     timed(f, q, latent, mask, reps=plan.reps)[0] * 1e6)
            if not row["max_abs_diff"] < 0.05:
                raise RuntimeError(f"the latent kernel differs from the blocked loop by {row['max_abs_diff']:.3g}")
    except Exception:
        gpu.FLASH_DECODE = False
        out["turned_off"] = True
        raise
    finally:
        gpu.INTERPRET = False


def grouped_matmul(out: dict, plan: Plan) -> None:
    """JAX's Hopper grouped matmul, which GPU programs run MoE experts' grouped products with (gpu.ragged_dot),
    against lax.ragged_dot (which XLA's GPU compiler turns into a product over every group), in bf16 with group
    sizes as uneven as a router's. Turned off (gpu.GROUPED_MATMUL) should it fail or disagree. The dry run (a CPU)
    interprets it."""
    if gpu.ragged_dot_mgpu is None:
        out["skipped"] = "this JAX has no ragged_dot_mgpu"
        return
    interpreted = jax.default_backend() == "cpu"
    out["rows"] = rows = []
    try:
        for M, K, N, G in plan.grouped:
            sizes = np.random.default_rng(0).multinomial(M, np.random.default_rng(1).dirichlet(np.ones(G)))
            sizes = jnp.asarray(sizes, jnp.int32)
            ks = jax.random.split(jax.random.key(G), 2)
            x = jax.random.normal(ks[0], (M, K), jnp.bfloat16)
            w = jax.random.normal(ks[1], (G, K, N), jnp.bfloat16) * K ** -0.5
            with interpreted_grouped_matmul() if interpreted else contextlib.nullcontext():
                # fresh functions: a trace of gpu.ragged_dot cached before the switch would skip the kernel
                fns = {"kernel": jax.jit(lambda *a: gpu.ragged_dot(*a)),
                       "xla": jax.jit(lambda *a: jax.lax.ragged_dot(*a))}
                got, want = (np.asarray(f(x, w, sizes), np.float32) for f in fns.values())
            row = dict(pairs=M, inputs=K, outputs=N, groups=G, max_abs_diff=float(np.abs(got - want).max()))
            rows.append(row)
            for name, f in fns.items():
                row[f"{name}_us"] = float("nan") if interpreted else timed(f, x, w, sizes, reps=plan.reps)[0] * 1e6
            if not row["max_abs_diff"] < 0.1:  # bf16 outputs of about unit size
                raise RuntimeError(f"the grouped matmul differs from lax.ragged_dot by {row['max_abs_diff']:.3g}")
    except Exception:
        gpu.GROUPED_MATMUL = False
        out["turned_off"] = True
        raise


# ------------------------------------------------------------------------------------------ targets


def build(out: dict, ctx: dict, base: dict, layers: int | None, plan: Plan, dry: bool) -> None:
    d = dict(base, **(TINY if dry else {}))
    if layers:
        d["num_hidden_layers"] = layers
    cfg = (dense_config_from_dict if d["model_type"] == "llama" else hybrid_config_from_dict)(d)
    m = jaxspec.random_model(cfg, seed=0, dtype=plan.dtype)  # eager init: one leaf's temporary at a time
    # random weights at their init scale give flat logits; a larger scale makes greedy paths well defined.
    # Leaf by leaf, each old leaf donated (freed) as its new one is made: never a second copy of the weights.
    m.params = jax.tree.map(rescale, m.params)
    ctx["model"], ctx["forward"] = m, forward_fn(m)
    out.update(layers=cfg.num_layers, params=sum(x.size for x in jax.tree.leaves(m.params)),
               weight_bytes=sum(x.nbytes for x in jax.tree.leaves(m.params)), kernels=m.kernels)


_double = jax.jit(lambda x: (x * 2).astype(x.dtype), donate_argnums=0)


def rescale(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    y = _double(x)
    if not x.is_deleted():  # a backend that could not donate: free it by hand
        x.delete()
    return y


def nbytes(x) -> int:
    return x.size * jnp.dtype(x.dtype).itemsize  # arrays and abstract shapes alike


def weight_read_bytes(params) -> dict:
    """Bytes of weights one AR step reads: all of them but the input embedding's table, of which one row per token
    is read; the LM head is read in full (with tied embeddings the table is the LM head, so it counts in full)."""
    total = table = row = 0
    head = False
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        key, n = jax.tree_util.keystr(path), nbytes(x)
        total += n
        if key.startswith("['embed_tokens']"):
            table += n
            row += n // x.shape[0]
        head |= key.startswith("['lm_head']")
    read = total - table + row if head else total
    return dict(weight_bytes=total, embedding_table_bytes=table, weight_read_bytes=read, tied_embeddings=not head)


def cache_read_bytes(cache, used: int) -> dict:
    """Bytes of cache one forward reads: attention spans its whole KV buffer today (every slot, used or not), and
    each recurrent layer reads its state; `used` counts the committed slots only (what a length-bounded attention
    would read)."""
    whole = committed = 0
    for entry in cache.layers:
        for name, axes in getattr(entry, "AXES", {}).items():
            x = getattr(entry, name)
            whole += nbytes(x)
            committed += nbytes(x) * used // x.shape[axes.index("seq")] if "seq" in axes else nbytes(x)
    return dict(cache_slots=cache.max_len, cache_read_bytes=whole, cache_used_bytes=committed)


def forward_fn(m):
    """One target forward -> logits only. The pending cache is not returned: attention reads the old buffer and
    the new keys beside it, so the write of the new slots (in place in the engine's loops) is dropped here rather
    than costing a copy of the whole buffer per call."""
    graphdef, kernels = m.graphdef, m.kernels

    @jax.jit
    def forward(params, tokens, segment, cache):
        with use(kernels):
            logits, _, _ = nnx.merge(graphdef, params)(tokens, segment, cache)
        return logits

    return forward


def filled_cache(m, slots: int, used: int, batch: int = 1):
    """A zero cache of `batch` rows of `slots` slots with their first `used` committed."""
    cache = m.module.init_cache(batch, slots)
    return dataclasses.replace(cache, length=jnp.full_like(cache.length, used))


def free(tree) -> None:
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


def ar_steps(out: dict, ctx: dict, plan: Plan, clock: Clock) -> None:
    """One AR step behind `used` tokens in the tight and the long buffer, each against its roofline."""
    m, fwd = ctx["model"], ctx["forward"]
    weights = weight_read_bytes(m.params)
    out.update(weights, used=plan.used)
    for buf, slots in (("tight", plan.tight), ("long", plan.long)):
        if clock.left() < 1.2 * ctx.get("program_s", 0):
            out[buf] = dict(skipped="time")
            continue
        cache = filled_cache(m, slots, plan.used)
        tok, seg = jnp.zeros((1, 1), jnp.int32), Segment.causal(jnp.full((1, 1), plan.used, jnp.int32))
        t, first = timed(fwd, m.params, tok, seg, cache, reps=plan.reps)
        ctx["program_s"] = max(ctx.get("program_s", 0), first + plan.reps * t)
        row = dict(cache_read_bytes(cache, plan.used), ms=t * 1e3, first_call_s=first)
        row["bytes_read"] = weights["weight_read_bytes"] + row["cache_read_bytes"]
        bw = ctx.get("gb_per_s")
        if bw:
            row["roofline_ms"] = row["bytes_read"] / (bw * 1e9) * 1e3
            row["of_roofline"] = row["roofline_ms"] / row["ms"]
        out[buf] = row
        ctx.setdefault("ar_ms", {})[buf] = row["ms"]
        free(cache)


@functools.partial(jax.jit, static_argnums=1)
def tree_inputs(draft, budget: int, used):
    """A DDTree of `budget` nodes from draft logits [D, V] -> its verify forward's tokens [1, N] and segment."""
    tree = build_tree(draft, budget)
    return tree.tokens[None], tree_segment(tree, used)


def verify(out: dict, ctx: dict, plan: Plan, clock: Clock, budgets) -> None:
    """One tree verify per budget behind `used` tokens, in each buffer, as a multiple of that buffer's AR step."""
    m, fwd = ctx["model"], ctx["forward"]
    draft = jax.random.normal(jax.random.key(1), (15, m.config.vocab_size)) * 3
    out["rows"] = rows = []
    for buf, slots in (("tight", plan.tight), ("long", plan.long)):
        cache = None
        for b in budgets:
            if clock.left() < 1.2 * ctx.get("program_s", 0):
                rows.append(dict(buffer=buf, budget=b, skipped="time"))
                continue
            if cache is None:
                cache = filled_cache(m, slots, plan.used)
            tokens, segment = tree_inputs(draft, b, jnp.int32(plan.used))
            t, first = timed(fwd, m.params, tokens, segment, cache, reps=plan.reps)
            row = dict(buffer=buf, slots=slots, budget=b, ms=t * 1e3, first_call_s=first)
            ar = ctx.get("ar_ms", {}).get(buf)
            if ar:
                row["over_ar_step"] = row["ms"] / ar
            rows.append(row)
            ctx["report"].save()
        if cache is not None:
            free(cache)


def batched(out: dict, ctx: dict, plan: Plan, clock: Clock) -> None:
    """A batch of B rows in the tight buffer: one AR step (B tokens) and one verify of B trees of `batch_budget`
    nodes (what a batched DDTree round verifies), against B AR steps at batch 1 (what the rows cost alone)."""
    m, fwd = ctx["model"], ctx["forward"]
    draft = jax.random.normal(jax.random.key(2), (15, m.config.vocab_size)) * 3
    tokens, segment = tree_inputs(draft, plan.batch_budget, jnp.int32(plan.used))
    out["rows"] = rows = []
    for B in plan.batches:
        if clock.left() < 2.4 * ctx.get("program_s", 0):
            rows.append(dict(batch=B, skipped="time"))
            continue
        cache = filled_cache(m, plan.tight, plan.used, B)
        rep = functools.partial(jnp.repeat, repeats=B, axis=0)
        ar, _ = timed(fwd, m.params, jnp.zeros((B, 1), jnp.int32),
                      Segment.causal(jnp.full((B, 1), plan.used, jnp.int32)), cache, reps=plan.reps)
        ver, _ = timed(fwd, m.params, rep(tokens), jax.tree.map(rep, segment), cache, reps=plan.reps)
        row = dict(batch=B, budget=plan.batch_budget, ar_ms=ar * 1e3, verify_ms=ver * 1e3, verify_over_ar=ver / ar)
        alone = ctx.get("ar_ms", {}).get("tight")
        if alone:
            row["ar_over_rows_alone"] = row["ar_ms"] / (B * alone)
        rows.append(row)
        ctx["report"].save()
        free(cache)


def end_to_end(out: dict, ctx: dict, plan: Plan) -> None:
    """AR and DDTree(64) through jaxspec.generate; each run twice, the second one (compiled) reported."""
    m = ctx["model"]
    prompt = [int(t) for t in np.random.RandomState(0).randint(0, m.config.vocab_size, plan.prompt)]

    def run(**kw):
        jaxspec.generate(m, input_ids=prompt, max_new_tokens=plan.new_tokens, **kw)  # compile
        return jaxspec.generate(m, input_ids=prompt, max_new_tokens=plan.new_tokens, **kw)

    ar = run(method="ar")
    out.update(new_tokens=plan.new_tokens, ar_tokens_per_s=ar.stats["tokens_per_second"])
    ctx["report"].save()
    d = oracle_drafter(m, prompt + ar.token_ids, noise=0.0, block_size=16)
    r = run(drafter=d, method="ddtree", budget=plan.budget)
    same = r.token_ids == ar.token_ids  # bf16 near-ties may part them; recorded, not raised
    first_diff = next((i for i, (a, b) in enumerate(zip(ar.token_ids, r.token_ids)) if a != b), None)
    out.update(ddtree_tokens_per_s=r.stats["tokens_per_second"], acceptance_length=r.stats["acceptance_length"],
               rounds_per_s=r.stats["rounds"] / r.stats["decode_s"], same_tokens_as_ar=same,
               first_difference=first_diff, speedup=r.stats["tokens_per_second"] / out["ar_tokens_per_s"])


def target(out: dict, report: Report, base: dict, args, plan: Plan, clock: Clock) -> None:
    """One target: build, AR steps, verify at budget 64, end to end, then the other budgets; each step its own
    section. A step is skipped when its model's clock has under ~1.2 compiled programs' time left (end to end:
    4)."""
    ctx = dict(report=report, gb_per_s=report.data["sections"].get("bandwidth", {}).get("gb_per_s"))
    try:
        report.section(out, "build", build, ctx, base, args.layers, plan, args.dry_run)
        if "model" not in ctx:
            raise RuntimeError(f"build failed: {out['build'].get('error')}")
        report.section(out, "ar_step", ar_steps, ctx, plan, clock)
        if not ctx.get("ar_ms"):
            raise RuntimeError(f"no AR step measured: {out['ar_step'].get('error') or 'time'}")
        prog = ctx["program_s"]
        report.section(out, "verify", verify, ctx, plan, clock, (plan.budget,), need_s=1.2 * prog, clock=clock)
        report.section(out, "generate", end_to_end, ctx, plan, need_s=4 * prog, clock=clock)
        report.section(out, "verify_more", verify, ctx, plan, clock, plan.more_budgets, need_s=1.2 * prog, clock=clock)
        report.section(out, "batched", batched, ctx, plan, clock, need_s=2.4 * prog, clock=clock)
        errors = [k for k, v in out.items() if isinstance(v, dict) and v.get("status") == "error"]
        if errors:
            raise RuntimeError(f"steps failed: {', '.join(errors)}")
    finally:
        ctx.clear()
        gc.collect()  # the next target needs the memory
        out["live_gb_after"] = sum(x.nbytes for x in jax.live_arrays()) / 1e9  # a leak would show here


# ------------------------------------------------------------------------------------------ summary


def summary(report: dict) -> None:
    s = report["sections"]
    bw = s.get("bandwidth", {})
    if "gb_per_s" in bw:
        print(f"\nHBM: copy {bw['copy_gb_per_s']:.0f} GB/s, read {bw['read_gb_per_s']:.0f} GB/s")
    for row in s.get("decode_kernel", {}).get("rows", []):
        kernel, blocked = row.get("kernel_us", float("nan")), row.get("blocked_us", float("nan"))
        what = f"latents of {row['latent']}, " if "latent" in row else ""
        print(f"flash decode, {what}{row['query_rows']} query rows over {row['used']} of {row['slots']} slots: "
              f"kernel {kernel:.1f} us, blocked loop {blocked:.1f} us, max diff {row['max_abs_diff']:.2g}")
    for g in s.get("grouped_matmul", {}).get("rows", []):
        print(f"grouped matmul, {g['pairs']} pairs x {g['inputs']} -> {g['outputs']} over {g['groups']} groups: "
              f"kernel {g.get('kernel_us', float('nan')):.1f} us, lax.ragged_dot {g.get('xla_us', float('nan')):.1f} "
              f"us, max diff {g['max_abs_diff']:.2g}")
    for row in s.get("commit_kernels", {}).get("rows", []):
        print(f"commit {row['cache']} T={row['T']}: xla {row.get('xla_us', float('nan')):.1f} us, "
              f"pallas {row.get('pallas_us', float('nan')):.1f} us, same {row.get('same_as_xla')}")
    print("\n| target | status | GB read/step (tight/long) | AR ms tight/long | of roofline | verify/AR tight "
          "@16/32/64/128 | verify/AR long | AR tok/s | DDTree tok/s | AL | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for name, _ in TARGETS:
        t = s.get(name, {})
        ar, g = t.get("ar_step", {}), t.get("generate", {})
        rows = t.get("verify", {}).get("rows", []) + t.get("verify_more", {}).get("rows", [])

        def ratios(buf):
            by = {r["budget"]: r.get("over_ar_step") for r in rows if r["buffer"] == buf}
            return "/".join(f"{by[b]:.2f}" if by.get(b) else "-" for b in (16, 32, 64, 128))

        tight, long = ar.get("tight", {}), ar.get("long", {})
        print(f"| {name} | {t.get('status', '-')} | {tight.get('bytes_read', nan) / 1e9:.2f}/"
              f"{long.get('bytes_read', nan) / 1e9:.2f} | {tight.get('ms', nan):.2f}/{long.get('ms', nan):.2f} | "
              f"{tight.get('of_roofline', nan):.0%}/{long.get('of_roofline', nan):.0%} | {ratios('tight')} | "
              f"{ratios('long')} | {g.get('ar_tokens_per_s', nan):.1f} | {g.get('ddtree_tokens_per_s', nan):.1f} | "
              f"{g.get('acceptance_length', nan):.2f} | {g.get('speedup', nan):.2f} |")
        for r in t.get("batched", {}).get("rows", []):
            if "verify_ms" in r:
                print(f"  {name} batch {r['batch']}: AR step {r['ar_ms']:.2f} ms, verify of {r['batch']} x "
                      f"{1 + r['budget']} nodes {r['verify_ms']:.2f} ms ({r['verify_over_ar']:.2f} AR steps)")
        if t.get("status") == "error":
            print(f"  {name}: {t.get('error')}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=7.3, help="time for the whole check")
    ap.add_argument("--layers", type=int, default=None, help="truncate each target to N layers")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="the JSON (default $OUT/gpu_check_<backend>.json or "
                    "bench/results/)")
    ap.add_argument("--dry-run", "--tiny", action="store_true", help="tiny shapes, few iterations: the whole "
                    "script in seconds on a CPU")
    args = ap.parse_args()
    if args.dry_run:  # on the CPU, whatever the machine has
        jax.config.update("jax_platforms", "cpu")
    plan = DRY if args.dry_run else Plan()
    if args.new_tokens:
        plan = dataclasses.replace(plan, new_tokens=args.new_tokens)
    backend = jax.default_backend()
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS) / (
        f"gpu_check_{backend}{'_dry' if args.dry_run else ''}.json")
    dev = jax.devices()[0]
    report = Report(out, dict(backend=backend, device=str(dev), device_kind=dev.device_kind, jax=jax.__version__,
                              memory_gb=((dev.memory_stats() or {}).get("bytes_limit") or 0) / 1e9,
                              layers=args.layers, dry_run=args.dry_run, plan=dataclasses.asdict(plan),
                              started=time.strftime("%Y-%m-%dT%H:%M:%S"),
                              env={k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_"))}))
    signal.signal(signal.SIGTERM, on_sigterm)
    clock, sections = Clock(60 * args.minutes), report.data["sections"]
    t0 = time.monotonic()
    try:
        report.section(sections, "bandwidth", bandwidth, plan, need_s=10, clock=clock)
        report.section(sections, "commit_kernels", commits, plan, need_s=20, clock=clock)
        report.section(sections, "decode_kernel", decode_kernel, plan, need_s=20, clock=clock)
        report.section(sections, "grouped_matmul", grouped_matmul, plan, need_s=20, clock=clock)
        for i, (name, base) in enumerate(TARGETS):
            share = clock.share(0.4 if i < len(TARGETS) - 1 else 1.0)  # the 8B must leave the 27B its time
            report.section(sections, name, target, report, base, args, plan, share, need_s=30, clock=share)
    except Interrupted as e:
        report.data["interrupted"] = str(e)
    finally:
        report.data["total_s"] = time.monotonic() - t0
        report.save()
    summary(report.data)
    print(f"wrote {out}", flush=True)
    if "interrupted" in report.data:  # JAX was stopped mid-call: leave without its shutdown, which may crash
        os._exit(124)


if __name__ == "__main__":
    main()
