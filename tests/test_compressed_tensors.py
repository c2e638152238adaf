"""compressed-tensors pack-quantized INT4 (Kimi's routed experts): the nibble order, and a tiny Kimi-shaped checkpoint
whose experts are INT4 loads to exactly the parameters of the same checkpoint with those experts dequantised.

The packer below follows compressed-tensors' `pack_to_int32` (checked against compressed-tensors 0.20.0 once:
its packing of -8..-1 is the word 0x76543210, the least significant nibble first).
"""
from __future__ import annotations

import json

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxspec.model as jm
from jaxspec.checkpoint import WeightsError
from jaxspec.checkpoint.compressed_tensors import dequantize_pack_quantized, unpack_int4

GROUP = 32
QUANT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
             "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}},
         "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"]}


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int [out, in] in [-8, 7] -> int32 [out, ceil(in/8)], nibble i of word w = column 8 w + i, offset 8."""
    out, cols = q.shape
    v = np.zeros((out, -(-cols // 8) * 8), np.uint32)
    v[:, :cols] = q + 8
    words = (v.reshape(out, -1, 8) << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32)
    return words.view(np.int32)


def quantize(w: np.ndarray):
    """Symmetric per-group INT4: (q [out, in], bf16 scale [out, in/GROUP])."""
    g = w.reshape(w.shape[0], -1, GROUP)
    scale = (np.abs(g).max(-1) / 7.0).astype(ml_dtypes.bfloat16)
    q = np.clip(np.round(g / scale.astype(np.float32)[..., None]), -8, 7).astype(np.int8)
    return q.reshape(w.shape), scale


def test_nibble_order():
    assert pack_int4(np.arange(-8, 0)[None]).item() & 0xFFFFFFFF == 0x76543210
    q = np.random.default_rng(0).integers(-8, 8, (5, 40))
    np.testing.assert_array_equal(unpack_int4(pack_int4(q), 40), q)


def test_int4_experts_load_as_their_dequantised_weights(tmp_path):
    from test_deepseek import build_hf

    hf = build_hf("kimi")
    hf.save_pretrained(tmp_path / "src")
    tensors = load_file(str(tmp_path / "src" / "model.safetensors"))
    plain, packed = {}, {}
    for name, w in tensors.items():
        if ".mlp.experts." not in name:
            plain[name] = packed[name] = w
            continue
        q, scale = quantize(w)
        plain[name] = q.astype(np.float32) * np.repeat(scale.astype(np.float32), GROUP, axis=1)
        p = name.removesuffix(".weight")
        packed.update({f"{p}.weight_packed": pack_int4(q), f"{p}.weight_scale": scale,
                       f"{p}.weight_shape": np.asarray(w.shape, np.int64)})
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    for kind, tensors_, extra in (("plain", plain, {}), ("int4", packed, {"quantization_config": QUANT})):
        (tmp_path / kind).mkdir()
        save_file(tensors_, str(tmp_path / kind / "model.safetensors"))
        (tmp_path / kind / "config.json").write_text(json.dumps({**config, **extra}))
    a, b = jm.load(tmp_path / "plain", tokenizer=False), jm.load(tmp_path / "int4", tokenizer=False)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ids = np.random.default_rng(0).integers(0, 128, (1, 9))
    np.testing.assert_array_equal(a.logits(ids), b.logits(ids))


def test_incomplete_triple_is_reported():
    parts = [("m.experts.0.up_proj.weight_packed", pack_int4(np.zeros((2, 32), int))),
             ("m.experts.0.up_proj.weight_shape", np.array([2, 32]))]
    with pytest.raises(WeightsError, match="lacks weight_scale"):
        list(dequantize_pack_quantized(parts, GROUP))


def test_int4_experts_stay_packed_when_quantize_is_set(tmp_path):
    """quantize='native': the INT4 experts fill packed parameters as stored (no dequantisation), the rest stays
    float; the logits equal the dequantised load's."""
    from jaxspec.models.quant import Packed, unpack_nibbles
    from test_deepseek import build_hf

    hf = build_hf("kimi")
    hf.save_pretrained(tmp_path / "src")
    tensors = load_file(str(tmp_path / "src" / "model.safetensors"))
    out = {}
    for name, w in tensors.items():
        if ".mlp.experts." in name:
            q, scale = quantize(w)
            p = name.removesuffix(".weight")
            out.update({f"{p}.weight_packed": pack_int4(q), f"{p}.weight_scale": scale,
                        f"{p}.weight_shape": np.asarray(w.shape, np.int64)})
        else:
            out[name] = w
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "int4").mkdir()
    save_file(out, str(tmp_path / "int4" / "model.safetensors"))
    (tmp_path / "int4" / "config.json").write_text(json.dumps({**config, "quantization_config": QUANT}))
    a = jm.load(tmp_path / "int4", tokenizer=False)
    b = jm.load(tmp_path / "int4", tokenizer=False, quantize="native")
    experts = b.module.layers[config["first_k_dense_replace"]].mlp.experts
    assert isinstance(experts.up_proj, Packed)
    codes = np.asarray(experts.up_proj.codes[...])  # [E, out, in / 2]: two codes per byte, stored + 8
    q, _ = quantize(tensors[f"model.layers.{config['first_k_dense_replace']}.mlp.experts.1.up_proj.weight"])
    np.testing.assert_array_equal(unpack_nibbles(codes[1]).astype(int) - 8, q)
    assert not isinstance(b.module.layers[0].self_attn.o_proj.kernel, Packed)
    ids = np.random.default_rng(0).integers(0, 128, (1, 9))
    np.testing.assert_allclose(a.logits(ids), b.logits(ids), rtol=0, atol=1e-4)
