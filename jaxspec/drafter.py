"""The DFlash drafter handle: `load_drafter`, `init_drafter`, `Drafter.save` (z-lab's released layout)."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from jaxspec.checkpoint import DFLASH_ZLAB_RULES, WeightsError, load_params, read_safetensors, safetensors_files
from jaxspec.checkpoint.safetensors import check_depth
from jaxspec.config import (
    ConfigError,
    DrafterConfig,
    default_target_layer_ids,
    drafter_config_from_dict,
    read_config_json,
)
from jaxspec.kernels import plain, prepare, resolve
from jaxspec.model import Model, StaticDef
from jaxspec.models.dflash import DFlashDrafter
from jaxspec.sharding import Layout

MAX_BLOCK_SIZE = 64
ACCEPTANCE_FILE = "acceptance.json"  # beside the weights: {budget: acceptance length} (budget.py)
MAX_BUDGET = 1024  # the largest DDTree budget: generate's `budget` range [1, MAX_BUDGET] (jaxspec.api)


@dataclass(eq=False)
class Drafter:
    config: DrafterConfig
    graphdef: Any
    params: Any  # nnx.State of the DFlashDrafter, in the kernel backend's weight layout
    layout: Layout | None = None  # sharded over its target's mesh, by the "drafter" rules
    acceptance: dict[int, float] | None = None  # {budget: acceptance length} on held-out prompts (budget.py)
    kernels: str = "xla"  # the kernel backend, its target's (jaxspec.kernels)

    @functools.cached_property
    def jit_def(self) -> StaticDef:
        """The graphdef and kernel backend as the engine's static jit argument (hashed once per handle)."""
        return StaticDef(self.graphdef, self.kernels)

    @property
    def module(self) -> DFlashDrafter:
        return nnx.merge(self.graphdef, self.params)

    @staticmethod
    def from_module(module: DFlashDrafter, model: Model | None = None) -> "Drafter":
        """The handle for `module` as it is, on `model`'s kernel backend, placed on its mesh when the target is
        sharded."""
        graphdef, params = nnx.split(module)
        if model is None or model.layout is None:
            return Drafter(module.config, graphdef, params, kernels=resolve() if model is None else model.kernels)
        c = module.config
        layout = Layout.of("drafter", model.layout.mesh, {"q_heads": c.num_heads, "kv_heads": c.num_kv_heads})
        return Drafter(module.config, graphdef, layout.place_params(plain(params)), layout, kernels=model.kernels)

    def save(self, path, dtype: str = "float32") -> None:
        """Write config.json + model.safetensors (unprefixed z-lab names) atomically; dtype float32 or bfloat16."""
        import ml_dtypes
        from safetensors.numpy import save_file

        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"drafter save dtype must be float32 or bfloat16, got {dtype!r}")

        path = Path(path)
        tensors = {}
        for key, var in nnx.to_flat_state(plain(self.params)):
            name = ".".join(str(p) for p in key)
            arr = np.asarray(var[...], np.float32)
            if name.endswith(".kernel"):
                name, arr = name[: -len(".kernel")] + ".weight", arr.T
            tensors[name] = np.ascontiguousarray(arr.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else arr)
        if self.config.draft_vocab:
            tensors["draft_vocab"] = np.asarray(self.config.draft_vocab, np.int64)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-drafter-", dir=path.parent))
        try:
            (tmp / "config.json").write_text(json.dumps(self.config.to_hf_dict(), indent=2))
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            if self.acceptance:  # tied to the weights just written: a table of other weights is not read
                table = {"acceptance_length": {str(b): al for b, al in sorted(self.acceptance.items())},
                         "weights_sha256": weights_sha256(tmp)}
                (tmp / ACCEPTANCE_FILE).write_text(json.dumps(table, indent=2) + "\n")
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def weights_sha256(path) -> str:
    """The sha256 of a drafter dir's safetensors bytes (its model.safetensors, or its shards in index order):
    what acceptance.json's "weights_sha256" records, so a table measured with other weights is not used."""
    h = hashlib.sha256()
    for f in safetensors_files(Path(path)):
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def read_acceptance(path: Path) -> dict[int, float] | None:
    """A drafter dir's acceptance table {budget: acceptance length}, or None if it ships none.

    Every budget must be one `generate` accepts ([1, MAX_BUDGET]) and every acceptance length finite and
    within [1, 1 + budget]: a round of budget b commits at most its b drafted tokens and the target's bonus
    token. The table's tie to the weights ("weights_sha256") is checked by load_drafter."""
    f = Path(path) / ACCEPTANCE_FILE
    if not f.is_file():
        return None
    fix = "regenerate it with bench/spec.py --save-acceptance or delete it"
    try:
        table = {int(b): float(al) for b, al in json.loads(f.read_text())["acceptance_length"].items()}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
        raise ValueError(f"{f} is not an acceptance table ({e}); {fix}") from e
    if not table:
        raise ValueError(f"{f} holds no valid entries (budgets >= 1, acceptance lengths >= 1); {fix}")
    for b, al in sorted(table.items()):
        if not 1 <= b <= MAX_BUDGET:
            raise ValueError(f"{f} holds budget {b}, outside [1, {MAX_BUDGET}]; {fix}")
        if not (math.isfinite(al) and 1 <= al <= 1 + b):
            raise ValueError(f"{f} gives budget {b} the acceptance length {al}, outside [1, {1 + b}] (a round "
                             f"commits at most its budget's drafts and one more token); {fix}")
    return table


def _acceptance_for(path: Path) -> dict[int, float] | None:
    """read_acceptance, or None (with a warning) where the table records weights other than the dir's own."""
    table = read_acceptance(path)
    if table is None:
        return None
    f = path / ACCEPTANCE_FILE
    recorded = json.loads(f.read_text()).get("weights_sha256")
    if recorded is None:  # tables written before the field: still used
        return table
    actual = weights_sha256(path)
    if recorded != actual:
        logging.getLogger(__name__).warning(
            "jaxspec: ignoring %s: it was measured with other weights (weights_sha256 %s, the weights' is %s); "
            "budget='auto' keeps the default budget until it is regenerated with bench/spec.py --save-acceptance",
            f, str(recorded)[:16], actual[:16])
        return None
    return table


def check_fits(cfg: DrafterConfig, model: Model) -> None:
    """Raise a one-line error when a drafter cannot serve this target."""
    t = model.config
    if cfg.hidden_size != t.hidden_size:
        raise ConfigError(
            f"drafter hidden_size {cfg.hidden_size} does not match the target's {t.hidden_size}; "
            "use a drafter trained for this target (or jaxspec.init_drafter)"
        )
    if cfg.vocab_size != t.vocab_size:
        raise ConfigError(f"drafter vocab_size {cfg.vocab_size} does not match the target's {t.vocab_size}; "
                          "use a drafter trained for this target")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < t.num_layers]
    if bad:
        raise ConfigError(f"drafter target_layer_ids {list(cfg.target_layer_ids)} are out of range for a "
                          f"{t.num_layers}-layer target")
    if not 0 <= cfg.mask_token_id < t.vocab_size:
        raise ConfigError(f"drafter mask_token_id {cfg.mask_token_id} is outside the target vocabulary of "
                          f"{t.vocab_size}")
    if not 2 <= cfg.block_size <= MAX_BLOCK_SIZE:
        raise ConfigError(f"drafter block_size {cfg.block_size} must be in [2, {MAX_BLOCK_SIZE}]")
    v = np.asarray(cfg.draft_vocab, np.int64)
    if v.size and (v.min() < 0 or v.max() >= t.vocab_size or np.unique(v).size != v.size):
        raise ConfigError("drafter draft_vocab must hold distinct token ids below the target's vocab_size "
                          f"{t.vocab_size}")


def load_drafter(path, model: Model) -> Drafter:
    """Load a DFlash drafter directory (config.json with dflash_config + safetensors) for `model`."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"drafter {path} has no config.json; pass a DFlash drafter directory")
    d = read_config_json(cfg_file)  # a ConfigError for bad JSON, bad UTF-8 or no object
    cfg = drafter_config_from_dict(d)
    if d.get("draft_vocab_size"):
        cfg = dataclasses.replace(cfg, draft_vocab=_read_draft_vocab(path, int(d["draft_vocab_size"])))
    check_fits(cfg, model)
    check_depth(cfg.num_layers, path)  # before the module is built, a layer at a time
    dt = model.dtype
    module = load_params(lambda: DFlashDrafter(cfg, dtype=dt, rngs=nnx.Rngs(0)), read_safetensors(path),
                         DFLASH_ZLAB_RULES, what="drafter checkpoint")
    drafter = Drafter.from_module(module, model)  # in its target's weight layout, as its target
    return dataclasses.replace(drafter, params=prepare(drafter.params, drafter.kernels),
                               acceptance=_acceptance_for(path))


def _read_draft_vocab(path: Path, size: int) -> tuple[int, ...]:
    for name, arr in read_safetensors(path):
        if name == "draft_vocab":
            if arr.shape != (size,) or arr.dtype.kind not in "iu":
                raise WeightsError(f"drafter tensor draft_vocab has shape {arr.shape} and dtype {arr.dtype}; "
                                   f"config.json's draft_vocab_size implies integer ids of shape ({size},)")
            return tuple(int(i) for i in arr)
    raise WeightsError(f"drafter {path} sets draft_vocab_size but its safetensors lack the draft_vocab tensor; "
                       "re-export it")


def default_mask_token(model: Model) -> int:
    """A token id for the drafter's MASK slots: the embedding is the target's and frozen, so any row works
    as long as real text never contains it. Prefer the tokenizer's mask token, then the highest added
    special token that is neither BOS/EOS/PAD nor used by the chat template, else the last vocab row."""
    tok = model.tokenizer
    if tok is not None:
        if getattr(tok, "mask_token_id", None) is not None:
            return int(tok.mask_token_id)
        reserved = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id, *model.eos_token_ids}
        template = getattr(tok, "chat_template", None) or ""
        added = sorted(((i, s) for s, i in tok.get_added_vocab().items()), reverse=True)
        for i, s in added:
            if i not in reserved and s not in template and i < model.config.vocab_size:
                return int(i)
    return model.config.vocab_size - 1


def tap_layers(model: Model, num_taps: int) -> tuple[int, ...]:
    """The target layers a new drafter reads (DFlash's placement, kept in range for tiny targets)."""
    n = model.config.num_layers
    return tuple(min(max(i, 0), n - 1) for i in default_target_layer_ids(n, num_taps))


def init_drafter(model: Model, num_layers: int = 1, block_size: int = 16, seed: int = 0, *,
                 num_taps: int | None = None, target_layer_ids=None, mask_token_id: int | None = None,
                 draft_vocab=()) -> Drafter:
    """A randomly initialised drafter that fits `model` (tests, and the starting point of training).

    target_layer_ids: the target layers it reads; None: `num_taps` (default `num_layers`) of DFlash's placement.
    draft_vocab: the token ids it may propose (e.g. `jaxspec.train.data.frequent_tokens`); () for all.
    """
    t = model.config
    cfg = DrafterConfig(
        **model.family.drafter_geometry(t),
        hidden_size=t.hidden_size,
        num_layers=num_layers,
        vocab_size=t.vocab_size,
        block_size=block_size,
        mask_token_id=default_mask_token(model) if mask_token_id is None else mask_token_id,
        target_layer_ids=(tap_layers(model, num_taps or num_layers) if target_layer_ids is None
                          else tuple(int(i) for i in target_layer_ids)),
        num_target_layers=t.num_layers,
        layer_types=("full_attention",) * num_layers,
        draft_vocab=tuple(sorted(int(i) for i in draft_vocab)),
    )
    check_fits(cfg, model)
    return Drafter.from_module(DFlashDrafter(cfg, dtype=model.dtype, rngs=nnx.Rngs(seed)), model)


__all__ = ["Drafter", "load_drafter", "init_drafter", "WeightsError"]
