"""Reading checkpoints: HF safetensors directories and GGUF files -> jaxspec parameters.

Both readers yield `(hf_name, numpy array)` one tensor at a time, so a checkpoint is never held twice in
memory; `assign` places each tensor into the abstract NNX state of the model (transposing Linear
weights from HF's [out, in] to [in, out]) and checks every shape and that nothing is missing.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# HF key prefixes of the language model inside multimodal checkpoints (Gemma 3 4B+), outermost first
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")


class WeightsError(ValueError):
    """A checkpoint that cannot be read into the model; the message names the file or tensor."""


def hf_param_path(name: str) -> str | None:
    """HF tensor name -> dotted jaxspec module path (None for tensors the text model does not use)."""
    if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")):
        return None
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return "lm_head.weight"
    for p in _PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return None


def assign(model_ctor, tensors: Iterator[tuple[str, np.ndarray]], dtype, *, path_fn=None, skip=()) -> nnx.Module:
    """Build the module abstractly, then fill it tensor by tensor from `tensors`.

    path_fn maps a checkpoint name to a dotted module path (default: HF target names); names whose
    path starts with one of `skip` are ignored (e.g. a drafter checkpoint that carries the target's head).
    """
    abstract = nnx.eval_shape(model_ctor)
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    by_path = {".".join(str(p) for p in k): k for k in flat}
    filled = set()
    for name, arr in tensors:
        path = (path_fn or hf_param_path)(name)
        if path is None or path.startswith(tuple(skip)):
            continue
        if path.endswith(".weight") and path[: -len(".weight")] + ".kernel" in by_path:
            path, arr = path[: -len(".weight")] + ".kernel", arr.T  # Linear: [out, in] -> [in, out]
        elif path == "embed_tokens.weight":
            path = "embed_tokens"
        if path not in by_path:
            if path.startswith("lm_head") and "lm_head.kernel" not in by_path:
                continue  # tied model: some exporters still write lm_head.weight
            if re.search(r"rotary_emb|inv_freq", path):
                continue
            raise WeightsError(f"unexpected tensor {name!r} in the checkpoint; is config.json from the same model?")
        key = by_path[path]
        var = flat[key]
        if tuple(arr.shape) != tuple(var.shape):
            raise WeightsError(f"tensor {name!r} has shape {tuple(arr.shape)}, the config implies {tuple(var.shape)}")
        var.set_value(jnp.asarray(np.asarray(arr, np.float32) if arr.dtype != np.float32 else arr, dtype=dtype))
        filled.add(path)
    missing = sorted(set(by_path) - filled)
    if missing:
        raise WeightsError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[0]!r}; the file may be truncated")
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---------------------------------------------------------------------------------------- safetensors


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightsError(f"{index} is not a valid safetensors index ({e}); re-download the model") from e
        files = [model_dir / f for f in dict.fromkeys(weight_map.values())]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        raise WeightsError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    for f in files:
        if not f.is_file():
            raise WeightsError(f"shard {f} listed in the index is missing; re-download the model")
    return files


def read_safetensors(model_dir: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield every tensor of every shard, one at a time (bf16 comes back as ml_dtypes.bfloat16)."""
    from safetensors import SafetensorError, safe_open

    for f in safetensors_files(model_dir):
        try:
            with safe_open(str(f), framework="numpy") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise WeightsError(f"cannot read {f}: {e}; the file is corrupt or truncated, re-download it") from e


# ---------------------------------------------------------------------------------------------- GGUF

_GGUF_ARCH = {"llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3_text"}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader) -> dict:
    """HF-style config dict from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCH:
        raise WeightsError(f"GGUF architecture {arch!r} is not supported; jaxspec reads: {', '.join(_GGUF_ARCH)}")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    n_vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    H, nH = g("embedding_length"), g("attention.head_count")
    head_dim = g("attention.key_length") or H // nH
    tied = "output.weight" not in {t.name for t in reader.tensors}
    d = dict(
        model_type=_GGUF_ARCH[arch],
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


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's half-split layout)."""
    out, *rest = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: Path) -> tuple[dict, Iterator[tuple[str, np.ndarray]]]:
    """(HF-style config dict, iterator of (HF tensor name, float32 array)) from a .gguf file."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises ValueError/struct errors/OSError for bad files
        raise WeightsError(f"cannot read GGUF file {path}: {e}; the file is corrupt or not GGUF") from e
    cfg = gguf_config(reader)
    arch = cfg["model_type"]

    def tensors():
        for t in reader.tensors:
            try:
                arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            except NotImplementedError as e:
                raise WeightsError(f"GGUF tensor {t.name} uses {t.tensor_type.name}, which gguf cannot dequantise") from e
            name = t.name.removesuffix(".weight").removesuffix(".bias")
            suffix = t.name[len(name):]
            if name == "token_embd":
                yield "model.embed_tokens" + suffix, arr
            elif name == "output_norm":
                yield "model.norm" + suffix, arr - (1.0 if arch == "gemma3_text" else 0.0)
            elif name == "output":
                yield "lm_head" + suffix, arr
            elif m := re.fullmatch(r"blk\.(\d+)\.(\w+)", name):
                i, part = m.groups()
                if part == "ffn_norm":  # Llama's post-attention norm is Gemma's pre-feed-forward norm
                    hf = "pre_feedforward_layernorm" if arch == "gemma3_text" else "post_attention_layernorm"
                elif part in _GGUF_LAYER:
                    hf = _GGUF_LAYER[part]
                else:
                    raise WeightsError(f"unexpected GGUF tensor {t.name}")
                if arch == "llama" and part == "attn_q":
                    arr = _unpermute(arr, cfg["num_attention_heads"])
                elif arch == "llama" and part == "attn_k":
                    arr = _unpermute(arr, cfg["num_key_value_heads"])
                if arch == "gemma3_text" and hf.endswith("norm") and suffix == ".weight":
                    arr = arr - 1.0  # llama.cpp stores Gemma's (1 + w) norms with the 1 folded in
                yield f"model.layers.{i}.{hf}{suffix}", arr
            elif name != "rope_freqs":  # rope_freqs went into the config (gguf_config)
                raise WeightsError(f"unexpected GGUF tensor {t.name}")

    return cfg, tensors()
