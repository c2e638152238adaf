"""GGUF files (llama.cpp): metadata -> HF-style config dict, tensors -> HF names, per-architecture fixes as data.

Each supported GGUF architecture is a `GGUFArch` row: the HF model_type it becomes, where its tensor names
differ from the common llama.cpp -> HF mapping, and which tensors llama.cpp stored altered (and how to undo
it). The renamed tensors then go through the family's HF table like any safetensors checkpoint.

With `native=True` the block-quantised types Q4_0, Q4_1 and Q8_0 are not dequantised: each tensor is repacked
(`repack`: its bytes regrouped, no arithmetic on the weights) into a `PackedTensor`: codes as stored (Q8_0:
int8 [out, in]; Q4_0 / Q4_1: their nibbles, uint8 [out, in / 2]) and the blocks' float16 scales (and Q4_1's
mins) widened to float32, one per 32 inputs.
Every other type (F32/F16 norms, K-quants such as Q4_K / Q6_K, ...) is dequantised as before: the stated
fallback: `native_schemes` lists the tensors that stay packed, so the loader builds the rest as float.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np

from jaxspec.checkpoint.core import WeightsError
from jaxspec.checkpoint.packed import PackedTensor, Scheme
from jaxspec.usercache import derived_from

# llama.cpp tensor name (without .weight/.bias) -> HF name; None: not a parameter
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "rope_freqs": None,  # llama3 RoPE divisors: read into the config by gguf_config
}
# blk.{i}.<part> -> model.layers.{i}.<HF name>
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

Fix = Callable[[np.ndarray, dict], np.ndarray]  # (float32 tensor, HF config dict) -> tensor as HF stores it


@dataclass(frozen=True)
class GGUFArch:
    """model_type: the HF model_type; layer_names: overrides of _LAYER_NAMES, keyed by part (`ffn_norm`) or,
    for a tensor whose whole HF name differs (a `.scale` tensor, a parameter without `.weight`), by part and
    suffix (`ffn_gate_inp.scale`); top_names: additions to _TOP_NAMES; fixes: llama.cpp part name
    (`attn_q`, `output_norm`, ...) -> the function that undoes what the converter did to that tensor."""

    model_type: str
    layer_names: Mapping[str, str] = field(default_factory=dict)
    fixes: Mapping[str, Fix] = field(default_factory=dict)
    top_names: Mapping[str, str | None] = field(default_factory=dict)

    def hf_name(self, gguf_name: str) -> str | None:
        """llama.cpp tensor name -> HF name (None: not a parameter); WeightsError for an unknown one."""
        m = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+?)(\.weight|\.bias|\.scale)", gguf_name)
        if m is not None:
            i, part, suffix = m.groups()
            top = {**_TOP_NAMES, **self.top_names}
            if i is None and part in top and suffix != ".scale":
                return None if top[part] is None else top[part] + suffix
            if i is not None and part + suffix in self.layer_names:
                return f"model.layers.{i}.{self.layer_names[part + suffix]}"
            hf = self.layer_names.get(part, _LAYER_NAMES.get(part))
            if i is not None and hf is not None and suffix != ".scale":
                return f"model.layers.{i}.{hf}{suffix}"
        raise WeightsError(f"unexpected GGUF tensor {gguf_name}")

    def fix(self, gguf_name: str, arr: np.ndarray, cfg: dict) -> np.ndarray:
        part = re.sub(r"^blk\.\d+\.", "", gguf_name).rsplit(".", 1)[0]
        return self.fixes[part](arr, cfg) if part in self.fixes else arr


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's half-split layout).
    w: [n_head * head_dim, ...] (weight or bias), same shape back."""
    out, *rest = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _minus_one(w: np.ndarray, cfg: dict) -> np.ndarray:
    """llama.cpp stores Gemma's (1 + w) norm weights with the 1 folded in."""
    return w - 1.0


_GEMMA3_NORMS = ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm",
                 "output_norm")

# general.architecture -> how to read it
GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", fixes={
        "attn_q": lambda w, cfg: _unpermute(w, cfg["num_attention_heads"]),
        "attn_k": lambda w, cfg: _unpermute(w, cfg["num_key_value_heads"]),
    }),
    "qwen3": GGUFArch("qwen3"),
    # Llama's post-attention norm (ffn_norm) is Gemma's pre-feed-forward norm
    "gemma3": GGUFArch("gemma3_text", layer_names={"ffn_norm": "pre_feedforward_layernorm"},
                       fixes=dict.fromkeys(_GEMMA3_NORMS, _minus_one)),
    # Gemma 4's norms are plain w (stored as is); the router's scales travel as `.scale` tensors, the fused
    # experts and the layer scalar without HF's `.weight`; `rope_freqs` only marks the full layers'
    # unrotated pairs (read by _gemma4_config)
    "gemma4": GGUFArch("gemma4_text", layer_names={
        "ffn_norm": "pre_feedforward_layernorm", "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
        "post_ffw_norm_1": "post_feedforward_layernorm_1", "post_ffw_norm_2": "post_feedforward_layernorm_2",
        "ffn_gate_inp": "router.proj", "ffn_gate_inp.scale": "router.scale",
        "ffn_down_exps.scale": "router.per_expert_scale", "ffn_gate_up_exps.weight": "experts.gate_up_proj",
        "ffn_down_exps.weight": "experts.down_proj", "layer_output_scale.weight": "layer_scalar",
        "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection", "post_norm": "post_per_layer_input_norm",
    }, top_names={"per_layer_token_embd": "model.embed_tokens_per_layer",
                  "per_layer_model_proj": "model.per_layer_model_projection",
                  "per_layer_proj_norm": "model.per_layer_projection_norm"}),
}


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader) -> dict:
    """HF-style config dict from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise WeightsError(f"GGUF architecture {arch!r} is not supported; jaxspec reads: {', '.join(GGUF_ARCHS)}")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    n_vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    if arch == "gemma4":
        return _gemma4_config(reader, g, int(n_vocab))
    H, nH = g("embedding_length"), g("attention.head_count")
    head_dim = g("attention.key_length") or H // nH
    tied = "output.weight" not in {t.name for t in reader.tensors}
    d = dict(
        model_type=GGUF_ARCHS[arch].model_type,
        vocab_size=int(n_vocab),
        hidden_size=int(H),
        intermediate_size=int(g("feed_forward_length")),
        num_hidden_layers=int(g("block_count")),
        num_attention_heads=int(nH),
        num_key_value_heads=int(g("attention.head_count_kv", nH)),
        head_dim=int(head_dim),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(g("context_length", 4096)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        tie_word_embeddings=tied,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    if arch == "gemma3":
        d.update(
            sliding_window=int(g("attention.sliding_window", 512)),
            # llama.cpp's rule (GGUF has no key for it): the 27B (62 layers) scales by H / nH = 168, others by head_dim
            query_pre_attn_scalar=int(H) // int(nH) if int(g("block_count")) == 62 else int(head_dim),
            rope_local_base_freq=10000.0,
            hidden_activation="gelu_pytorch_tanh",
        )
    # llama.cpp writes linear scaling as metadata (for Gemma 3 it applies to the global layers only) ...
    scale, scale_type = g("rope.scaling.factor"), g("rope.scaling.type")
    if scale and float(scale) != 1.0:
        if scale_type not in (None, "linear"):
            raise WeightsError(f"GGUF rope scaling {scale_type!r} is not supported; jaxspec reads linear and "
                               "llama3 (rope_freqs) scaling")
        d["rope_scaling"] = {"rope_type": "linear", "factor": float(scale)}
    # ... and llama3 scaling as a `rope_freqs` tensor of per-frequency divisors (no metadata at all)
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        d["rope_freq_factors"] = np.asarray(rope_freqs.data, np.float32).ravel().tolist()
    return d


def _gemma4_config(reader, g, n_vocab: int) -> dict:
    """Gemma 4 metadata (llama.cpp's Gemma4Model converter) -> a gemma4_text config dict. Per-layer arrays give
    the layer types (`sliding_window_pattern`), the KV heads of each type (`head_count_kv`) and the MLP widths
    (double on the KV-shared layers); full layers without `attn_v` mean attention_k_eq_v; the `rope_freqs`
    divisors (1 for rotated pairs, 1e30 for the rest) give the full layers' partial_rotary_factor."""
    L = int(g("block_count"))
    swa = [bool(s) for s in g("attention.sliding_window_pattern")]
    per_layer = lambda v: [int(x) for x in v] if isinstance(v, list) else [int(v)] * L  # noqa: E731
    kv, ff = per_layer(g("attention.head_count_kv")), per_layer(g("feed_forward_length"))
    full = [i for i in range(L) if not swa[i]]
    sliding = [i for i in range(L) if swa[i]] or full
    n_shared = int(g("attention.shared_kv_layers", 0))
    tensors = {t.name: t for t in reader.tensors}
    head_dim, global_head_dim = int(g("attention.key_length_swa")), int(g("attention.key_length"))
    freqs = tensors.get("rope_freqs.weight")
    partial = 2 * int((np.asarray(freqs.data).ravel() == 1.0).sum()) / global_head_dim if freqs is not None else 1.0
    computing_full = [i for i in full if i < L - n_shared]
    ple = tensors.get("per_layer_token_embd.weight")
    n_experts = int(g("expert_count", 0) or 0)
    d = dict(
        model_type="gemma4_text", vocab_size=n_vocab, hidden_size=int(g("embedding_length")),
        intermediate_size=ff[0], use_double_wide_mlp=max(ff) > ff[0], num_hidden_layers=L,
        num_attention_heads=int(g("attention.head_count")), num_key_value_heads=kv[sliding[0]],
        num_global_key_value_heads=kv[full[0]] if full else kv[0], head_dim=head_dim, global_head_dim=global_head_dim,
        attention_k_eq_v=bool(computing_full) and all(f"blk.{i}.attn_v.weight" not in tensors for i in computing_full),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(g("context_length", 131072)),
        sliding_window=int(g("attention.sliding_window", 512)),
        layer_types=["sliding_attention" if s else "full_attention" for s in swa], num_kv_shared_layers=n_shared,
        hidden_size_per_layer_input=int(g("embedding_length_per_layer_input", 0) or 0),
        vocab_size_per_layer_input=int(ple.shape[-1]) if ple is not None else n_vocab,
        final_logit_softcapping=g("final_logit_softcapping"),
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": float(g("rope.freq_base_swa", 10000.0))},
            "full_attention": {"rope_type": "proportional", "rope_theta": float(g("rope.freq_base", 1e6)),
                               "partial_rotary_factor": partial}},
        enable_moe_block=n_experts > 0, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    if n_experts:
        d.update(num_experts=n_experts, top_k_experts=int(g("expert_used_count")),
                 moe_intermediate_size=int(g("expert_feed_forward_length")))
    return d


# GGUF block types kept packed by native loading: name -> (bytes per 32-weight block, Scheme)
NATIVE_TYPES = {
    "Q4_0": (18, Scheme(4, 32)),  # f16 d, 16 bytes of nibbles: w = d * (q - 8)
    "Q4_1": (20, Scheme(4, 32, offset=True)),  # f16 d, f16 m, 16 bytes of nibbles: w = d * q + m
    "Q8_0": (34, Scheme(8, 32)),  # f16 d, 32 int8: w = d * q
}


def repack(data: np.ndarray, type_name: str) -> PackedTensor:
    """A GGUF Q4_0 / Q4_1 / Q8_0 tensor's raw bytes uint8 [rows, blocks * block bytes] -> PackedTensor
    [rows, 32 * blocks]: the scales (and Q4_1's offsets) widened to float32, the codes as stored (a 4-bit
    block's 16 bytes are already jaxspec's nibble layout: byte j holds weight j low, weight j + 16 high, as
    ggml's `dequantize_row_q4_0/1` reads them; Q4_0's nibbles are its codes + 8). Tests check the result
    against gguf's own dequantiser."""
    size, _ = NATIVE_TYPES[type_name]
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, size)  # [out, in / 32, bytes]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [out, in / 32]
    if type_name == "Q8_0":
        return PackedTensor(blocks[..., 2:].copy().view(np.int8).reshape(rows, -1), d)
    start = 4 if type_name == "Q4_1" else 2
    nibbles = blocks[..., start:].reshape(rows, -1).astype(np.uint8)  # [out, in / 2]
    if type_name == "Q4_0":
        return PackedTensor(nibbles, d)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return PackedTensor(nibbles, d, m)


@dataclass(frozen=True)
class _Tensor:
    """What this module reads of a gguf `ReaderTensor`."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    data: np.ndarray  # a view of the file: uint8 blocks for quantised types, else the values


@dataclass(frozen=True)
class _Index:
    """A GGUF's config (gguf_config), architecture and tensor table, with each tensor a view of the file."""

    config: dict
    arch: str
    tensors: tuple[_Tensor, ...]


def _index(path: Path) -> _Index:
    """The file's index, kept in the cache directory (under `gguf/`) once gguf's reader has
    built it: the reader parses every metadata string one by one (a large share of every load for a vocabulary
    of 150k strings; docs/benchmarks/cpu.md, "Start-up cost and the cache directory"), and jaxspec needs only
    the config and where each tensor lies. The copy is keyed by the file (path, size, modification time), the
    gguf version and this module's source, written to a temporary name and renamed, and ignored if it cannot
    be read."""
    import importlib.metadata
    import json
    import os

    import gguf


    try:
        saved = derived_from(path, "gguf", importlib.metadata.version("gguf"), Path(__file__).read_text())
    except OSError:  # no such file: the reader below says so
        saved = None
    if saved is not None:
        try:
            d = json.loads(saved.read_text())
            return _Index(d["config"], d["arch"], tuple(
                _Tensor(t["name"], gguf.GGMLQuantizationType(t["type"]), np.memmap(
                    path, dtype=np.dtype(t["dtype"]), mode="r", offset=t["offset"], shape=tuple(t["shape"])))
                for t in d["tensors"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no copy yet, or a damaged one: read the file
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises ValueError/struct errors/OSError for bad files
        raise WeightsError(f"cannot read GGUF file {path}: {e}; the file is corrupt or not GGUF") from e
    try:
        config = gguf_config(reader)
    except WeightsError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError, AttributeError) as e:  # fields that
        # are missing, of another type (a bit flipped in a key or a type tag) or of impossible values
        raise WeightsError(f"cannot read GGUF file {path}: its metadata is missing or malformed ({type(e).__name__}: "
                           f"{e}); the file is corrupt, re-download it") from e
    index = _Index(config, _field(reader, "general.architecture"),
                   tuple(_Tensor(t.name, t.tensor_type, t.data) for t in reader.tensors))
    blocks = 1 + max((int(m.group(1)) for t in index.tensors if (m := re.match(r"blk\.(\d+)\.", t.name))), default=-1)
    if config["num_hidden_layers"] != blocks:  # before a module of (say) 2**31 layers is built, which would not end
        raise WeightsError(f"cannot read GGUF file {path}: its metadata says {config['num_hidden_layers']} blocks but "
                           f"its tensors fill {blocks}; the file is corrupt, re-download it")
    d = dict(config=index.config, arch=index.arch, tensors=[
        dict(name=t.name, type=int(r.tensor_type), dtype=r.data.dtype.str, shape=list(r.data.shape),
             offset=int(r.data_offset)) for t, r in zip(index.tensors, reader.tensors)])
    try:
        text = json.dumps(d)
    except (TypeError, ValueError):
        return index
    if saved is None or json.loads(text)["config"] != index.config:  # keep only what JSON keeps as it was
        return index
    tmp = saved.with_name(f"{saved.name}.tmp{os.getpid()}")
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        tmp.replace(saved)
    except OSError:  # a read-only cache: read the file next time too
        tmp.unlink(missing_ok=True)
    return index


def native_schemes(path: Path) -> dict[str, Scheme]:
    """HF tensor name -> Scheme for every tensor of a .gguf file that native loading keeps packed."""
    index = _index(path)
    arch = GGUF_ARCHS[index.arch]
    out = {}
    for t in index.tensors:
        hf = arch.hf_name(t.name)
        if hf is not None and t.tensor_type.name in NATIVE_TYPES and len(t.data.shape) == 2:
            out[hf] = NATIVE_TYPES[t.tensor_type.name][1]
    return out


def read_gguf(path: Path, *, native: bool = False) -> tuple[dict, Iterator[tuple[str, np.ndarray]]]:
    """(HF-style config dict, iterator of (HF tensor name, float32 array)) from a .gguf file.

    Quantised tensors are dequantised by gguf (always to float32); the loading core casts them once more,
    to the parameter dtype. native: Q4_0 / Q4_1 / Q8_0 tensors come as `PackedTensor`s instead (`repack`).
    """
    import gguf

    index = _index(path)
    cfg = index.config
    arch = GGUF_ARCHS[index.arch]

    def read(t: _Tensor):
        """One tensor as the loader takes it (float32, or a PackedTensor where `native` keeps its blocks)."""
        if native and t.tensor_type.name in NATIVE_TYPES and len(t.data.shape) == 2:
            packed = repack(np.asarray(t.data), t.tensor_type.name)
            return packed.map(lambda a: arch.fix(t.name, a, cfg))  # row fixes move codes and scales alike
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise WeightsError(f"GGUF tensor {t.name} uses {t.tensor_type.name}, "
                               "which gguf cannot dequantise") from e
        return arch.fix(t.name, arr, cfg)

    def tensors():
        for t in index.tensors:
            hf = arch.hf_name(t.name)
            if hf is None:
                continue
            try:
                arr = read(t)
            except WeightsError:
                raise
            except (ValueError, TypeError, IndexError) as e:  # a shape that its type's blocks or the metadata's
                # heads cannot divide: the file's metadata and tensors disagree
                raise WeightsError(f"cannot read GGUF tensor {t.name} of {path} (shape {tuple(t.data.shape)}, "
                                   f"{t.tensor_type.name}): {e}; the file is corrupt, re-download it") from e
            yield hf, arr
            del arr  # before the next tensor is read: one tensor alive at a time

    return cfg, tensors()
