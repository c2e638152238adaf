"""Memory planner: will a target fit on a tp-way mesh at a given context and tree budget?

    python -m jaxspec.plan MODEL_OR_CONFIG --tp 8 --budget 64 --max-len 32768 [--batch 1] [--dtype bfloat16]
                           [--hbm-gib 141] [--quantize int8|int4]

Nothing is allocated and no device is needed: the module is built abstractly (`nnx.eval_shape`) and its cache
with `jax.eval_shape(init_cache)`; every parameter and cache buffer is divided by its shard count under the
family's sharding rules on a `jax.sharding.AbstractMesh` of dp = 1 x tp (so tp = 8 plans on a CPU laptop). A
dimension the rules leave replicated (MLA latents) counts whole on every device; KV heads that tp does not
divide count kv_heads / gcd(kv_heads, tp) each (sharding.py).

Per device:
  * weights: each parameter's bytes / its shard count. Packed weights: a checkpoint's compressed-tensors INT4
    `quantization_config` packs the routed experts (Kimi K2: int4 codes + one bf16 scale per 32 inputs);
    `--quantize int8` (1 byte + a bf16 scale per output column) and `int4` (a bf16 scale per 32 inputs) pack
    what `jaxspec.load(quantize=)` packs (`quant.linear_plan`: every projection, the routed experts, the
    embedding and an untied LM head; not norms or routers). A directory converted with `checkpoints_convert
    --quantize` counts as its `packing.json` records (it cannot be repacked, so another `--quantize` is
    refused, as `jaxspec.load` refuses it). Counted as jaxspec keeps them (models/quant.py): int8 one byte
    per code, int4 two codes per byte, scales (and offsets) in the model's dtype.
  * caches: init_cache(batch, max_len) as jaxspec allocates it (sliding-window layers keep a ring of their window).
  * verify scratch for N = 1 + budget tree nodes, an estimate of what one verify forward holds at its peak:
    float32 logits [B, N, V] (replicated: acceptance reads the whole row) + one layer's activations
    (hidden [B, N, H] x 4, the MLP's [B, N, F / tp] x 3, float32 attention scores [B, heads / tp, N, max_len + N])
    + for GDN layers what verify keeps for the commit, per layer k [N, Hk, dk] and u [N, Hv, dv] float32, decay
    [N, Hv] float32 and the conv input [N, C] (docs/design/hybrid-gdn.md: 3.3 MiB per layer at budget 64 on
    Qwen3.6-27B, unsharded) and inside one layer four float32 [N, N, Hv / tp] arrays.
XLA's own workspace and fragmentation come on top: keep a few GiB of headroom (the verdict needs 5%).
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from jaxspec.checkpoint import WeightsError, read_gguf
from jaxspec.checkpoint.compressed_tensors import pack_quantized_group_size
from jaxspec.checkpoint.orbax import is_converted, read_packing
from jaxspec.config import ConfigError, read_config_json
from jaxspec.model import DTYPES
from jaxspec.models import quant
from jaxspec.models.registry import config_from_dict, family_of
from jaxspec.models.registry import layout as registry_layout
from jaxspec.sharding import MESH_AXES

GIB = 1 << 30
HEADROOM = 0.05  # of HBM, for XLA workspace and fragmentation


@dataclass(frozen=True)
class Plan:
    """Per-device bytes of one configuration, and the inputs that produced them."""

    model: str
    tp: int
    budget: int
    max_len: int
    batch: int
    weights: int
    cache: int
    scratch: int
    hbm: int
    packing: str

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.scratch

    @property
    def fits(self) -> bool:
        return self.total <= self.hbm * (1 - HEADROOM)


def read_config(path) -> dict:
    """A model directory, a config.json path, or a .gguf file -> the HF config dict."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":

        return read_gguf(path)[0]
    return read_config_json(path / "config.json" if path.is_dir() else path)


def plan_path(path, *, quantize: str | None = None, **kw) -> Plan:
    """`plan` of a model directory, config.json or .gguf. A directory converted by `checkpoints_convert` counts
    as its packing.json records; as `jaxspec.load` does, it refuses a `quantize` other than the recorded one
    (repacking needs the float source)."""
    path = Path(path)
    if not (path.is_dir() and is_converted(path)):
        return plan(read_config(path), quantize=quantize, name=path.stem, **kw)
    converted = read_packing(path)
    if quantize not in (None, converted[0]):
        how = f"--quantize {converted[0]}" if converted[0] else "no --quantize"
        raise ValueError(f"{path} is a converted checkpoint, counted as converted ({how}); --quantize {quantize} "
                         "applies to HF directories and .gguf files (convert from the source instead)")
    return plan(read_config(path), converted=converted, name=path.stem, **kw)


def plan(config: dict, *, tp: int = 8, budget: int = 64, max_len: int = 32768, batch: int = 1, dtype: str = "bfloat16",
         hbm_gib: float = 141.0, quantize: str | None = None, converted: tuple[str | None, dict] | None = None,
         name: str = "") -> Plan:
    """Per-device weights, caches and verify scratch of `config` (a HF config dict) on dp = 1 x tp devices.
    converted: (quantize, plan) recorded in a converted directory (`orbax.read_packing`), which replaces the
    `quantize` what-if (`plan_path` refuses a different `quantize`)."""
    for what, n in (("tp", tp), ("budget", budget), ("max-len", max_len), ("batch", batch)):
        if n < 1:
            raise ValueError(f"--{what} must be a positive integer, got {n}")
    if dtype not in DTYPES:
        raise ValueError(f"unsupported --dtype {dtype!r}; use one of: {', '.join(DTYPES)}")
    if quantize not in (None, "int8", "int4"):
        raise ValueError(f"unsupported --quantize {quantize!r}; use int8 or int4")
    cfg = config_from_dict(config)
    layout = registry_layout(cfg, AbstractMesh((1, tp), MESH_AXES, axis_types=(AxisType.Auto,) * 2))
    shape_only = {k: v for k, v in config.items() if k != "quantization_config"}  # packing is counted here
    module = _abstract_module(json.dumps(shape_only, sort_keys=True), dtype)
    schemes, packing = _schemes(module, config, quantize, converted)

    weights = 0
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        key = ".".join(str(p) for p in path)
        nbytes = (_packed_bytes(var.shape, schemes[key], var.dtype) if key in schemes
                  else _nbytes(var.shape, var.dtype))
        weights += nbytes // layout.shards(var.get_metadata()["out_sharding"], var.shape)
    cache = jax.eval_shape(lambda: module.init_cache(batch, max_len))
    specs = jax.tree.leaves(cache.logical_axes(), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    cache_bytes = sum(_nbytes(x.shape, x.dtype) // layout.shards(tuple(s), x.shape)
                      for s, x in zip(specs, jax.tree.leaves(cache), strict=True))
    return Plan(name, tp, budget, max_len, batch, weights, cache_bytes,
                sum(verify_scratch(cfg, tp, budget, max_len, batch, np.dtype(DTYPES[dtype]).itemsize).values()),
                int(hbm_gib * GIB), packing)


@functools.lru_cache(maxsize=4)
def _abstract_module(config_json: str, dtype: str) -> nnx.Module:
    """The module built abstractly (slow for a 1T-parameter config: one cached per config and dtype)."""
    cfg = config_from_dict(json.loads(config_json))
    return nnx.eval_shape(lambda: family_of(cfg.model_type).module(cfg, dtype=DTYPES[dtype], rngs=nnx.Rngs(0)))


def verify_scratch(cfg, tp: int, budget: int, max_len: int, batch: int, itemsize: int) -> dict[str, int]:
    """The estimate of the module docstring, bytes per device by part: logits, one layer, GDN."""
    N, B, H, V = 1 + budget, batch, cfg.hidden_size, cfg.vocab_size
    heads = getattr(cfg, "num_heads", 1)
    ffn = max(getattr(cfg, "intermediate_size", 0) or 0, getattr(cfg, "moe_intermediate_size", 0) or 0)
    parts = {"logits": B * N * V * 4,  # [B, N, V] float32
             "layer": (B * N * H * itemsize * 4  # hidden [B, N, H] x 4
                       + B * N * -(-ffn // tp) * itemsize * 3  # MLP [B, N, F / tp] x 3
                       + B * -(-heads // tp) * N * (max_len + N) * 4),  # scores [B, heads / tp, N, max_len + N]
             "gdn": 0}
    n_gdn = sum(t == "linear_attention" for t in getattr(cfg, "layer_types", ()))
    if n_gdn:
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv = 2 * hk * dk + hv * dv  # conv channels [q | k | v]
        kept = B * N * (hk * dk * 4 + hv * dv * 4 + hv * 4 + conv * itemsize)  # k, u, decay, conv input per layer
        parts["gdn"] = n_gdn * kept // tp + 4 * B * N * N * -(-hv // tp) * 4  # + four [N, N, Hv / tp] float32
    return parts


def _quantization_config(config: dict) -> dict | None:
    """quantization_config at the top level or under text_config (Kimi K2.5 / K2.6 nest it)."""
    return config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")


def _schemes(module: nnx.Module, config: dict, quantize: str | None,
             converted: tuple[str | None, dict] | None) -> tuple[dict[str, quant.Scheme], str]:
    """(parameter path -> Scheme, description) of what jaxspec keeps packed. A converted directory: its recorded
    plan (which weights are packed depends on the source, e.g. a GGUF's tensor types, not on config.json).
    Otherwise what `jaxspec.load(quantize=)` packs: the on-the-fly plan, with a compressed-tensors checkpoint's
    routed experts kept as stored under any quantize."""
    if converted is not None:
        return converted[1], f"{converted[0]} (converted)" if converted[0] else "none"
    group = pack_quantized_group_size(_quantization_config(config))
    schemes = quant.linear_plan(module, quant.scheme_of(quantize)) if quantize else {}
    if group:  # stacked routed experts [E, in, out]; shared experts and routers are not
        keys = (".".join(str(p) for p in path) for path, _ in nnx.to_flat_state(nnx.state(module, nnx.Param)))
        schemes |= {key: quant.Scheme(4, group) for key in keys if ".experts." in key}
    if quantize:
        return schemes, f"{quantize} (what-if)"
    return schemes, f"routed experts int4 / {group}" if group else "none"


def _packed_bytes(shape, scheme: quant.Scheme, dtype) -> int:
    """Bytes of a parameter of float shape `shape` packed as `scheme`, as jaxspec keeps it (models/quant.py):
    int8 one byte per code, int4 half a byte, and a scale (and offset) in `dtype` per group of inputs, or per
    output column when the group is the whole input (int8). A kernel or stacked expert is [..., in, out]
    (transposed when packed), an embedding [out, in]."""
    n = int(np.prod(shape))
    groups = n // (scheme.group or shape[-2 if scheme.transposed else -1])
    return n * scheme.bits // 8 + np.dtype(dtype).itemsize * groups * (2 if scheme.offset else 1)


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape)) * np.dtype(dtype).itemsize


def table(plans: list[Plan]) -> str:
    """A Markdown table, GiB per device."""
    rows = ["| model | tp | packing | weights | caches | verify scratch | total | HBM | fits |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    g = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    for p in plans:
        rows.append(f"| {p.model} | {p.tp} | {p.packing} | {g(p.weights)} | {g(p.cache)} | {g(p.scratch)} | "
                    f"{g(p.total)} | {g(p.hbm)} | {'yes' if p.fits else 'no'} |")
    return "\n".join(rows)


def out_of_memory(e: BaseException) -> str | None:
    """One line for a device allocation that failed (XLA's RESOURCE_EXHAUSTED), naming what to change; None for
    any other error. The CLI and the server print it instead of XLA's trace."""
    text = str(e).strip()
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    return (f"out of device memory ({text.splitlines()[0]}); `python -m jaxspec.plan MODEL --tp N --max-len L "
            "--batch B` shows what fits each device: shard over more devices (--tp), pack the weights (--quantize "
            "int8 or int4), or give less context or fewer rows (--max-new-tokens, --max-model-len, --max-batch)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxspec.plan", description=__doc__.splitlines()[0])
    ap.add_argument("model", metavar="MODEL_OR_CONFIG", nargs="+", help="model directory, config.json or .gguf")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--budget", type=int, default=64, help="tree budget (verify runs 1 + budget nodes)")
    ap.add_argument("--max-len", type=int, default=32768, help="cache length in tokens (prompt + output)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hbm-gib", type=float, default=141.0, help="memory per device (H200: 141)")
    ap.add_argument("--quantize", default=None, help="what-if packing, as jaxspec.load(quantize=) packs: int8 or int4")
    args = ap.parse_args(argv)
    try:
        plans = [plan_path(m, tp=args.tp, budget=args.budget, max_len=args.max_len, batch=args.batch,
                           dtype=args.dtype, hbm_gib=args.hbm_gib, quantize=args.quantize) for m in args.model]
    except (ConfigError, WeightsError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"per device, GiB; budget {args.budget} (N = {args.budget + 1} verify nodes), max-len {args.max_len}, "
          f"batch {args.batch}, {args.dtype}")
    print(table(plans))
    return 0 if all(p.fits for p in plans) else 1


if __name__ == "__main__":
    sys.exit(main())
