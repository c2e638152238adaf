"""Converted models: a directory with config.json, tokenizer files and `params/`, one Orbax checkpoint of the
family's parameter tree (written by `python -m checkpoints_convert`).

The tree is flat, {dotted parameter path: array} (`layers.3.mlp.up_proj.kernel`), the same names the rule
tables target, so a checkpoint does not depend on how NNX nests modules. Restoring reads each parameter
straight into its target sharding (Orbax/tensorstore read only the slices a device owns), so no host ever
holds a whole model; without a mesh every parameter lands on the default device.

A model converted with `--quantize` keeps its packed weights as their parts (`<path>.codes`, `.scale` [,
`.offset`]) and records, in `packing.json` beside config.json, the `quantize` it was converted with and the
Scheme of every packed parameter: the module cannot be rebuilt from config.json alone (which weights are
packed depends on the source, e.g. a GGUF's tensor types), so `jaxspec.load(OUT)` rebuilds it from this plan.
`packing.json` also records the float dtype the parameters were written in (`"dtype"`, see `read_dtype`);
directories converted before it was recorded have no such field (or no packing.json at all).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import jax
from flax import nnx
from jax.sharding import Sharding

from jaxspec.checkpoint.core import WeightsError
from jaxspec.checkpoint.packed import Scheme

PARAMS_DIR = "params"
PACKING_FILE = "packing.json"


def param_key(path: tuple) -> str:
    """An NNX state path ('layers', 3, 'mlp', 'up_proj', 'kernel') -> 'layers.3.mlp.up_proj.kernel'."""
    return ".".join(str(p) for p in path)


def is_converted(model_dir: Path) -> bool:
    """Whether `model_dir` holds a converted (Orbax) model rather than HF safetensors."""
    return (Path(model_dir) / PARAMS_DIR).is_dir()


def write_packing(model_dir: Path, quantize: str | None, plan: dict[str, Scheme], dtype: str | None = None) -> None:
    """Record how a converted model is packed: `quantize` (None: not packed), {parameter path: Scheme fields},
    and the dtype ("float32" or "bfloat16") its float parameters were written in."""
    schemes = {path: dataclasses.asdict(scheme) for path, scheme in sorted(plan.items())}
    record = {"quantize": quantize, "schemes": schemes} | ({} if dtype is None else {"dtype": dtype})
    (Path(model_dir) / PACKING_FILE).write_text(json.dumps(record, indent=1))


def read_packing(model_dir: Path) -> tuple[str | None, dict[str, Scheme]]:
    """(quantize, plan) recorded by `write_packing`; (None, {}) for a model converted without packing."""
    f = Path(model_dir) / PACKING_FILE
    if not f.is_file():
        return None, {}
    try:
        d = json.loads(f.read_text())
        return d["quantize"], {path: Scheme(**fields) for path, fields in d["schemes"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # not JSON, or not what write_packing writes
        raise WeightsError(f"{f} is damaged ({e!r}); convert the model again") from e


def read_dtype(model_dir: Path) -> str | None:
    """The dtype ("float32" or "bfloat16") a converted model's float parameters were written in, as recorded
    by `write_packing`; None for a directory converted before it was recorded (restore it as before)."""
    f = Path(model_dir) / PACKING_FILE
    if not f.is_file():
        return None
    try:
        d = json.loads(f.read_text())
        dtype = d.get("dtype")
    except (ValueError, AttributeError) as e:
        raise WeightsError(f"{f} is damaged ({e!r}); convert the model again") from e
    if dtype not in (None, "float32", "bfloat16"):
        raise WeightsError(f"{f} is damaged (dtype {dtype!r}); convert the model again")
    return dtype


def restore_params(module_ctor: Callable[[], nnx.Module], model_dir: Path,
                   sharding_of: Callable[[nnx.Variable], Sharding]) -> nnx.Module:
    """Build `module_ctor()` abstractly and restore every parameter from `<model_dir>/params` into
    `sharding_of(variable)`, cast to the module's dtype. WeightsError if the checkpoint lacks a parameter or
    holds one the module does not have, or a shape differs (the config and the checkpoint disagree)."""
    import orbax.checkpoint.experimental.v1 as ocp

    graphdef, state = nnx.split(nnx.eval_shape(module_ctor))
    flat = dict(nnx.to_flat_state(state))
    want = {param_key(k): v for k, v in flat.items()}
    params_dir = Path(model_dir) / PARAMS_DIR
    try:
        stored = ocp.metadata(params_dir).metadata
    except Exception as e:  # orbax raises several types for a damaged or unfinished directory
        raise WeightsError(f"{params_dir} is not a complete Orbax checkpoint ({e}); convert the model again") from e
    _check_same_tree(want, {k: tuple(m.shape) for k, m in stored.items()}, params_dir)
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding_of(v)) for k, v in want.items()}
    restored = ocp.load(params_dir, target)
    for key, var in flat.items():
        var.set_value(restored[param_key(key)])
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _check_same_tree(want: dict, stored: dict, where: Path) -> None:
    missing, unexpected = sorted(want.keys() - stored.keys()), sorted(stored.keys() - want.keys())
    if missing or unexpected:
        raise WeightsError(f"{where} does not fit config.json: missing {len(missing)} parameters {missing[:3]}, "
                           f"unexpected {len(unexpected)} {unexpected[:3]}; convert the model again")
    for k, v in want.items():
        if tuple(v.shape) != stored[k]:
            raise WeightsError(f"parameter {k} is {stored[k]} in {where}, the config implies {tuple(v.shape)}")
