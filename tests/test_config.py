"""config.json -> DenseConfig for every supported dense model type, and RoPE tables equal to transformers'."""
from __future__ import annotations

import math

import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from conftest import TINY
from jaxspec.config import ConfigError, RopeConfig, dense_config_from_dict, drafter_config_from_dict
from jaxspec.models.layers import rope_inv_freq


def parse(model_type, **kw):
    return dense_config_from_dict({"model_type": model_type, **TINY.get(model_type, {}), **kw})


def test_llama():
    c = parse("llama", eos_token_id=[3, 4])
    assert (c.head_dim, c.num_heads, c.num_kv_heads, c.num_layers) == (16, 4, 2, 2)
    assert c.layer_types == ("full_attention",) * 2 and c.sliding_window is None
    assert c.rope_global == c.rope_local == RopeConfig(5e5, "llama3", 8.0, 1.0, 4.0, 64)
    assert not (c.tie_word_embeddings or c.qk_norm or c.norm_plus_one or c.sandwich_norm)
    assert (c.hidden_act, c.embed_scale, c.query_scale, c.eos_token_ids) == ("silu", 1.0, 0.25, (3, 4))


def test_qwen3():
    c = parse("qwen3")
    assert c.tie_word_embeddings and c.qk_norm and not c.norm_plus_one
    assert c.rope_global == RopeConfig(theta=1e6) and c.head_dim == 16


def test_gemma3_text_layer_types_and_rope():
    c = parse("gemma3_text", query_pre_attn_scalar=32)  # != head_dim, so the scale's source shows
    assert c.is_sliding == (True, True, False, True, True, False)  # full iff (i + 1) % pattern == 0
    assert c.sliding_window == 4
    assert c.rope_local == RopeConfig(theta=1e4)
    assert c.rope_global == RopeConfig(theta=1e6, rope_type="linear", factor=8.0)
    assert c.query_scale == 32**-0.5 and c.embed_scale == math.sqrt(64)
    assert c.norm_plus_one and c.sandwich_norm and c.qk_norm and c.tie_word_embeddings
    assert c.hidden_act == "gelu_tanh"


def test_gemma3_multimodal_legacy_keys():
    """A Gemma 3 4B-style config: the text model in text_config, RoPE in the legacy keys, EOS at top level."""
    text = dict(TINY["gemma3_text"], rope_theta=1e6, rope_local_base_freq=1e4,
                rope_scaling={"rope_type": "linear", "factor": 8.0}, num_hidden_layers=7)
    del text["rope_parameters"], text["sliding_window_pattern"]
    c = dense_config_from_dict({"model_type": "gemma3", "text_config": text, "eos_token_id": [1, 106]})
    assert c.model_type == "gemma3_text" and c.eos_token_ids == (1, 106)
    assert c.is_sliding == (True,) * 5 + (False, True)  # default pattern 6
    assert c.rope_local == RopeConfig(theta=1e4)
    assert c.rope_global == RopeConfig(theta=1e6, rope_type="linear", factor=8.0)


@pytest.mark.parametrize("bad, words", [
    ({"model_type": "mistral"}, ["mistral", "llama", "qwen3", "gemma3_text"]),
    ({**TINY["llama"], "model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, ["yarn"]),
])
def test_unsupported(bad, words):
    with pytest.raises(ConfigError) as e:
        dense_config_from_dict(bad)
    assert all(w in str(e.value) for w in words)


def test_llama3_inv_freq_matches_transformers(tiny_hf):
    hf, _ = tiny_hf("llama")
    c = parse("llama", max_position_embeddings=512)
    ours = rope_inv_freq(c.head_dim, c.rope_global)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.AutoConfig.for_model("llama", **TINY["llama"]))
    # the tiny table spans all three llama3 bands: kept, interpolated and divided by the factor
    plain = rope_inv_freq(c.head_dim, RopeConfig(theta=5e5))
    ratio = ours / plain
    assert (ratio == 1).any() and np.isclose(ratio, 1 / 8).any() and ((ratio > 1 / 8 + 1e-3) & (ratio < 1)).any()
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)
    np.testing.assert_allclose(ours, hf.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)


def test_gemma3_inv_freq_per_layer_type(tiny_hf):
    hf, _ = tiny_hf("gemma3_text")
    c = parse("gemma3_text")
    rot = hf.model.rotary_emb
    np.testing.assert_allclose(rope_inv_freq(16, c.rope_local), rot.sliding_attention_inv_freq.numpy(), rtol=1e-6)
    np.testing.assert_allclose(rope_inv_freq(16, c.rope_global), rot.full_attention_inv_freq.numpy(), rtol=1e-6)


DRAFTER = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "vocab_size": 256, "block_size": 8, "num_hidden_layers": 2,
           "dflash_config": {"mask_token_id": 255, "target_layer_ids": [1, 2]}}


def test_drafter_layer_types_match_its_layers():
    assert drafter_config_from_dict(DRAFTER).layer_types == ("full_attention",) * 2
    assert drafter_config_from_dict({**DRAFTER, "layer_types": ["full_attention", "sliding_attention"],
                                     "sliding_window": 4}).is_sliding == (False, True)
    for types in (["full_attention"], ["full_attention"] * 3):
        with pytest.raises(ConfigError, match=rf"num_hidden_layers 2 but {len(types)} layer_types.*one entry per"):
            drafter_config_from_dict({**DRAFTER, "layer_types": types})


FAMILY_SIZES = {  # a tiny valid config per non-dense family, and the sizes its parser must check
    "qwen3_5_text": (dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                          full_attention_interval=4),
                     ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                      "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                      "max_position_embeddings", "rms_norm_eps"]),
    "deepseek_v3": (dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=32,
                         kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                         num_experts_per_tok=2, n_group=4, topk_group=2),
                    ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                     "max_position_embeddings", "rms_norm_eps", "routed_scaling_factor"]),
    "gemma4_text": (dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                         sliding_window=4, hidden_size_per_layer_input=0,
                         layer_types=["sliding_attention", "full_attention"]),
                    ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "global_head_dim", "sliding_window",
                     "max_position_embeddings", "rms_norm_eps"]),
}


@pytest.mark.parametrize("model_type", list(FAMILY_SIZES))
def test_family_parsers_refuse_impossible_sizes(model_type):
    """Every family's parser gives a ConfigError naming the field for a zero, negative or NaN size (the hybrid
    parser once divided by a zero head count; the others built modules that failed far from config.json)."""
    from jaxspec.models.registry import config_from_dict

    base, keys = FAMILY_SIZES[model_type]
    config_from_dict({"model_type": model_type, **base})  # the base parses
    for key in keys:
        for bad in (0, -2, math.nan):
            with pytest.raises(ConfigError, match="invalid") as e:
                config_from_dict({"model_type": model_type, **base, key: bad})
            # the field, or the per-layer field transformers derives from it (Gemma 4's head_dim, KV heads)
            assert any(w in str(e.value) for w in (key, "head_dim", "heads", "layer")), (key, bad, e.value)
