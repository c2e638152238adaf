"""`python -m jaxspec.plan`: per-device bytes by hand on a tiny config (sharded, replicated and packed
parameters, caches), the real Kimi K2 config (tests/data/configs, no weights) fitting 8 x 141 GiB with its INT4
experts and not in bf16, a directory converted with --quantize counted as its packing.json records, and one-line
errors for bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxspec.models.registry import config_from_dict
from jaxspec.plan import GIB, main, plan, plan_path, read_config, verify_scratch

CONFIGS = Path(__file__).parent / "data" / "configs"
TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
            tie_word_embeddings=False)


def test_tiny_by_hand():
    """tp = 4: q, o and the MLP split 4 ways; k/v (2 heads x 8 = 16 columns) and the cache 2 ways, one KV head
    per device pair (sharding.py: a head is never cut, and KV heads fewer than tp split over gcd(2, 4) devices)."""
    p = plan(TINY, tp=4, budget=8, max_len=64, dtype="float32")
    H, F, V, L = 64, 128, 256, 2
    per_layer = (H * 64 + 64 * H + 3 * H * F) / 4 + 2 * H * 16 / 2 + 2 * H  # q, o, mlp; k, v by KV head; norms
    assert p.weights == (2 * V * H / 4 + H + L * per_layer) * 4
    assert p.cache == L * 2 * (1 * 2 * 64 * 8) * 4 / 2 + 8  # k and v [B, KVH, T, D] float32, halves; int32 header
    q8 = plan(TINY, tp=4, budget=8, max_len=64, dtype="float32", quantize="int8")
    split = [(H, 64), (64, H), (H, F), (H, F), (F, H)]  # [in, out]: 1 byte + a float32 scale per column
    halves = [(H, 16), (H, 16)]  # k, v
    int8_layer = sum(i * o + 4 * o for i, o in split) / 4 + sum(i * o + 4 * o for i, o in halves) / 2 + 2 * H * 4
    table = (V * H + 4 * V) / 4  # embedding [V, H] and head [H, V], split by vocab: a scale per vocab entry
    assert q8.weights == 2 * table + H * 4 + L * int8_layer and q8.cache == p.cache


def test_kimi_k2_int4_fits_bf16_does_not():
    kimi = read_config(CONFIGS / "kimi_k2_thinking_int4.json")
    int4 = plan(kimi, tp=8, budget=64, max_len=32768, hbm_gib=141)
    bf16 = plan({**kimi, "quantization_config": None}, tp=8, budget=64, max_len=32768)  # same module: built once
    assert int4.fits and 65 * GIB < int4.weights < 75 * GIB  # 0.5 B per code + a bf16 scale per 32 inputs, 8 ways
    assert not bf16.fits and bf16.weights > 230 * GIB  # 1912 GiB / 8
    assert int4.cache == bf16.cache and 2 * GIB < int4.cache < 2.3 * GIB  # MLA latents, replicated: 68.6 KiB x 32768


def test_gdn_verify_scratch_matches_readme():
    """docs/design/hybrid-gdn.md (bench/budget_sweep.py), Qwen3.6-27B at budget 64, unsharded: 3.3 MiB per GDN
    layer kept for the commit, 159 MiB over its 48 GDN layers, and 0.8 MiB per [N, N, Hv] float32 array."""
    cfg = config_from_dict(read_config(CONFIGS / "qwen3_6_27b.json"))
    gdn = verify_scratch(cfg, tp=1, budget=64, max_len=32768, batch=1, itemsize=2)["gdn"]
    nn_hv = 65 * 65 * 48 * 4
    assert abs(nn_hv / 2**20 - 0.8) < 0.05
    assert abs((gdn - 4 * nn_hv) / 2**20 - 159) < 1 and abs((gdn - 4 * nn_hv) / 48 / 2**20 - 3.3) < 0.05


@pytest.mark.parametrize("argv, words", [
    (["missing_dir"], "missing_dir not found"),
    ([str(CONFIGS / "gemma3_27b.json"), "--tp", "0"], "--tp must be a positive integer"),
    ([str(CONFIGS / "gemma3_27b.json"), "--quantize", "int2"], "unsupported --quantize 'int2'"),
])
def test_bad_input(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and words in err, err


def test_unsupported_model_type(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "model_type": "mamba"}))
    assert main([str(tmp_path)]) == 2
    assert "unsupported model_type 'mamba'" in capsys.readouterr().err


def test_converted_packed_counts_as_recorded(tiny_hf, tmp_path, capsys):
    """A directory converted with --quantize int8 counts as its packing.json records: the weights the what-if
    reports for its source, well below the float figure; another --quantize is refused as jaxspec.load refuses it."""
    from checkpoints_convert import convert

    _, src = tiny_hf("llama")
    out = convert(src, tmp_path / "out", "float32", quantize="int8", progress=False)
    kw = dict(tp=2, budget=4, max_len=64)
    converted, what_if, float_ = plan_path(out, **kw), plan_path(src, quantize="int8", **kw), plan_path(src, **kw)
    assert converted.weights == what_if.weights < 0.6 * float_.weights  # bf16: 2 bytes a weight, int8 about 1
    assert converted.packing == "int8 (converted)"
    assert plan_path(out, quantize="int8", **kw).weights == converted.weights  # the recorded one: no contradiction
    capsys.readouterr()  # the fixture's save_pretrained progress bar
    assert main([str(out), "--quantize", "int4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert f"{out} is a converted checkpoint, counted as converted (--quantize int8); --quantize int4 applies" in err
