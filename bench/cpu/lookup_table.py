"""How often prompt lookup's chain is right, by the length of the matched n-gram: the table jaxspec.lookup
scores its chains with (CHAIN_ACCURACY), measured on the target's own greedy answers to training prompts.

    python bench/cpu/lookup_table.py [DATA.npz ...]   # default: data/smollm2-135m-instruct/selfinstruct4.s0.npz

For every answer position it looks the context up as the engine does (jaxspec.lookup.lookup_chain, the
latest earlier occurrence of the longest suffix of MAX_NGRAM..1 tokens) and follows the chain against the
answer: row n, column i is P(chain token i right | tokens < i right) when the match was n tokens long.
"""
from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxspec.lookup import MAX_NGRAM, lookup_chain
from jaxspec.train.data import Dataset

DEPTH = 16
DEFAULT = Path(__file__).resolve().parents[2] / "data/smollm2-135m-instruct/selfinstruct4.s0.npz"


def main(argv=None):
    files = (argv if argv is not None else sys.argv[1:]) or [str(DEFAULT)]
    tried, right = np.zeros((MAX_NGRAM + 1, DEPTH)), np.zeros((MAX_NGRAM + 1, DEPTH))
    lookup = jax_lookup()
    for f in files:
        d = Dataset.load(f)
        for toks, mask, n_tok in zip(d.tokens, d.loss_mask, d.lengths):
            first = int(np.argmax(mask))  # the answer's first token
            for p in range(first, int(n_tok)):  # the context is toks[:p]; the chain proposes toks[p:]
                chain, count, n = (np.asarray(x) for x in lookup(jnp.asarray(toks), p))
                for i in range(min(int(count), int(n_tok) - p)):
                    tried[n, i] += 1
                    if chain[i] != toks[p + i]:
                        break
                    right[n, i] += 1
    acc = right / np.maximum(tried, 1)
    print("n-gram  matches  P(chain token i right | the ones before right), i = 0..%d" % (DEPTH - 1))
    for n in range(1, MAX_NGRAM + 1):
        print(f"{n:>6}{int(tried[n, 0]):>9}  " + " ".join(f"{a:.2f}" for a in acc[n]))
    print("CHAIN_ACCURACY = (" + ", ".join("(" + ", ".join(f"{a:.2f}" for a in acc[n]) + ")"
                                            for n in range(1, MAX_NGRAM + 1)) + ")")


def jax_lookup():
    import jax
    return jax.jit(lambda h, p: lookup_chain(h, p, DEPTH))


if __name__ == "__main__":
    main()
