"""Pallas kernels for jaxspec's hot paths. Self-contained: nothing here imports jaxspec."""
from __future__ import annotations

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

# The lowering the Mosaic GPU kernels here were written and checked against (JAX 0.10's default). JAX 0.11 made
# warpgroup semantics the default; pinning lane semantics keeps the GPU compiling what the CPU tests lowered.
MOSAIC_GPU_PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def hopper_or_no_gpu() -> bool:
    """Whether the Mosaic GPU kernels here (written for Hopper: TMA, wgmma) may be chosen in this process: on a
    Hopper GPU (compute capability 9.x), and on a host without a GPU, which only lowers them for CUDA or
    interprets them. Other GPUs take the XLA forms: Ampere and older have neither TMA nor wgmma, Blackwell has
    no wgmma, and AMD GPUs have no Mosaic GPU."""
    if jax.default_backend() != "gpu":
        return True
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")
