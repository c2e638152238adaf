"""Test helpers: an oracle drafter that proposes the target's own greedy future (and, at the end, the GPU path's
grouped-matmul kernel under JAX's interpreter).

Random tiny models never agree with a random drafter, so lossless tests would only ever exercise
"accept nothing". The oracle knows the target's greedy continuation (`reference`: prompt + AR greedy
output; one per row for a batch) and at committed length L proposes reference[L+1 .. L+B-1], with controllable
noise: at each
depth, with probability `noise`, the right token is demoted to rank 2..`max_rank` behind wrong ones.
So tests reach deep acceptance (noise 0), accepted siblings (noise > 0 with a wide enough tree), and
full-budget paths, with the engine, tree, walk and commits all real. It plugs into the engine like a
DFlash drafter: `draft_logits`, `init_cache`, `append_context`.
"""
from __future__ import annotations

import contextlib
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.cache import Cache
from jaxspec.config import DrafterConfig
from jaxspec.drafter import Drafter
from jaxspec.kernels import gpu
from jaxspec.model import Model
from pallas_kernels.kv_commit import GPU_INTERPRET


class OracleDrafter(nnx.Module):
    def __init__(self, cfg: DrafterConfig, reference, noise: float, max_rank: int, seed: int):
        self.config = cfg
        self.reference = nnx.Variable(jnp.asarray(reference, jnp.int32), out_sharding=("batch", "seq"),  # [B, R]
                                      eager_sharding=False)
        self.noise, self.max_rank, self.seed = float(noise), int(max_rank), int(seed)

    def init_cache(self, batch: int, max_len: int) -> Cache:
        return Cache.init((), batch, max_len)

    def append_context(self, cache: Cache, taps, n_valid) -> Cache:
        return cache.advance(n_valid)

    def draft_logits(self, target, cache: Cache, bonus, L, depth: int | None = None):
        """[B, depth, V]: row b proposes reference[b] after its committed length L[b] - start[b]."""
        ref = jnp.broadcast_to(self.reference[...], (L.shape[0], self.reference.shape[-1]))
        return jax.vmap(lambda r, n: self._row(r, n, depth))(ref, L - cache.start)

    def _row(self, ref, L, depth):
        D, V = self.config.block_size - 1, self.config.vocab_size
        idx = L + 1 + jnp.arange(D)
        right = jnp.where(idx < ref.shape[0], ref[jnp.minimum(idx, ref.shape[0] - 1)], 0)  # [D]
        k_noise, k_rank, k_wrong, k_base = jax.random.split(jax.random.fold_in(jax.random.key(self.seed), L), 4)
        logits = 0.1 * jax.random.normal(k_base, (D, V))
        demote = jax.random.uniform(k_noise, (D,)) < self.noise
        rank = jax.random.randint(k_rank, (D,), 2, self.max_rank + 1)  # the right token's rank when demoted
        # wrong tokens above it: ids right+1 .. right+rank-1 (mod V) get higher logits
        offs = jnp.arange(1, self.max_rank)
        wrong = (right[:, None] + offs[None, :]) % V  # [D, max_rank-1]
        boost = jnp.where(demote[:, None] & (offs[None, :] < rank[:, None]), 12.0 - offs[None, :] * 0.1, -jnp.inf)
        logits = logits.at[jnp.arange(D)[:, None], wrong].max(boost)
        return logits.at[jnp.arange(D), right].set(10.0)[:depth]


# DeepSeek-V3's config.json fields that shape it (61 layers, the first 3 dense, 256 routed experts): lowering
# checks and memory benches take its widths and truncate its depth and experts
DEEPSEEK_V3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                   moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128,
                   num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
                   num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
                   max_position_embeddings=163840,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                    "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "mscale": 1.0, "mscale_all_dim": 1.0})

def oracle_drafter(model: Model, reference, *, noise: float = 0.0, max_rank: int = 3, block_size: int = 16,
                   seed: int = 0) -> Drafter:
    """A Drafter whose proposals are `reference` (prompt + the target's greedy output), with noise. reference: one
    token list, or one per row of a batch (rows in the batch's order)."""
    rows = [list(reference)] if np.ndim(reference[0]) == 0 else [list(r) for r in reference]
    reference = np.zeros((len(rows), max(map(len, rows))), np.int32)  # past a row's end: token 0, never right
    for b, r in enumerate(rows):
        reference[b, : len(r)] = r
    t = model.config
    cfg = DrafterConfig(**model.family.drafter_geometry(t), hidden_size=t.hidden_size, num_layers=0,
                        vocab_size=t.vocab_size, block_size=block_size, mask_token_id=0, target_layer_ids=(0,),
                        num_target_layers=t.num_layers)
    return Drafter.from_module(OracleDrafter(cfg, np.asarray(reference), noise, max_rank, seed), model)


@contextlib.contextmanager
def interpreted_grouped_matmul():
    """The GPU path's grouped products through JAX's Hopper kernel under the Mosaic GPU interpreter, on a CPU (tests,
    bench/gpu_check.py's dry run). `ragged_dot_mgpu` takes no `interpret` argument, so its module's `plgpu.kernel`
    is given one for the duration."""
    module = gpu.ragged_dot_mgpu
    real, was = module.plgpu, gpu.INTERPRET
    shim = types.SimpleNamespace(**{n: getattr(real, n) for n in dir(real) if not n.startswith("__")})
    shim.kernel = lambda *a, **kw: real.kernel(*a, **kw, interpret=GPU_INTERPRET)
    module.plgpu, gpu.INTERPRET = shim, True
    try:
        yield
    finally:
        module.plgpu, gpu.INTERPRET = real, was
