"""The loading core and its tables: stacked experts, dtype handling (no float32 detour, packed integers
untouched), and every way a tensor can fail to fit. Handmade tiny modules, so no model family is needed."""
from __future__ import annotations

import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import jaxspec.model as jm
from jaxspec.checkpoint import (
    DENSE_HF_RULES,
    GGUF_ARCHS,
    Rule,
    WeightsError,
    linear_kernel,
    load_params,
    read_safetensors,
)
from jaxspec.checkpoint.packed import PackedTensor
from jaxspec.models import quant

L, E, H, F = 2, 4, 8, 16


class Proj(nnx.Module):
    def __init__(self, shape, dtype):
        self.kernel = nnx.Param(jnp.zeros(shape, dtype))


class Experts(nnx.Module):
    def __init__(self, dtype):
        self.gate_proj = Proj((E, H, F), dtype)  # [E, in, out]
        self.down_proj = Proj((E, F, H), dtype)


class MoE(nnx.Module):
    def __init__(self, dtype):
        self.router = Proj((H, E), dtype)
        self.experts = Experts(dtype)


class Layer(nnx.Module):
    def __init__(self, dtype):
        self.mlp = MoE(dtype)


class TinyMoE(nnx.Module):
    """layers.{i}.mlp.router.kernel [H, E] and layers.{i}.mlp.experts.{gate,down}_proj.kernel [E, in, out]."""

    def __init__(self, dtype=jnp.float32):
        self.layers = nnx.List([Layer(dtype) for _ in range(L)])


MOE_RULES = (
    Rule(r"model\.layers\.(\d+)\.mlp\.gate\.weight", "layers.{0}.mlp.router.kernel", linear_kernel),
    Rule(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|down_proj)\.weight",
         "layers.{0}.mlp.experts.{2}.kernel", linear_kernel, stack=1),
)


def moe_tensors(dtype=np.float32, seed=0) -> dict[str, np.ndarray]:
    """HF-style names and [out, in] shapes: one tensor per layer and expert."""
    rng = np.random.default_rng(seed)
    t = {}
    for i in range(L):
        t[f"model.layers.{i}.mlp.gate.weight"] = rng.standard_normal((E, H)).astype(dtype)
        for e in range(E):
            t[f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight"] = rng.standard_normal((F, H)).astype(dtype)
            t[f"model.layers.{i}.mlp.experts.{e}.down_proj.weight"] = rng.standard_normal((H, F)).astype(dtype)
    return t


def load_moe(tensors, dtype=jnp.float32, rules=MOE_RULES):
    items = tensors.items() if isinstance(tensors, dict) else tensors
    return load_params(lambda: TinyMoE(dtype), iter(items), rules)


def test_stacks_experts_from_safetensors(tmp_path):
    """Per-expert tensors (read interleaved: several stacks fill at once) land in slice e of [E, in, out]."""
    t = moe_tensors()
    save_file(t, str(tmp_path / "model.safetensors"))
    m = load_params(TinyMoE, read_safetensors(tmp_path), MOE_RULES)
    for i in range(L):
        experts = m.layers[i].mlp.experts
        np.testing.assert_array_equal(m.layers[i].mlp.router.kernel[...], t[f"model.layers.{i}.mlp.gate.weight"].T)
        for e in range(E):
            for p in ("gate_proj", "down_proj"):
                np.testing.assert_array_equal(getattr(experts, p).kernel[e],
                                              t[f"model.layers.{i}.mlp.experts.{e}.{p}.weight"].T,
                                              err_msg=f"{i} {e} {p}")


def test_missing_expert_slice():
    t = moe_tensors()
    del t["model.layers.1.mlp.experts.2.down_proj.weight"]
    with pytest.raises(WeightsError,
                       match=r"missing 1 tensor, e\.g\. 'layers\.1\.mlp\.experts\.down_proj\.kernel\[2\]'"):
        load_moe(t)


def test_bfloat16_loads_bit_exact_without_float32(tmp_path):
    """bf16 tensors reach bf16 parameters untouched. Signalling-NaN payloads prove no float32 round trip:
    bf16 -> f32 -> bf16 is exact for every number, but the conversion back quiets a signalling NaN."""
    t = moe_tensors(ml_dtypes.bfloat16)
    snan = np.array([0x7F81, 0xFF82, 0x7F83], np.uint16).view(ml_dtypes.bfloat16)
    with np.errstate(invalid="ignore"):
        detour = snan.astype(np.float32).astype(ml_dtypes.bfloat16)
    assert not np.array_equal(detour.view(np.uint16), snan.view(np.uint16))
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.3.gate_proj.weight"):
        t[name].reshape(-1)[:3] = snan
    save_file(t, str(tmp_path / "model.safetensors"))
    m = load_params(lambda: TinyMoE(jnp.bfloat16), read_safetensors(tmp_path), MOE_RULES)
    for i in range(L):
        mlp = m.layers[i].mlp
        assert mlp.router.kernel[...].dtype == jnp.bfloat16 and mlp.experts.gate_proj.kernel[...].dtype == jnp.bfloat16
        bits = lambda a: np.asarray(a).view(np.uint16)  # noqa: E731
        np.testing.assert_array_equal(bits(mlp.router.kernel[...]), bits(t[f"model.layers.{i}.mlp.gate.weight"].T))
        for e in range(E):
            np.testing.assert_array_equal(bits(mlp.experts.gate_proj.kernel[e]),
                                          bits(t[f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight"].T))


class Packed(nnx.Module):
    """An INT8-packed projection: integer rows [out, in/2] and a float scale per row."""

    def __init__(self):
        self.qweight = nnx.Param(jnp.zeros((4, 8), jnp.int8))
        self.scales = nnx.Param(jnp.zeros((4,), jnp.bfloat16))


PACKED_RULES = (Rule(r"proj\.qweight", "qweight"), Rule(r"proj\.scales", "scales"))


def test_packed_integer_parameter():
    q = np.arange(-128, 128, 8, dtype=np.int8).reshape(4, 8)
    s = np.array([0.5, 1, 2, 4], np.float32)
    m = load_params(Packed, iter([("proj.qweight", q), ("proj.scales", s)]), PACKED_RULES)
    assert m.qweight[...].dtype == jnp.int8 and m.scales[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(m.qweight[...], q)
    for bad in (q.astype(np.float32), q.astype(np.int32)):
        with pytest.raises(WeightsError, match=f"'proj.qweight' has dtype {bad.dtype}, but parameter qweight is int8"):
            load_params(Packed, iter([("proj.qweight", bad), ("proj.scales", s)]), PACKED_RULES)
    with pytest.raises(WeightsError, match="has dtype int8, but parameter scales is bfloat16"):
        load_params(Packed, iter([("proj.qweight", q), ("proj.scales", s.astype(np.int8))]), PACKED_RULES)


@pytest.mark.parametrize("name, shape, words", [
    ("model.layers.0.mlp.shared_expert.weight", (E, H), "unexpected tensor 'model.layers.0.mlp.shared_expert.weight'"),
    ("model.layers.2.mlp.gate.weight", (E, H), "unexpected tensor 'model.layers.2.mlp.gate.weight'"),  # 2 layers
    ("model.layers.0.mlp.experts.4.gate_proj.weight", (F, H),
     "is slice 4 of layers.0.mlp.experts.gate_proj.kernel, which has 4"),
    ("model.layers.0.mlp.experts.1.gate_proj.weight", (F, H), "both fill layers.0.mlp.experts.gate_proj.kernel[1]"),
    ("model.layers.0.mlp.experts.1.up_proj.weight", (F, H), "unexpected tensor"),
    ("model.layers.0.mlp.experts.0.down_proj.weight", (F, H), "has shape (8, 16), the config implies (16, 8)"),
])
def test_tensor_that_does_not_fit(name, shape, words):
    t = moe_tensors()  # the extra tensor comes after the full set
    with pytest.raises(WeightsError, match=re.escape(words)):
        load_moe([*t.items(), (name, np.zeros(shape, np.float32))])


def test_optional_target():
    """A rule whose target the module lacks is an error unless marked optional (then the tensor is ignored)."""
    t = {**moe_tensors(), "lm_head.weight": np.zeros((3, H), np.float32)}
    with pytest.raises(WeightsError, match="unexpected tensor 'lm_head.weight'"):
        load_moe(t, rules=(*MOE_RULES, Rule(r"lm_head\.weight", "lm_head.kernel", linear_kernel)))
    load_moe(t, rules=(*MOE_RULES, Rule(r"lm_head\.weight", "lm_head.kernel", linear_kernel, optional=True)))


class Fused(nnx.Module):
    """q, k [H, 2] and v [H, 4] kernels (or packed [out, H] int8 weights): one HF tensor's [q | k | v] rows."""

    def __init__(self, packed: bool = False):
        for name, out in (("q", 2), ("k", 2), ("v", 4)):
            proj = Proj((H, out), jnp.float32)
            if packed:
                proj.kernel = quant.Packed((out, H), ("out", "in"), quant.Scheme(8, None))
            setattr(self, name, proj)


FUSED_RULES = (Rule(r"qkv\.weight", ("q.kernel", "k.kernel", "v.kernel"), linear_kernel),)


def test_fused_tensor_fills_its_parameters_in_row_order():
    """A rule with several targets cuts the tensor's rows by their sizes (float, or packed codes and scales alike)
    and says so when they do not add up."""
    w = np.arange(8 * H, dtype=np.float32).reshape(8, H)
    m = load_params(Fused, iter([("qkv.weight", w)]), FUSED_RULES)
    for name, rows in (("q", w[:2]), ("k", w[2:4]), ("v", w[4:])):
        np.testing.assert_array_equal(getattr(m, name).kernel[...], rows.T)
    codes, scale = w.astype(np.int8), np.arange(8, dtype=np.float32)[:, None]
    m = load_params(lambda: Fused(packed=True), iter([("qkv.weight", PackedTensor(codes, scale))]), FUSED_RULES)
    for name, rows in (("q", slice(0, 2)), ("k", slice(2, 4)), ("v", slice(4, 8))):
        np.testing.assert_array_equal(getattr(m, name).kernel.codes[...], codes[rows])
        np.testing.assert_array_equal(getattr(m, name).kernel.scale[...], scale[rows])
    with pytest.raises(WeightsError, match=re.escape("shape (9, 8), but the parameters it fills take 2 + 2 + 4 rows")):
        load_params(Fused, iter([("qkv.weight", np.zeros((9, H), np.float32))]), FUSED_RULES)


# ------------------------------------------------------------------------------------------ dense table


def _rewrite(src, dst, rename, extra=()):
    """Copy a safetensors checkpoint under new names, plus extra (name, array) pairs."""
    import shutil

    t = {rename(k): v for k, v in read_safetensors(src)}
    t.update(extra)
    shutil.copytree(src, dst)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_dense_multimodal_names(tiny_hf, tmp_path):
    """The language model under model.language_model., a vision tower and RoPE buffers beside it: same params."""
    _, path = tiny_hf("llama")
    z = np.zeros((4, 4), np.float32)
    mm = _rewrite(path, tmp_path / "mm", lambda k: k.replace("model.", "model.language_model.", 1),
                  [("model.vision_tower.encoder.weight", z), ("multi_modal_projector.linear.weight", z),
                   ("model.language_model.layers.0.self_attn.rotary_emb.inv_freq", z[0])])
    a, b = dict(nnx.to_flat_state(jm.load(mm).plain_params())), dict(nnx.to_flat_state(jm.load(path).plain_params()))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k][...], b[k][...], err_msg=str(k))


def test_dense_tied_head_ignored_and_unknown_tensor_reported(tiny_hf, tmp_path):
    _, path = tiny_hf("qwen3")  # tied: the module has no lm_head, an exported copy is ignored
    emb = dict(read_safetensors(path))["model.embed_tokens.weight"]
    jm.load(_rewrite(path, tmp_path / "tied", str, [("lm_head.weight", emb)]))
    odd = _rewrite(path, tmp_path / "odd", str, [("model.layers.0.mlp.w3.weight", emb)])
    with pytest.raises(WeightsError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.w3\.weight'"):
        jm.load(odd)


def test_dense_rules_cover_only_known_kinds():
    """No catch-all: every HF layer tensor kind has its own rule, anything else matches none."""
    def target(name):
        for r in DENSE_HF_RULES:
            if m := re.fullmatch(r.pattern, name):
                return r.target and r.target.format(*m.groups())
        return "<none>"

    assert target("model.layers.3.self_attn.k_proj.weight") == "layers.3.self_attn.k_proj.kernel"
    assert target("language_model.model.layers.3.mlp.down_proj.bias") == "layers.3.mlp.down_proj.bias"
    assert (target("model.language_model.layers.0.pre_feedforward_layernorm.weight")
            == "layers.0.pre_feedforward_layernorm.weight")
    assert target("language_model.lm_head.weight") == "lm_head.kernel"
    assert target("model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight") is None
    for odd in ("model.layers.0.mlp.fc1.weight", "model.layers.0.self_attn.qkv_proj.weight", "embed_tokens.weight"):
        assert target(odd) == "<none>", odd


# ------------------------------------------------------------------------------------------- GGUF table


def test_gguf_tables():
    llama, gemma = GGUF_ARCHS["llama"], GGUF_ARCHS["gemma3"]
    assert gemma.model_type == "gemma3_text"
    assert llama.hf_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    assert gemma.hf_name("blk.2.ffn_norm.weight") == "model.layers.2.pre_feedforward_layernorm.weight"
    assert gemma.hf_name("output_norm.weight") == "model.norm.weight" and gemma.hf_name("rope_freqs.weight") is None
    w = np.full((4,), 1.25, np.float32)
    np.testing.assert_array_equal(gemma.fix("output_norm.weight", w, {}), w - 1)
    np.testing.assert_array_equal(gemma.fix("blk.0.attn_k_norm.weight", w, {}), w - 1)
    np.testing.assert_array_equal(llama.fix("output_norm.weight", w, {}), w)
    q = np.arange(8.0)[:, None]  # 2 heads of 4 rows: llama.cpp interleaves each head's rotary halves
    np.testing.assert_array_equal(llama.fix("blk.0.attn_q.weight", q, {"num_attention_heads": 2})[:, 0],
                                  [0, 2, 1, 3, 4, 6, 5, 7])
    for bad in ("blk.0.attn_qkv.weight", "attn_q.weight", "blk.0.output.weight"):
        with pytest.raises(WeightsError, match=f"unexpected GGUF tensor {bad}"):
            gemma.hf_name(bad)
