"""Packed (int8 / int4) weights: fused matmul vs dequantise-first, GGUF block repacking vs gguf's dequantiser,
round-to-nearest error bound, native GGUF loading, and lossless speculative decoding on packed targets."""
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.checkpoint.gguf import repack
from jaxspec.kernels import cpu as cpu_kernel
from jaxspec.kernels import xla as xla_forms
from jaxspec.models import quant
from jaxspec.models.deepseek import deepseek_config_from_dict
from jaxspec.testing import oracle_drafter

SCHEMES = {"int8-channel": quant.Scheme(8, None), "int8-g32": quant.Scheme(8, 32),
           "int4-g32": quant.Scheme(4, 32), "int4-g32-offset": quant.Scheme(4, 32, offset=True)}


def packed_weight(scheme, out=48, cols=64, seed=0):
    """A Packed [out, cols] with random codes in the scheme's range, scales and (if any) offsets, and its float
    weight computed here from the integer codes (the independent reference)."""
    rng = np.random.default_rng(seed)
    lo, hi = (-127, 128) if scheme.bits == 8 else ((0, 16) if scheme.offset else (-8, 8))
    g = scheme.group or cols
    codes = rng.integers(lo, hi, (out, cols))
    scale = rng.uniform(0.01, 0.1, (out, cols // g)).astype(np.float32)
    offset = rng.normal(0, 0.1, (out, cols // g)).astype(np.float32) if scheme.offset else None
    w = codes.astype(np.float32) * np.repeat(scale, g, axis=1) + (0 if offset is None else np.repeat(offset, g, axis=1))
    stored = codes.astype(np.int8) if scheme.bits == 8 else quant.pack_nibbles(codes + (0 if scheme.offset else 8))
    pt = quant.PackedTensor(stored, scale, offset)
    p = quant.Packed((out, cols), ("embed", "ffn"), scheme)
    for k, v in pt.parts().items():
        getattr(p, k).set_value(jnp.asarray(v))
    return p, pt, w


def assert_float_product(got, x, w):
    """got equals x @ w.T up to float32 summation error: within 1e-5 of sum |x| |w| (float64 reference)."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    err = np.abs(np.asarray(got, np.float64) - x @ w.T)
    assert (err <= 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-30).all(), err.max()


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("rows", [1, 5])
def test_packed_matmul_equals_dequantize_then_matmul(name, rows):
    p, pt, w = packed_weight(SCHEMES[name])
    np.testing.assert_allclose(pt.dequantize(), w, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(quant.dequantize(*p.parts())), w, rtol=1e-6)
    x = np.random.default_rng(1).normal(size=(1, rows, 64)).astype(np.float32)
    assert_float_product(jax.jit(quant.matmul)(jnp.asarray(x), p)[0], x[0], w)
    # the path without the CPU kernel (GPU, no compiler)
    xla = jax.jit(lambda x: xla_forms.packed_matmul(x, *p.parts()))
    assert_float_product(xla(jnp.asarray(x))[0], x[0], w)


def test_nibbles_are_gguf_block_order():
    """Byte j of a 32-input block holds input j (low nibble) and input j + 16 (high)."""
    codes = np.arange(64) % 16
    packed = quant.pack_nibbles(codes[None])
    assert packed.shape == (1, 32) and packed[0, 3] == 3 | (3 << 4) and packed[0, 20] == 4 | (4 << 4)
    codes = np.random.default_rng(0).integers(0, 16, (3, 96))
    np.testing.assert_array_equal(np.asarray(quant.unpack_nibbles(jnp.asarray(quant.pack_nibbles(codes)))), codes)


def test_cpu_kernel_builds_where_a_compiler_is():
    """The packed products must not silently fall back to XLA's slow loop on a machine that can build the
    kernel (CI has a C++ compiler)."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    assert cpu_kernel.available()


def test_cpu_kernel_without_a_compiler_says_so_once(tmp_path):
    """No compiler: one notice naming the problem and the fix, and the XLA forms run (available() is False)."""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "JAXSPEC_CACHE_DIR": str(tmp_path)}
    code = "from jaxspec.kernels import cpu as k; print(k.available(), k.available())"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "False False", r.stderr
    notice = [ln for ln in r.stderr.splitlines() if ln.startswith("jaxspec:")]
    assert len(notice) == 1 and "unavailable" in notice[0] and "Install a C++ compiler" in notice[0], r.stderr


def test_cpu_kernel_without_a_cache_directory_says_so(tmp_path):
    """A cache directory that cannot be made: the notice names it and its fix, not the compiler."""
    (tmp_path / "file").write_text("")
    env = {**os.environ, "JAXSPEC_CACHE_DIR": str(tmp_path / "file" / "cache")}
    code = "from jaxspec.kernels import cpu as k; print(k.available())"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "False", r.stderr
    notice = [ln for ln in r.stderr.splitlines() if ln.startswith("jaxspec:")]
    assert len(notice) == 1 and "JAXSPEC_CACHE_DIR" in notice[0] and "compiler" not in notice[0], r.stderr


@pytest.mark.parametrize("name,group,cols", [
    ("int4-g32-offset", 32, 192), ("int4-g32", 32, 192), ("int8-g32", 32, 160),  # integer path, a partial slice
    ("int4-g32-offset", 128, 384), ("int8-channel", None, 192),  # integer path, a scale per whole slices
    ("int4-g32-offset", 64, 192), ("int8-g32", 96, 192)])  # float path
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 9])
def test_cpu_kernel_tiles_and_threads(name, group, cols, rows):
    """Both paths, every tile shape (1 / 2 / 3 / 4 input rows, an odd number of output rows), a last 64-byte
    slice of codes only partly used, and a size that splits over XLA's threads, against the float product."""
    if cpu_kernel.level() < 2:
        pytest.skip("no C++ compiler or no AVX-512")
    scheme = quant.Scheme(SCHEMES[name].bits, group, SCHEMES[name].offset)
    p, _, w = packed_weight(scheme, out=517, cols=cols, seed=rows)
    x = np.random.default_rng(2).normal(size=(rows, cols)).astype(np.float32)
    got = jax.jit(lambda x: cpu_kernel.packed_matmul(x, *p.parts()))(jnp.asarray(x))
    assert_float_product(got, x, w)
    hlo = jax.jit(quant.matmul).lower(jnp.asarray(x), p).as_text()
    assert cpu_kernel.TARGET in hlo


def unfused_instructions(hlo: str) -> str:
    """The HLO text of every computation that is not a fusion body (ENTRY, while bodies, ...): an array typed
    there is a real buffer."""
    comps = hlo.split("\n\n")
    return "\n".join(c for c in comps if not re.match(r"\s*%(fused_computation|wrapped_)", c))


def test_decode_loop_keeps_the_dequantisation_inside():
    """XLA's path (no CPU kernel): in a while loop the packed weight is loop-invariant; its int8 -> float
    conversion must not be hoisted out (that materialises the float weight once and runs a slower loop inside)."""
    p, _, _ = packed_weight(SCHEMES["int8-g32"], out=128, cols=128)
    step = lambda i, x: x + xla_forms.packed_matmul(x, *p.parts())  # noqa: E731
    hlo = jax.jit(lambda x: jax.lax.fori_loop(0, 4, step, x)).lower(jnp.ones((1, 1, 128))).compile().as_text()
    assert "while" in hlo
    assert not re.search(r"= f32\[128,128\]", unfused_instructions(hlo))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_repack_equals_gguf_dequantize(type_name):
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType[type_name]
    w = np.random.default_rng(0).normal(size=(24, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)  # uint8 [24, 3 blocks * bytes]
    pt = repack(raw, type_name)
    stored = (np.int8, (24, 96)) if type_name == "Q8_0" else (np.uint8, (24, 48))  # 4-bit: two codes per byte
    assert (pt.codes.dtype, pt.codes.shape) == stored and pt.shape == (24, 96) and pt.scale.shape == (24, 3)
    np.testing.assert_array_equal(pt.dequantize(), gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("bits", [8, 4])
def test_round_to_nearest_error_bound(bits):
    w = np.random.default_rng(0).normal(size=(16, 128)).astype(np.float32)
    scheme = quant.Scheme(bits, 32 if bits == 4 else None)
    pt = quant.quantize(w, scheme)
    half_step = np.repeat(pt.scale, w.shape[1] // pt.scale.shape[1], axis=1) / 2
    err = np.abs(pt.dequantize() - w)
    assert (err <= half_step * (1 + 1e-6)).all()
    assert err.max() > 0.5 * half_step.max() * 0.1  # really quantised, not a copy


def test_bad_quantize_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^unsupported quantize='int3'; use None, 'int8', 'int4' or 'native'$"):
        jaxspec.load(tmp_path, quantize="int3")


def write_quantized_gguf(path, types, seed=0):
    """A tiny llama GGUF whose tensors are stored in `types` (llama.cpp part name -> GGML type name)."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(seed)
    V, H, F, L, nH, nKV = 64, 64, 96, 2, 4, 2
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in [(w.add_vocab_size, V), (w.add_context_length, 256), (w.add_embedding_length, H),
                   (w.add_block_count, L), (w.add_feed_forward_length, F), (w.add_head_count, nH),
                   (w.add_head_count_kv, nKV), (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 1e4)]:
        add(v)
    shapes = {"token_embd": (V, H), "attn_q": (H, H), "attn_k": (H // nH * nKV, H), "attn_v": (H // nH * nKV, H),
              "attn_output": (H, H), "ffn_gate": (F, H), "ffn_up": (F, H), "ffn_down": (H, F)}

    def add(name, part, shape):
        t = rng.normal(0, 0.3, shape).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[types.get(part, "F32")]
        data = gguf.quants.quantize(t, qtype) if qtype.name != "F32" else t
        w.add_tensor(name, data, raw_dtype=qtype if qtype.name != "F32" else None)

    add("token_embd.weight", "token_embd", shapes["token_embd"])
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.normal(size=H)).astype(np.float32))
    for i in range(L):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            add(f"blk.{i}.{part}.weight", part, shapes[part])
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.normal(size=H)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_native_gguf_keeps_blocks_packed(tmp_path):
    """Q8_0 / Q4_0 / Q4_1 stay packed (the tied embedding too), F16 stays float; logits equal the dequantised load."""
    types = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_1", "attn_output": "F16",
             "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q8_0"}
    write_quantized_gguf(tmp_path / "q.gguf", types)
    native = jaxspec.load(tmp_path / "q.gguf", quantize="native", tokenizer=False)
    ref = jaxspec.load(tmp_path / "q.gguf", tokenizer=False)
    m = native.module
    assert isinstance(m.embed_tokens, quant.Packed) and m.embed_tokens.bits == 8
    attn, mlp = m.layers[0].self_attn, m.layers[0].mlp
    assert isinstance(attn.q_proj.kernel, quant.Packed) and attn.q_proj.kernel.offset is None
    assert isinstance(attn.v_proj.kernel, quant.Packed) and attn.v_proj.kernel.offset is not None
    assert not isinstance(attn.o_proj.kernel, quant.Packed)
    assert isinstance(mlp.down_proj.kernel, quant.Packed) and mlp.down_proj.kernel.codes.shape == (64, 96)
    ids = np.random.default_rng(0).integers(0, 64, (2, 9))
    np.testing.assert_allclose(native.logits(ids), ref.logits(ids), rtol=0, atol=1e-4)
    assert quant.packed_bytes(native.params) < 0.45 * quant.packed_bytes(ref.params)


def dense_target():
    cfg = jaxspec.model.config_from_dict(dict(
        model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        max_position_embeddings=1024, eos_token_id=None, bos_token_id=None))
    m = jaxspec.random_model(cfg, seed=0)
    m.params = jax.tree.map(lambda x: x * 2.5, m.params)  # peaked logits: no greedy ties
    return m


def moe_target():
    cfg = deepseek_config_from_dict(dict(
        model_type="deepseek_v3", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, max_position_embeddings=1024, eos_token_id=None, bos_token_id=None))
    m = jaxspec.random_model(cfg, seed=0)
    m.params = jax.tree.map(lambda x: x * 2.5, m.params)
    return m


PROMPT = [int(t) for t in np.random.RandomState(0).randint(0, 128, 13)]


@pytest.mark.parametrize("family,quantize", [("dense", "int4"), ("dense", "int8"), ("moe", "int4")])
def test_speculative_on_packed_target_is_lossless(family, quantize):
    target = jaxspec.quantize_model(dense_target() if family == "dense" else moe_target(), quantize)
    m = target.module
    assert isinstance(m.embed_tokens, quant.Packed)
    if family == "moe":
        assert isinstance(m.layers[1].mlp.experts.gate_proj, quant.Packed)
        assert not isinstance(m.layers[1].mlp.gate.weight, quant.Packed)  # routers stay float
    ar = jaxspec.generate(target, input_ids=PROMPT, method="ar", max_new_tokens=48).token_ids
    d = oracle_drafter(target, PROMPT + ar, noise=0.3, max_rank=3)
    res = jaxspec.generate(target, input_ids=PROMPT, drafter=d, method="ddtree", budget=8, max_new_tokens=48)
    assert res.token_ids == ar
    assert res.stats["acceptance_length"] > 1.5
