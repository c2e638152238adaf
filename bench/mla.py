"""MLA on CPU: absorbed vs expanded attention by token count, verify cost vs tree budget, latent commit kernel vs
XLA, and latent bytes per token for the real DeepSeek-V3 and Kimi K2 shapes.

Attention: one MLA layer's attention core (`attend_absorbed` / `attend_expanded`, models/mla.py) with DeepSeek-V3's
head shapes (r 512, dn 128, dr 64, dv 128) and 16 heads (128 in the real model; a CPU stand-in), over a 1024-slot
latent cache, for N new tokens. Verify: a 4-layer MLA + MoE model (hidden 512, r 128, 8 heads, 16 experts top-4)
appending 1 + budget tree nodes behind 1024 committed slots. Commit: `latent_commit` of a [1, 1024, 576] bf16
cache, XLA vs the Pallas TPU kernel under `interpret=True`: interpret mode emulates the kernel in Python-driven
XLA and is NOT a speed figure for any accelerator (the Mosaic GPU kernel cannot run on this machine at all).

Each time is the median of 5 jitted calls after one warm-up (compile) call, float32; the machine is shared, so
compare ratios within one run.

    python bench/mla.py        # prints the tables, writes bench/results/mla_latest.json
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxspec
from jaxspec.models.deepseek import deepseek_config_from_dict
from jaxspec.models.mla import MLASpec, attend_absorbed, attend_expanded
from jaxspec.segment import Segment
from pallas_kernels.kv_commit import latent_commit


def timed(f, *args) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def attention_forms(T=1024, nH=16):
    spec = MLASpec(hidden_size=0, num_heads=nH, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128, inv_freq=(), rope_factor=1.0, scale=192**-0.5)
    k = jax.random.split(jax.random.key(0), 4)
    latent = jax.random.normal(k[0], (1, T, 576))
    w_kvb = jax.random.normal(k[1], (512, nH * 256)) * 512**-0.5
    rows = []
    for N in (1, 17, 65, 256):
        q_nope, q_pe = jax.random.normal(k[2], (1, N, nH, 128)), jax.random.normal(k[3], (1, N, nH, 64))
        mask = jnp.ones((1, N, T), bool)
        a = timed(jax.jit(lambda *x: attend_absorbed(*x, spec)), q_nope, q_pe, latent, mask, w_kvb)
        e = timed(jax.jit(lambda *x: attend_expanded(*x, spec)), q_nope, q_pe, latent, mask, w_kvb)
        rows.append(dict(tokens=N, absorbed_ms=a * 1e3, expanded_ms=e * 1e3, expanded_over_absorbed=e / a))
    return rows


def verify_cost(L=1024):
    cfg = deepseek_config_from_dict(dict(
        model_type="deepseek_v3", vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, max_position_embeddings=4096))
    model = jaxspec.random_model(cfg)
    m = model.module
    cache = dataclasses.replace(m.init_cache(1, L + 128), length=jnp.int32(L))  # L committed (zero) slots

    @jax.jit
    def verify(params, tokens, cache):
        N = tokens.shape[1]
        seg = Segment.causal(L + jnp.arange(N, dtype=jnp.int32)[None])
        return nnx.merge(model.graphdef, params)(tokens, seg, cache)[0]

    rows, base = [], None
    for budget in (0, 4, 16, 64):
        t = timed(verify, model.params, jnp.zeros((1, 1 + budget), jnp.int32), cache)
        base = base or t
        rows.append(dict(budget=budget, nodes=1 + budget, ms=t * 1e3, over_decode=t / base))
    return rows


def commit_cost():
    cache = jax.random.normal(jax.random.key(0), (1, 1024, 576)).astype(jnp.bfloat16)
    path = jnp.asarray(np.r_[0, 2, 5, 9, 13, 17, 20, 22, np.zeros(8, int)], jnp.int32)
    out = {}
    for impl in ("xla", "pallas"):
        out[impl + "_ms"] = timed(jax.jit(lambda c, p: latent_commit(c, p, jnp.int32(900), jnp.int32(8), impl=impl)),
                                  cache, path) * 1e3
    out["note"] = "pallas = the TPU kernel under interpret=True on CPU: not a speed figure"
    return out


def latent_bytes():
    """Per token over all layers, bf16: MLA's [c_kv | k_pe] vs expanded per-head K (dn + dr) and V (dv)."""
    rows = []
    for name, heads, layers in (("DeepSeek-V3", 128, 61), ("Kimi K2", 64, 61)):
        latent = (512 + 64) * 2 * layers
        expanded = heads * (128 + 64 + 128) * 2 * layers
        rows.append(dict(model=name, latent_kib=latent / 1024, expanded_kib=expanded / 1024, ratio=expanded / latent))
    return rows


def main():
    res = dict(attention=attention_forms(), verify=verify_cost(), commit=commit_cost(), bytes=latent_bytes())
    for section, rows in res.items():
        print(f"== {section}")
        for r in rows if isinstance(rows, list) else [rows]:
            print("  " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    out = Path(__file__).parent / "results" / "mla_latest.json"
    out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
