"""The user-facing model handle and `jaxspec.load`."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxspec.checkpoint import WeightsError, load_params, read_gguf, read_safetensors
from jaxspec.checkpoint import gguf_tokenizer as gguf_tok
from jaxspec.checkpoint.compressed_tensors import maybe_dequantize, packed_schemes
from jaxspec.checkpoint.core import rule_targets
from jaxspec.checkpoint.gguf import native_schemes
from jaxspec.checkpoint.orbax import is_converted, read_dtype, read_packing, restore_params
from jaxspec.checkpoint.safetensors import check_depth
from jaxspec.config import ConfigError, TargetConfig, read_config_json
from jaxspec.kernels import plain, prepare, resolve, use
from jaxspec.models import quant
from jaxspec.models.registry import Family, config_from_dict, family_of, load_config
from jaxspec.models.registry import layout as registry_layout
from jaxspec.segment import Segment
from jaxspec.sharding import Layout, place
from jaxspec.usercache import derived_from, keep_compiled

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def auto_dtype(mesh: Mesh | None = None) -> str:
    """dtype="auto": bfloat16 on accelerators (half the bytes per token; a 27B target in float32 does not fit one
    80 GB card), float32 on a CPU, where bfloat16 products run several times slower."""
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    return "float32" if platform == "cpu" else "bfloat16"


def parse_dtype(dtype) -> Any:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; use one of: {', '.join(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype).type


class StaticDef:
    """An NNX graphdef and the kernel backend it runs on, as a static jit argument hashed once.

    jit hashes its static arguments on every call, and a graphdef's hash walks the whole module tree: a
    noticeable part of every decode call's dispatch (bench/cpu/dispatch.py). The jitted engine steps take
    this holder, merge `.graphdef` and trace under `.kernels` (`jaxspec.kernels.use`)."""

    __slots__ = ("graphdef", "kernels", "_hash")

    def __init__(self, graphdef, kernels: str):
        self.graphdef, self.kernels, self._hash = graphdef, kernels, hash((graphdef, kernels))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, StaticDef) and self.kernels == other.kernels and (
            self.graphdef is other.graphdef or (self._hash == other._hash and self.graphdef == other.graphdef))


@dataclass(eq=False)
class Model:
    """A loaded target: config, parameters (as an NNX graphdef + state, ready for jit) and tokenizer."""

    config: TargetConfig
    graphdef: Any
    params: Any  # nnx.State of the family's module, in the kernel backend's weight layout (`kernels.prepare`)
    tokenizer: Any = None
    source: str = ""
    layout: Layout | None = None  # the mesh and sharding rules, None on one device
    kernels: str = "xla"  # the kernel backend its programs are traced on (jaxspec.kernels)

    @functools.cached_property
    def jit_def(self) -> StaticDef:
        """The graphdef and kernel backend as the engine's static jit argument (hashed once per handle)."""
        return StaticDef(self.graphdef, self.kernels)

    def plain_params(self):
        """The parameters as plain arrays, whatever the backend's layout (what sharding, quantising and
        saving take)."""
        return plain(self.params)

    @property
    def family(self) -> Family:
        return family_of(self.config.model_type)

    @property
    def module(self) -> nnx.Module:
        return nnx.merge(self.graphdef, self.params)

    @property
    def dtype(self):
        return self.module.embed_tokens.dtype

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = list(self.config.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None and tok_eos not in ids:
            ids.append(int(tok_eos))
        return tuple(ids)

    def logits(self, input_ids) -> np.ndarray:
        """Plain causal forward. input_ids [B, T] -> float32 numpy logits [B, T, V]."""
        ids = np.asarray(input_ids, np.int32)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"input_ids must be a non-empty [batch, length] array, got shape {ids.shape}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}); got {ids.min()}..{ids.max()}")
        return np.asarray(_causal_logits(self.jit_def, self.params, jnp.asarray(ids)))

    def with_config(self, config: TargetConfig) -> "Model":
        """The same weights under another config of the same shapes: a static switch that lives in the graphdef,
        such as a hybrid target's GDN tree mode (`gdn_mode`) or MLA's attention form (`absorb_max_tokens`)."""
        build = lambda: self.family.module(config, dtype=self.dtype, rngs=nnx.Rngs(0))  # noqa: E731
        return replace(self, config=config, graphdef=nnx.graphdef(nnx.eval_shape(build)))

    def on_mesh(self, mesh: Mesh) -> "Model":
        """The same model with its parameters sharded over `mesh` (jaxspec.make_mesh) by its family's rules."""
        layout = registry_layout(self.config, mesh)
        params = layout.place_params(self.plain_params())  # the rules split plain [in, out] kernels
        kernels = resolve(sharded=True) if self.kernels == "cpu" else self.kernels  # no custom calls on a mesh
        return replace(self, params=params, layout=layout, kernels=kernels)

    @staticmethod
    def from_module(module: nnx.Module, tokenizer=None, source: str = "", layout: Layout | None = None,
                    kernels: str = "auto") -> "Model":
        """The handle for `module` as it is; its programs run on `kernels` ("auto", "xla" or "gpu",
        `kernels.resolve`)."""
        graphdef, params = nnx.split(module)
        return Model(module.config, graphdef, params, tokenizer, source, layout,
                     resolve(kernels, sharded=layout is not None))


def encode_prompt(model: Model, prompt: str, chat: bool | None) -> list[int]:
    """A prompt's token ids: in the chat template's user turn when `chat` (None: when the tokenizer has one)."""
    tok = model.tokenizer
    if tok is None:
        raise ValueError("this model has no tokenizer; pass input_ids instead of a prompt")
    if chat is None:
        chat = bool(getattr(tok, "chat_template", None))
    if chat:
        if not getattr(tok, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; run without chat mode")
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return tok.encode(prompt)


@functools.partial(jax.jit, static_argnums=0)
def _causal_logits(jit_def: StaticDef, params, ids):
    with use(jit_def.kernels):
        m = nnx.merge(jit_def.graphdef, params)
        B, T = ids.shape
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        logits, _, _ = m(ids, Segment.causal(pos), m.init_cache(B, T))
        return logits


def random_model(config: TargetConfig, *, seed: int = 0, dtype="float32", tokenizer=None,
                 mesh: Mesh | None = None, kernels: str = "auto") -> Model:
    """A randomly initialised target of any registered family (tests, benchmarks on bigger shapes)."""
    module = family_of(config.model_type).module(config, dtype=parse_dtype(dtype), rngs=nnx.Rngs(seed))
    model = Model.from_module(module, tokenizer, source="random", kernels=kernels)
    return model if mesh is None else model.on_mesh(mesh)


def load(path, dtype="auto", *, mesh: Mesh | None = None, tokenizer: bool = True,
         quantize: str | None = None, kernels: str = "auto") -> Model:
    """Load a target from a HF directory (config.json + safetensors [+ index]), a .gguf file, or a directory
    converted by `python -m checkpoints_convert` (Orbax parameters).

    dtype: "float32" or "bfloat16" for the float weights; "auto" (or None): for a converted directory the dtype
    it was converted in, else bfloat16 on a GPU or TPU and float32 on a CPU (auto_dtype).
    mesh (jaxspec.make_mesh): each tensor goes straight into its shards as it is read.
    quantize: None keeps every weight float (`dtype`); "int8" (one scale per output channel) and "int4" (one
    scale per 32 inputs), both round-to-nearest symmetric, pack every projection, the stacked experts and the
    token embedding (tied LM head) as they load; routers and norms stay float. "native" keeps a GGUF's
    Q4_0 / Q4_1 / Q8_0 tensors as stored (other GGUF types load as float). A compressed-tensors INT4
    checkpoint (Kimi) keeps its packed weights as stored under any `quantize`, and dequantises them under
    None. A converted directory is restored as it was converted (`--quantize`, recorded beside its config);
    any other `quantize` is refused. See jaxspec/models/quant.py.
    kernels: "auto" runs the fastest kernels this machine has (jaxspec.kernels: native ones on one CPU device,
    with the weights in their layout; the GPU path on a GPU), "xla" the pure-JAX reference forms everywhere,
    "gpu" the GPU path's forms (attention that reads only the cache in use) on any platform.
    Compiled programs are kept in the user's cache for the next run (usercache.keep_compiled; opt out with
    JAXSPEC_COMPILATION_CACHE=0)."""
    quant.check_quantize(quantize)
    keep_compiled()  # before this process's first compile, which fixes whether it uses the cache
    backend = resolve(kernels, sharded=mesh is not None)
    path = Path(path)
    auto = dtype in (None, "auto")
    dt = parse_dtype(auto_dtype(mesh) if auto else dtype)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist; pass a HF model directory or a .gguf file")
    if path.is_file() and path.suffix == ".gguf":
        hf_cfg, tensors, stored = read_source(path, quantize)
        cfg = config_from_dict(hf_cfg)
        layout = _layout(cfg, mesh)
        module = _build(cfg, tensors, dt, layout, quantize, stored)
        tok = _tokenizer(path.parent, gguf_file=path.name) if tokenizer else None
    elif path.is_dir() and is_converted(path):  # python -m checkpoints_convert: Orbax, restored into the shards
        cfg = load_config(path)
        layout = _layout(cfg, mesh)
        if auto:  # the dtype it was converted in (float32 for directories that do not record one)
            dt = parse_dtype(read_dtype(path) or "float32")
        module = _restore(cfg, path, dt, layout, quantize)
        tok = _tokenizer(path) if tokenizer else None
    elif path.is_dir():
        cfg = load_config(path)  # config.json with generation_config.json's EOS ids
        check_depth(cfg.num_layers, path)  # before the module is built, a layer at a time
        layout = _layout(cfg, mesh)
        _, tensors, stored = read_source(path, quantize)
        module = _build(cfg, tensors, dt, layout, quantize, stored)
        tok = _tokenizer(path) if tokenizer else None
    else:
        raise ConfigError(f"{path} is neither a model directory nor a .gguf file")
    graphdef, params = nnx.split(module)
    return Model(module.config, graphdef, prepare(params, backend), tok, str(path), layout, backend)


def read_source(path: Path, quantize: str | None) -> tuple[dict, Iterable, dict[str, quant.Scheme]]:
    """(HF-style config dict, tensor stream, HF name -> Scheme of the tensors that arrive packed) of a .gguf
    file or a HF directory, read as `quantize` asks: "native" keeps a GGUF's Q4_0 / Q4_1 / Q8_0 blocks, and
    any `quantize` keeps a compressed-tensors checkpoint's INT4 packing. Shared with the converter, so a
    converted checkpoint holds exactly what `load(path, quantize=)` would."""
    if path.is_file() and path.suffix == ".gguf":
        hf_cfg, tensors = read_gguf(path, native=quantize == "native")
        return hf_cfg, tensors, native_schemes(path) if quantize == "native" else {}
    hf_cfg = read_config_json(path / "config.json")
    stored = packed_schemes(path) if quantize is not None else {}
    if quantize == "native" and not stored:
        raise ConfigError(f"quantize='native' keeps a checkpoint's own packing, and {path} has none "
                          "(no pack-quantized quantization_config); use quantize='int8' or 'int4'")
    return hf_cfg, maybe_dequantize(path, read_safetensors(path), keep_packed=quantize is not None), stored


def _restore(cfg: TargetConfig, path: Path, dtype, layout: Layout | None, quantize: str | None) -> nnx.Module:
    """A converted directory's module, packed as its recorded plan says, restored into the layout's shards.
    A `quantize` other than the one it was converted with is refused: repacking needs the float source."""
    converted_as, plan = read_packing(path)
    if quantize not in (None, converted_as):
        raise ValueError(f"{path} is a converted checkpoint, restored as stored (quantize={converted_as!r}); "
                         f"quantize={quantize!r} applies to HF directories and .gguf files (convert from the source "
                         "instead)")
    family = family_of(cfg.model_type)
    ctor = lambda: quant.pack_module(family.module(cfg, dtype=dtype, rngs=nnx.Rngs(0)), plan)  # noqa: E731
    return restore_params(ctor, path, lambda var: _sharding(layout, var))


def _layout(cfg: TargetConfig, mesh: Mesh | None) -> Layout | None:
    return None if mesh is None else registry_layout(cfg, mesh)


def _sharding(layout: Layout | None, var: nnx.Variable) -> jax.sharding.Sharding:
    """Where a parameter lives: its shards on the layout's mesh, or the default device."""
    if layout is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return layout.sharding(var.get_metadata()["out_sharding"], var.shape)


def quantize_model(model: Model, quantize: str) -> Model:
    """A copy of a float `model` with its weights packed on the fly ("int8" or "int4", as in `load`), on one
    device (load with `mesh=` and `quantize=` for a sharded packed model)."""
    quant.check_quantize(quantize)
    if quantize not in ("int8", "int4"):
        raise ValueError(f"quantize_model packs float weights: use 'int8' or 'int4', not {quantize!r}")
    module = nnx.merge(model.graphdef, model.plain_params())
    module = quant.pack_module(module, quant.linear_plan(module, quant.scheme_of(quantize)), fill=True)
    return Model.from_module(module, model.tokenizer, source=f"{model.source} ({quantize})")


def module_builder(cfg: TargetConfig, dtype, quantize: str | None = None, native: dict | None = None):
    """(ctor, pack, plan) for filling the family's module for `cfg` with `load_params`, packed where
    `quantize` asks: ctor builds the module (abstractly, inside `load_params`) with `Packed` parameters,
    pack(path, w) quantises a float tensor for packed parameter `path`, and plan, filled when ctor runs, maps
    each packed parameter path to its Scheme (what a converted checkpoint records to rebuild the module).
    native: HF tensor name -> Scheme of the tensors that arrive packed (they keep their own packing; with
    int8 / int4 the other weights are quantised on the fly)."""
    family = family_of(cfg.model_type)
    stored = {}
    for name, scheme in (native or {}).items():
        for target in rule_targets(name, family.hf_rules):  # an embedding table is [out, in] already; kernels
            stored[target] = dataclasses.replace(scheme, transposed=target != "embed_tokens")  # are transposed
    if quantize in ("int8", "int4"):
        plans = lambda m: quant.linear_plan(m, quant.scheme_of(quantize)) | stored  # noqa: E731
    else:
        plans = lambda m: stored  # noqa: E731
    plan: dict[str, quant.Scheme] = {}

    def ctor():
        m = family.module(cfg, dtype=dtype, rngs=nnx.Rngs(0))
        plan.update(plans(m))
        return quant.pack_module(m, plan)

    def pack(path: str, w: np.ndarray) -> quant.PackedTensor:
        """A float tensor (after its rule's transform) for packed parameter `path`, quantised to its scheme."""
        scheme = plan[path]
        return quant.quantize(np.swapaxes(w, -1, -2) if scheme.transposed else w, scheme)

    return ctor, pack, plan


def _build(cfg: TargetConfig, tensors, dtype, layout: Layout | None = None, quantize: str | None = None,
           native: dict | None = None) -> nnx.Module:
    """The family's module for `cfg` (with packed parameters where `quantize` asks, see `module_builder`),
    filled from `tensors` through the family's name table (straight into each parameter's shards when
    there is a layout)."""
    ctor, pack, _ = module_builder(cfg, dtype, quantize, native)

    def put(arr, var, path):  # straight into the parameter's shards
        return place(arr, layout.sharding(var.get_metadata()["out_sharding"], arr.shape))

    return load_params(ctor, tensors, family_of(cfg.model_type).hf_rules, pack=pack,
                       place=None if layout is None else put)


def _tokenizer(model_dir: Path, gguf_file: str | None = None):
    """transformers AutoTokenizer from the directory or the GGUF; None if the model ships none."""
    import logging

    import transformers

    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if gguf_file is None and not any((model_dir / f).exists() for f in files):
        return None
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        if gguf_file:
            return _gguf_tokenizer(model_dir / gguf_file)
        return transformers.AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # tokenizer files are optional; a broken one should not hide the weights
        raise WeightsError(f"cannot load the tokenizer from {model_dir}: {e}") from e


def _gguf_tokenizer(path: Path):
    """A GGUF's tokenizer, kept as tokenizer files in the cache directory after its first use.

    It is built without torch (`checkpoint.gguf_tokenizer`: gguf reads the vocabulary and merges, string by string,
    transformers' converter makes the tokenizer): seconds of every `python -m jaxspec.generate` with the
    bundled SmolLM2, where reading back its saved files is fast (docs/benchmarks/cpu.md). The copy is keyed by
    the file (path, size, modification time), the transformers version and the builder's source, written to a
    temporary name and renamed, and built again if it cannot be read."""
    import os
    import shutil

    import transformers

    saved = derived_from(path, "tokenizers", transformers.__version__, Path(gguf_tok.__file__).read_text())
    if saved.is_dir():
        try:
            return transformers.AutoTokenizer.from_pretrained(str(saved))
        except Exception:  # a damaged copy: build it again
            shutil.rmtree(saved, ignore_errors=True)
    tok = gguf_tok.gguf_tokenizer(path)
    tmp = saved.with_name(f"{saved.name}.tmp{os.getpid()}")
    try:
        tok.save_pretrained(str(tmp))
        tmp.replace(saved)
    except OSError:  # a read-only cache, or another process saved it first
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


__all__ = ["Model", "load", "quantize_model", "random_model", "WeightsError", "ConfigError"]
