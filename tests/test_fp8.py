"""FP8 block-scaled checkpoints (DeepSeek-V3's layout): a tiny DeepSeek-V3 whose projections are stored as
float8_e4m3fn with 128 x 128-style block scales (here 24 x 24) loads to the same parameters and logits as the
same checkpoint holding torch's own dequantisation of those weights in float32."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import jaxspec.model as jm
from jaxspec.checkpoint import WeightsError
from jaxspec.checkpoint.fp8 import dequantize_fp8_blocks

BLOCK = 24  # the tiny model's dimensions (16, 32, 64, ...) are not multiples of it: partial edge blocks too
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}


def quantize(w: torch.Tensor):
    """float32 [out, in] -> (float8_e4m3fn [out, in], float32 scale_inv per block), as DeepSeek's converter does:
    each block scaled so its largest magnitude maps to 448 (e4m3's max)."""
    out, cols = w.shape
    pad = torch.zeros(-(-out // BLOCK) * BLOCK, -(-cols // BLOCK) * BLOCK)
    pad[:out, :cols] = w
    blocks = pad.reshape(pad.shape[0] // BLOCK, BLOCK, pad.shape[1] // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(pad.shape)[:out, :cols].to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: q.shape[0], : q.shape[1]]
    return q.to(torch.float32) * s


def test_fp8_checkpoint_loads_as_its_dequantised_weights(tmp_path):
    from test_deepseek import build_hf

    build_hf("deepseek_v3").save_pretrained(tmp_path / "src")
    tensors = load_file(str(tmp_path / "src" / "model.safetensors"))
    plain, fp8, quantised = {}, {}, 0
    for name, w in tensors.items():
        if not name.endswith("proj.weight") and not name.endswith("proj_with_mqa.weight"):
            plain[name] = fp8[name] = w  # embeddings, norms, router, LM head: not quantised
            continue
        q, scale = quantize(w.float())
        plain[name] = dequantize(q, scale)
        fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"] = q, scale
        quantised += 1
    assert quantised > 10
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    for kind, tensors_, extra in (("plain", plain, {}), ("fp8", fp8, {"quantization_config": QUANT})):
        (tmp_path / kind).mkdir()
        save_file(tensors_, str(tmp_path / kind / "model.safetensors"))
        (tmp_path / kind / "config.json").write_text(json.dumps({**config, **extra}))
    a, b = jm.load(tmp_path / "plain", tokenizer=False), jm.load(tmp_path / "fp8", tokenizer=False)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ids = np.random.default_rng(0).integers(0, 128, (1, 9))
    np.testing.assert_array_equal(a.logits(ids), b.logits(ids))


def test_unpaired_fp8_weight_is_reported():
    import ml_dtypes

    parts = [("m.q_proj.weight", np.zeros((4, 4), ml_dtypes.float8_e4m3fn))]
    with pytest.raises(WeightsError, match="lacks its weight_scale_inv"):
        list(dequantize_fp8_blocks(parts, (BLOCK, BLOCK)))
