"""GGUF files (llama.cpp): metadata -> HF-style config dict, tensors -> HF names, per-architecture fixes as data.

Each supported GGUF architecture is a `GGUFArch` row: the HF model_type it becomes, where its tensor names
differ from the common llama.cpp -> HF mapping, and which tensors llama.cpp stored altered (and how to undo
it). The renamed tensors then go through the family's HF table like any safetensors checkpoint.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np

from jaxspec.checkpoint.core import WeightsError

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
    """model_type: the HF model_type; layer_names: overrides of _LAYER_NAMES; fixes: llama.cpp part name
    (`attn_q`, `output_norm`, ...) -> the function that undoes what the converter did to that tensor."""

    model_type: str
    layer_names: Mapping[str, str] = field(default_factory=dict)
    fixes: Mapping[str, Fix] = field(default_factory=dict)

    def hf_name(self, gguf_name: str) -> str | None:
        """llama.cpp tensor name -> HF name (None: not a parameter); WeightsError for an unknown one."""
        m = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+?)(\.weight|\.bias)", gguf_name)
        if m is not None:
            i, part, suffix = m.groups()
            if i is None and part in _TOP_NAMES:
                return None if _TOP_NAMES[part] is None else _TOP_NAMES[part] + suffix
            hf = self.layer_names.get(part, _LAYER_NAMES.get(part))
            if i is not None and hf is not None:
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


def read_gguf(path: Path) -> tuple[dict, Iterator[tuple[str, np.ndarray]]]:
    """(HF-style config dict, iterator of (HF tensor name, float32 array)) from a .gguf file.

    Quantised tensors are dequantised by gguf (always to float32); the loading core casts them once more,
    to the parameter dtype.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises ValueError/struct errors/OSError for bad files
        raise WeightsError(f"cannot read GGUF file {path}: {e}; the file is corrupt or not GGUF") from e
    cfg = gguf_config(reader)
    arch = GGUF_ARCHS[_field(reader, "general.architecture")]

    def tensors():
        for t in reader.tensors:
            hf = arch.hf_name(t.name)
            if hf is None:
                continue
            try:
                arr = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise WeightsError(f"GGUF tensor {t.name} uses {t.tensor_type.name}, which gguf cannot dequantise") from e
            arr = arch.fix(t.name, arr, cfg)
            yield hf, arr
            del arr  # before the next tensor is dequantised: one tensor alive at a time

    return cfg, tensors()
