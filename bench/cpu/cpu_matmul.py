"""Few-row float32 products on this CPU: XLA's dot against jaxspec's kernel (`jaxspec.kernels.cpu.dense`, and
`dense_tiled` on the column tiles `jaxspec.load` keeps the projections in), measured in
one run on one decode step's worth of weights of a model's shapes (SmolLM2-135M by default: 30 layers of q, k,
v, o, gate, up, down, and the tied [V, H] LM head, full and on a draft vocabulary's rows).

Rows are what a step multiplies: 1 (AR), 1 + budget (a tree verify), the drafter's block. The crossover rows
this prints are where `jaxspec.kernels.cpu.ROWS` comes from.

    python bench/cpu/cpu_matmul.py [--rows 1,2,3,5,9,17,33,49] [--draft-vocab 8192]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.budget import timeit
from jaxspec.kernels import cpu as cpu_kernel

SMOLLM2 = dict(hidden=576, ffn=1536, kv=192, layers=30, vocab=49152)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,5,9,17,33,49")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    args = ap.parse_args()
    if not cpu_kernel.available():
        raise SystemExit("the CPU kernel is unavailable here (see the notice above): nothing to compare")
    c, rng = SMOLLM2, np.random.default_rng(0)
    H = c["hidden"]
    shapes = [(H, H), (H, c["kv"]), (H, c["kv"]), (H, H), (H, c["ffn"]), (H, c["ffn"]), (c["ffn"], H)] * c["layers"]
    # one copy per layer (not one matrix reused): a decode step reads them all from memory
    ws = [jnp.asarray(rng.normal(size=s).astype(np.float32) * 0.05) for s in shapes]
    head = jnp.asarray(rng.normal(size=(c["vocab"], H)).astype(np.float32) * 0.05)
    draft = jnp.asarray(np.sort(rng.choice(c["vocab"], args.draft_vocab, replace=False)).astype(np.int32))
    mb = sum(w.size for w in ws) * 4 / 1e6

    def layers(product):  # every projection of the model, each on the first columns of one wide x
        def run(x, ws):
            return sum(product(x[:, : w.shape[0]], w)[:, :1] for w in ws)
        return jax.jit(run)

    kn = {"xla": layers(lambda x, w: x @ w), "kernel": layers(cpu_kernel.dense_kernel)}
    tiles = [cpu_kernel.tile(w) for w in ws]  # the layout jaxspec.load keeps on a CPU
    tiled = jax.jit(lambda x, ts: sum(cpu_kernel.dense_tiled(x[:, : t.shape[1]], t, t.shape[0] * cpu_kernel.TILE)[:, :1]
                                      for t in ts))
    nk = {"xla": jax.jit(lambda x, w: jnp.einsum("mk,nk->mn", x, w)),
          "kernel": jax.jit(lambda x, w: cpu_kernel.dense_kernel(x, w, nk=True))}
    nk_rows = {"xla": jax.jit(lambda x, w: jnp.einsum("mk,nk->mn", x, jnp.take(w, draft, axis=0))),
               "kernel": jax.jit(lambda x, w: cpu_kernel.dense_kernel(x, w, nk=True, rows=draft))}
    print(f"backend={jax.default_backend()} projections={len(ws)} ({mb:.0f} MB float32) head={c['vocab']}x{H} "
          f"draft vocabulary={args.draft_vocab}; ms per call, median of 15")
    print(f"{'rows':>4}  {'projections xla':>15} {'kernel':>7} {'x':>5} {'tiled':>6} {'x':>5}  {'head xla':>8} "
          f"{'kernel':>7} {'x':>5}  {'draft head xla':>14} {'kernel':>7} {'x':>5}")
    for m in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.normal(size=(m, c["ffn"])).astype(np.float32))
        ms = lambda f, *a: 1e3 * timeit(f, *a, reps=15)  # noqa: E731
        t = [ms(f, x, ws) for f in kn.values()] + [ms(f, x[:, :H], head) for f in nk.values()] + \
            [ms(f, x[:, :H], head) for f in nk_rows.values()] + [ms(tiled, x, tiles)]
        print(f"{m:>4}  {t[0]:>15.2f} {t[1]:>7.2f} {t[0] / t[1]:>4.2f}x {t[6]:>6.2f} {t[0] / t[6]:>4.2f}x  "
              f"{t[2]:>8.2f} {t[3]:>7.2f} {t[2] / t[3]:>4.2f}x  {t[4]:>14.2f} {t[5]:>7.2f} {t[4] / t[5]:>4.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
