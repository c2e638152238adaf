"""HF safetensors / GGUF / compressed-tensors INT4 -> a converted jaxspec model directory (Orbax parameters).

The tensors come through jaxspec's own loading core: the same readers and the family's rule table
(`load_params`), whose `place` hook here writes each complete, cast parameter into the Orbax checkpoint
and keeps only its abstract shape, so the host holds one checkpoint tensor (or one stacked expert
parameter being filled) at a time. Every name, shape and dtype check of `jaxspec.load` applies unchanged.

Orbax saves a whole pytree per call; to write parameter by parameter into *one* checkpoint this uses Orbax's
partial saving (`orbax.checkpoint.experimental.v1.partial`): each `partial.save` adds one parameter (its own
pending directory with an OCDBT store) and `partial.finalize` merges them into one pytree checkpoint with one
OCDBT manifest, which `ocp.load` restores into any sharding.

`--quantize int8|int4|native` packs the parameters exactly as `jaxspec.load(SRC, quantize=...)` would (the
same source reading and module builder, `read_source` and `module_builder`): the packed parts (int8 codes,
scales [, offsets]) are written as they are, and `packing.json` records the plan, from which `jaxspec.load(OUT)`
rebuilds the packed module without being told.

Everything is written into a hidden temporary folder beside OUT and renamed to OUT at the end, so an
interrupted or failed conversion leaves no OUT (and a failed one no temporary folder either).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxspec.checkpoint import load_params
from jaxspec.checkpoint.orbax import PARAMS_DIR, is_converted, write_packing
from jaxspec.model import DTYPES, _tokenizer, module_builder, read_source
from jaxspec.models.quant import QUANTIZE
from jaxspec.models.registry import config_from_dict, family_of

# Files of a HF directory that travel with the weights (config.json is rewritten, see `_hf_config`).
_TOKENIZER_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
                    "chat_template.json")
# Orbax stores each array in chunks of at most this many bytes, so a restore into a mesh reads only the chunks
# under each device's shard rather than whole parameters.
CHUNK_BYTES = 8 << 20


class ConvertError(ValueError):
    """A conversion that cannot start (bad SRC, OUT, dtype, quantize); the message says what to do."""


def convert(src, out, dtype: str = "bfloat16", *, quantize: str | None = None, force: bool = False,
            progress: bool = True) -> Path:
    """Convert SRC (HF directory or .gguf file) into OUT, packed as `jaxspec.load(SRC, quantize=quantize)`
    would hold it; returns OUT. Raises ConvertError, ConfigError or WeightsError (missing, unexpected or
    misshapen tensors) with nothing left behind."""
    src, out = Path(src).absolute(), Path(out).absolute()  # orbax wants absolute paths
    if dtype not in DTYPES:
        raise ConvertError(f"unsupported --dtype {dtype!r}; use one of: {', '.join(DTYPES)}")
    if quantize not in QUANTIZE:
        raise ConvertError(f"unsupported --quantize {quantize!r}; use int8, int4 or native, or leave it out")
    if not src.exists():
        raise ConvertError(f"SRC {src} does not exist; pass a HF model directory or a .gguf file")
    if out.exists() and not force:
        raise ConvertError(f"OUT {out} already exists; pass --force to replace it")
    if out.resolve() in (src.resolve(), src.resolve().parent) or src.resolve().is_relative_to(out.resolve()):
        raise ConvertError(f"OUT {out} would replace SRC {src}; choose another OUT")
    if not out.parent.is_dir():
        raise ConvertError(f"the folder of OUT, {out.parent}, does not exist; create it first")
    config, tensors, stored, write_tokenizer = _open(src, quantize)
    cfg = config_from_dict(config)
    ctor, pack, plan = module_builder(cfg, DTYPES[dtype], quantize, stored)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".converting", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would make OUT private
    try:
        with _ParamWriter(tmp / PARAMS_DIR, ctor, progress) as writer:
            load_params(ctor, tensors, family_of(cfg.model_type).hf_rules, pack=pack, place=writer)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if quantize is not None:
            write_packing(tmp, quantize, plan)
        write_tokenizer(tmp)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _open(src: Path, quantize: str | None):
    """(HF config dict as OUT will carry it, tensor stream, HF name -> Scheme of the tensors that arrive
    packed, tokenizer writer) for a HF directory or a .gguf, read as `jaxspec.load(src, quantize=)` reads it."""
    if src.is_file() and src.suffix == ".gguf":
        config, tensors, stored = read_source(src, quantize)

        def write_tokenizer(dst: Path):
            import gguf

            if "tokenizer.ggml.tokens" in gguf.GGUFReader(str(src)).fields:  # a GGUF may ship no vocabulary
                _tokenizer(src.parent, gguf_file=src.name).save_pretrained(str(dst))

        return config, tensors, stored, write_tokenizer
    if not src.is_dir():
        raise ConvertError(f"SRC {src} is neither a model directory nor a .gguf file")
    if is_converted(src):
        raise ConvertError(f"SRC {src} is already converted; jaxspec.load reads it as it is")
    config, tensors, stored = read_source(src, quantize)
    if not stored:  # dequantised (float, or packed anew by --quantize): OUT must not claim the source's packing
        config = {k: v for k, v in config.items() if k != "quantization_config"}

    def write_tokenizer(dst: Path):
        for name in _TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, dst / name)

    return config, tensors, stored, write_tokenizer


class _ParamWriter:
    """The `place` hook of `load_params`: writes each complete parameter into one Orbax checkpoint (a partial
    save per parameter, merged by `finalize` on a clean exit) and returns its abstract shape, so nothing
    stays on the host; a tqdm bar on stderr counts the bytes written."""

    def __init__(self, path: Path, ctor, progress: bool):
        import orbax.checkpoint.experimental.v1 as ocp
        from tqdm import tqdm

        self.ocp, self.path = ocp, path
        self.ctx = ocp.Context()
        self.ctx.array.saving.storage_options.chunk_byte_size = CHUNK_BYTES
        # partial.save blocks until written and nothing mutates the array meanwhile: no defensive host copy
        self.ctx.memory_options.deepcopy_host_arrays = False
        total = sum(v.size * np.dtype(v.dtype).itemsize for v in jax.tree.leaves(nnx.state(nnx.eval_shape(ctor))))
        self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not progress)

    def __enter__(self):
        return self

    def __call__(self, arr: np.ndarray, var, path: str) -> jax.ShapeDtypeStruct:
        with self.ctx:
            self.ocp.partial.save(self.path, {path: arr})
        self.bar.update(arr.nbytes)
        return jax.ShapeDtypeStruct(arr.shape, arr.dtype)

    def __exit__(self, kind, *_):
        self.bar.close()
        if kind is None:
            with self.ctx:
                self.ocp.partial.finalize(self.path)


def _replace(tmp: Path, out: Path) -> None:
    """Rename the finished folder to OUT; an old OUT (--force) is moved aside first and removed after."""
    old = None
    if out.exists() or out.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
