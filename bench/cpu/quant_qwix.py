"""qwix (Google's JAX quantization library) against jaxspec's packed leaf, weight-only, batch-1 matvec on CPU.

Same weights, same shapes (a SmolLM2 MLP projection [576 -> 1536] and its LM head [576 -> 49152]), same
process, interleaved, best of 5 rounds of 10 calls: float32 `x @ W`; qwix `quantize` (int8 per channel, int4
with tiles of 32) + `qwix.dot_general`; jaxspec `quant.quantize` + `quant.matmul`. Also reports whether
the compiled HLO materialises a float copy of the weight. qwix is not a jaxspec dependency:
`pip install qwix` to run this.

    python bench/cpu/quant_qwix.py
"""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxspec.models import quant  # noqa: E402

SHAPES = ((576, 1536), (576, 49152))


def candidates(W: np.ndarray):
    """name -> (function (x, weight) -> y [1, 1, N], weight)."""
    import qwix

    K, N = W.shape
    out = {"float32": (lambda x, w: x @ w, jnp.asarray(W))}
    for name, qtype, tiles, scheme in (("int8 per channel", jnp.int8, None, quant.Scheme(8, None)),
                                       ("int4 groups of 32", jnp.int4, {0: 32}, quant.Scheme(4, 32))):
        qw = qwix.quantize(jnp.asarray(W), qtype, channelwise_axes=(1,), tiled_axes=tiles)
        out[f"qwix {name}"] = (lambda x, w: qwix.dot_general(x, w, (((2,), (0,)), ((), ()))), qw)
        p = quant.Packed((N, K), ("embed", "ffn"), scheme)
        for part, v in quant.quantize(W.T, scheme).parts().items():
            getattr(p, part).set_value(jnp.asarray(v))
        out[f"jaxspec {name}"] = (quant.matmul, p)
    return out


def main() -> None:
    try:
        import qwix  # noqa: F401
    except ModuleNotFoundError:
        sys.exit("bench/cpu/quant_qwix.py compares against qwix: pip install qwix")
    rng = np.random.default_rng(0)
    for K, N in SHAPES:
        W = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
        x = jnp.asarray(rng.standard_normal((1, 1, K)).astype(np.float32))
        fns = {}
        for name, (f, w) in candidates(W).items():
            j = jax.jit(f)
            hlo = j.lower(x, w).compile().as_text().split("ENTRY")[1]
            shapes = rf"({K},{N}|{N},{K}|{K // 32},32,{N}|{N},{K // 32},32)"
            float_weight = name != "float32" and bool(re.search(rf"= f32\[{shapes}\]", hlo))
            j(x, w).block_until_ready()
            fns[name] = (j, w, float_weight)
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(5):
            for name, (j, w, _) in fns.items():
                t = time.perf_counter()
                for _ in range(10):
                    y = j(x, w)
                y.block_until_ready()
                best[name] = min(best[name], (time.perf_counter() - t) / 10)
        for name, (_, _, float_weight) in fns.items():
            print(f"[{K} -> {N}] {name:26s} {best[name] * 1e6:9.1f} us  {best['float32'] / best[name]:5.2f}x float32"
                  + ("  (materialises a float weight)" if float_weight else ""))


if __name__ == "__main__":
    main()
