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

The float parameters keep the source's dtype unless `dtype` is given (`source_dtype`), and `packing.json`
records the dtype written.

Everything is written into a hidden temporary folder beside OUT, `.OUT.<pid>.<random>.converting`, and
renamed to OUT at the end, so a failed conversion leaves nothing and an interrupted one no OUT. The folder
holds a `.lock` file its process keeps locked (flock) while it works: a folder whose lock is free (or which has
no lock yet and whose pid is gone) was left by a killed conversion, and the next conversion into OUT removes
it; one still locked means another conversion into OUT is running, and the new one is refused. Under
`stop_on_signals` (the CLI) SIGINT / SIGTERM are recorded and acted on between tensors (`Interrupted`).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxspec.checkpoint import load_params, safetensors_files
from jaxspec.checkpoint.fp8 import fp8_block_size
from jaxspec.checkpoint.orbax import PARAMS_DIR, is_converted, write_packing
from jaxspec.checkpoint.safetensors import check_depth
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
# The lock file inside a temporary folder (see the module docstring); removed before the folder becomes OUT.
LOCK = ".lock"


class ConvertError(ValueError):
    """A conversion that cannot start (bad SRC, OUT, dtype, quantize); the message says what to do."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived during a conversion under `stop_on_signals`; raised at the next tensor, after
    which the temporary folder is removed."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_signals: list[int] = []  # received under `stop_on_signals`, not yet acted on


@contextlib.contextmanager
def stop_on_signals(signums=(signal.SIGINT, signal.SIGTERM)):
    """While converting (main thread only): the first SIGINT / SIGTERM is only recorded, and the conversion
    raises `Interrupted` at its next tensor, from its own code, where no library can swallow it (an exception
    raised by a handler inside a callback from C, e.g. JAX's or a destructor, is printed and ignored); a second
    signal ends the process at once (its temporary folder is then removed by the next conversion into OUT)."""
    def record(signum, _frame):
        _signals.append(signum)
        for s in signums:
            signal.signal(s, signal.SIG_DFL)

    if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
        yield
        return
    old = {s: signal.getsignal(s) for s in signums}
    _signals.clear()
    for s in signums:
        signal.signal(s, record)
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        _signals.clear()


def _check_signals() -> None:
    if _signals:
        raise Interrupted(_signals[0])


def convert(src, out, dtype: str | None = None, *, quantize: str | None = None, force: bool = False,
            progress: bool = True) -> Path:
    """Convert SRC (HF directory or .gguf file) into OUT, packed as `jaxspec.load(SRC, quantize=quantize)`
    would hold it, its float parameters in `dtype` ("float32" or "bfloat16"; None: the source's, see
    `source_dtype`, recorded in packing.json); returns OUT. Raises ConvertError, ConfigError or WeightsError
    (missing, unexpected or misshapen tensors) with nothing left behind."""
    src, out = Path(src).absolute(), Path(out).absolute()  # orbax wants absolute paths
    if dtype is not None and dtype not in DTYPES:
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
    _clear_stale(out)
    config, tensors, stored, write_tokenizer = _open(src, quantize)
    dtype = dtype or source_dtype(src, quantize)
    cfg = config_from_dict(config)
    if src.is_dir():
        check_depth(cfg.num_layers, src)  # before the module is built, a layer at a time (as jaxspec.load)
    ctor, pack, plan = module_builder(cfg, DTYPES[dtype], quantize, stored)

    tmp, lock = _temporary(out, ".converting")
    tmp.chmod(0o755)  # mkdtemp's 0700 would make OUT private
    try:
        _check_signals()
        with _ParamWriter(tmp / PARAMS_DIR, ctor, progress) as writer:
            load_params(ctor, _checked(tensors), family_of(cfg.model_type).hf_rules, pack=pack, place=writer)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        write_packing(tmp, quantize, plan, dtype)
        write_tokenizer(tmp)
        _check_signals()
        (tmp / LOCK).unlink()  # the folder stays locked through `lock` until it is OUT
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(lock)
    return out


def source_dtype(src: Path, quantize: str | None) -> str:
    """The dtype a conversion keeps by default: "bfloat16" when every floating tensor of a HF directory is
    stored in bfloat16 (and none is dequantised: FP8 and compressed-tensors INT4 weights dequantise to
    float32, unless `quantize` keeps the INT4 packed), "float32" otherwise (float16 widens to float32 exactly);
    a GGUF's float tensors arrive as float32. Only the safetensors headers are read; a header that cannot be
    read counts as float32 (the conversion then reports it)."""
    if src.is_file():
        return "float32"
    floats = set()
    try:
        q = json.loads((src / "config.json").read_text()).get("quantization_config")
        if q and (quantize is None or fp8_block_size(q) is not None):
            return "float32"
        for f in safetensors_files(src):
            with open(f, "rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
            floats |= {t["dtype"] for k, t in header.items() if k != "__metadata__" and t["dtype"][0] in "FB"}
    except Exception:  # noqa: BLE001 - a damaged checkpoint is reported by the reader, with its own message
        return "float32"
    return "bfloat16" if floats == {"BF16"} else "float32"


def _checked(tensors):
    """The tensor stream, stopping with `Interrupted` between tensors once a signal was recorded."""
    for name, arr in tensors:
        _check_signals()
        yield name, arr
        del name, arr  # before the next tensor is read: one tensor alive at a time
    _check_signals()


def _temporary(out: Path, suffix: str) -> tuple[Path, int]:
    """A new hidden folder beside OUT, `.OUT.<pid>.<random><suffix>`, and the descriptor that holds its lock."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", suffix=suffix, dir=out.parent))
    try:
        fd = os.open(tmp / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else holds it
    return tmp, fd


def _clear_stale(out: Path) -> None:
    """Remove the temporary folders of conversions into OUT that were killed (SIGKILL, a crash, power loss):
    their lock is free, or they have none yet and their pid is gone. ConvertError naming the folder if a
    conversion into OUT is still running."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(\d+)\.[^.]*\.(converting|old)")
    for entry in os.scandir(out.parent):
        m = pattern.fullmatch(entry.name)
        if m is None or not entry.is_dir(follow_symlinks=False):
            continue
        folder, pid = Path(entry.path), int(m.group(1))
        try:
            fd = os.open(folder / LOCK, os.O_RDWR)
        except FileNotFoundError:  # created this instant, or finishing: its process decides
            fd = None
        except OSError:
            continue
        try:
            if fd is None:
                if _alive(pid):
                    continue
            else:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise ConvertError(f"another conversion into {out} is running (pid {pid}, writing {folder}); "
                                       "wait for it or stop it") from None
            shutil.rmtree(folder, ignore_errors=True)
            print(f"note: removed {folder}, left by an interrupted conversion (pid {pid})", file=sys.stderr)
        finally:
            if fd is not None:
                os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


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
        _check_signals()
        with self.ctx:
            self.ocp.partial.save(self.path, {path: arr})
        self.bar.update(arr.nbytes)
        _check_signals()
        return jax.ShapeDtypeStruct(arr.shape, arr.dtype)

    def __exit__(self, kind, *_):
        self.bar.close()
        if kind is None:
            _check_signals()
            with self.ctx:
                self.ocp.partial.finalize(self.path)


def _replace(tmp: Path, out: Path) -> None:
    """Rename the finished folder to OUT; an old OUT (--force) is moved aside first (into a locked temporary
    folder, so a kill here leaves nothing the next conversion does not remove) and removed after."""
    if not (out.exists() or out.is_symlink()):
        os.replace(tmp, out)
        return
    old, lock = _temporary(out, ".old")
    try:
        os.replace(out, old / out.name)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        os.close(lock)
