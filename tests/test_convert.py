"""`python -m checkpoints_convert`: HF (sharded) and GGUF checkpoints -> Orbax -> `jaxspec.load` gives the same
logits and tokens as loading the source directly, on one device and on a dp 2 x tp 4 mesh; `--quantize` keeps
the packed weights bitwise as `jaxspec.load(SRC, quantize=)` holds them, and packed models generate on a mesh
as on one device; bad inputs give one `error:` line, exit status 2 and leave nothing behind; host memory stays
near the largest tensor."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxspec
from checkpoints_convert import convert
from checkpoints_convert.__main__ import main
from jaxspec.checkpoint import WeightsError
from jaxspec.models import quant
from jaxspec.plan import main as plan_main
from jaxspec.testing import oracle_drafter

IDS = np.random.default_rng(0).integers(0, 128, (2, 9))
PROMPT = [int(t) for t in np.random.RandomState(1).randint(0, 64, 11)]  # below every test model's vocabulary
NEW = 24


@pytest.fixture(scope="module")
def sharded(tiny_hf, tmp_path_factory):
    """The tiny random Llama saved in several safetensors shards with an index."""
    hf, _ = tiny_hf("llama")
    path = tmp_path_factory.mktemp("sharded") / "src"
    hf.save_pretrained(path, max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) > 2 and (path / "model.safetensors.index.json").is_file()
    return path


@pytest.fixture(scope="module")
def converted(sharded):
    return convert(sharded, sharded.parent / "out", "float32", progress=False)


def test_round_trip_logits_and_tokens(sharded, converted):
    direct, restored = jaxspec.load(sharded), jaxspec.load(converted)
    np.testing.assert_array_equal(restored.logits(IDS), direct.logits(IDS))
    mesh = jaxspec.make_mesh(tp=4, dp=2)
    direct_m, restored_m = jaxspec.load(sharded, mesh=mesh), jaxspec.load(converted, mesh=mesh)
    want = jax.tree.leaves(restored_m.layout.param_shardings(restored_m.params))
    for leaf, sharding in zip(jax.tree.leaves(restored_m.params), want, strict=True):  # straight into the shards
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.shape, leaf.sharding, sharding)
    np.testing.assert_array_equal(restored_m.logits(IDS), direct_m.logits(IDS))
    np.testing.assert_allclose(restored_m.logits(IDS), direct.logits(IDS), atol=1e-5)
    gen = lambda m: jaxspec.generate(m, input_ids=IDS[0].tolist(), method="ar", max_new_tokens=12).token_ids  # noqa: E731
    assert gen(restored) == gen(direct) == gen(restored_m)


def test_gguf_round_trip_bfloat16(tiny_hf, tmp_path):
    from test_weights import write_llama_gguf

    hf, _ = tiny_hf("llama")
    write_llama_gguf(hf, tmp_path / "tiny.gguf")
    out = convert(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)  # default dtype: bfloat16
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    direct = jaxspec.load(tmp_path / "tiny.gguf", "bfloat16", tokenizer=False)
    restored = jaxspec.load(out, "bfloat16")
    assert restored.dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(restored.logits(IDS), direct.logits(IDS))


@pytest.fixture(scope="module")
def kimi_int4(tmp_path_factory):
    """A tiny Kimi whose routed experts are compressed-tensors pack-quantized INT4."""
    from safetensors.numpy import save_file

    from test_compressed_tensors import QUANT, pack_int4, quantize
    from test_deepseek import build_hf

    tmp_path = tmp_path_factory.mktemp("kimi")
    build_hf("kimi").save_pretrained(tmp_path / "hf")
    src = tmp_path / "int4"
    src.mkdir()
    packed = {}
    for name, w in _tensors(tmp_path / "hf").items():
        if ".mlp.experts." not in name:
            packed[name] = w
            continue
        q, scale = quantize(w)
        p = name.removesuffix(".weight")
        packed.update({f"{p}.weight_packed": pack_int4(q), f"{p}.weight_scale": scale,
                       f"{p}.weight_shape": np.asarray(w.shape, np.int64)})
    save_file(packed, str(src / "model.safetensors"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "quantization_config": QUANT}))
    return src


def test_compressed_tensors_int4_round_trip(kimi_int4, tmp_path):
    """Kimi-shaped INT4 experts (compressed-tensors pack-quantized) are dequantised once, by the converter: the
    converted model equals loading the INT4 checkpoint directly, and its config no longer claims INT4."""
    out = convert(kimi_int4, tmp_path / "out", "float32", progress=False)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    np.testing.assert_array_equal(jaxspec.load(out).logits(IDS), jaxspec.load(kimi_int4, tokenizer=False).logits(IDS))


def test_compressed_tensors_int4_stays_packed(kimi_int4, tmp_path):
    """With --quantize native the INT4 experts are written packed, as `load(SRC, quantize="native")` holds
    them, and OUT's config keeps the quantization_config that describes them."""
    out = convert(kimi_int4, tmp_path / "out", "float32", quantize="native", progress=False)
    assert "quantization_config" in json.loads((out / "config.json").read_text())
    restored = jaxspec.load(out)
    assert isinstance(restored.module.layers[1].mlp.experts.gate_proj, quant.Packed)
    assert_same_params(restored, jaxspec.load(kimi_int4, tokenizer=False, quantize="native"))


def assert_same_params(a, b):
    """The same module (which weights are packed, and how) with bitwise-equal parameters of the same dtypes."""
    assert a.graphdef == b.graphdef
    fa, fb = (jax.tree_util.tree_flatten_with_path(m.params)[0] for m in (a, b))
    assert [k for k, _ in fa] == [k for k, _ in fb]
    for (k, x), (_, y) in zip(fa, fb):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(k)


def greedy(model) -> list[int]:
    return jaxspec.generate(model, input_ids=PROMPT, method="ar", max_new_tokens=NEW).token_ids


@pytest.fixture(scope="module")
def packable(tmp_path_factory):
    """A tiny random Llama with 8 q / 4 KV heads, saved as HF: K/V split by head on tp = 4 and stay whole on
    tp = 8; its down_proj's 128 inputs are 4 int4 groups, split with their codes on tp = 4 and replicated on 8."""
    from conftest import build_tiny_hf

    path = tmp_path_factory.mktemp("packable") / "src"
    build_tiny_hf("llama", num_attention_heads=8, num_key_value_heads=4).save_pretrained(path)
    return path


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_packed_round_trip(packable, tmp_path, quantize):
    """--quantize int8 / int4: OUT restores, without being told, the packed module `load(SRC, quantize=)` builds,
    codes and scales bitwise equal, and generates the same greedy tokens; another quantize is refused."""
    out = tmp_path / "out"
    assert main([str(packable), str(out), "--dtype", "float32", "--quantize", quantize, "--quiet"]) == 0
    direct, restored = jaxspec.load(packable, quantize=quantize), jaxspec.load(out)
    assert isinstance(restored.module.layers[0].mlp.down_proj.kernel, quant.Packed)
    assert_same_params(restored, direct)
    assert greedy(restored) == greedy(direct)
    jaxspec.load(out, quantize=quantize)  # the quantize it was converted with is no contradiction
    other = "int4" if quantize == "int8" else "int8"
    with pytest.raises(ValueError, match=rf"^{re.escape(str(out))} is a converted checkpoint, restored as stored "
                                         rf"\(quantize='{quantize}'\); quantize='{other}' applies to HF directories"):
        jaxspec.load(out, quantize=other)


@pytest.fixture(scope="module")
def packed_int8(packable):
    """`packable` converted with --quantize int8, once: tests that damage it work on a copy."""
    return convert(packable, packable.parent / "int8", "float32", quantize="int8", progress=False)


@pytest.mark.parametrize("text", [
    "{not json",
    json.dumps({"quantize": "int8"}),  # no schemes
    json.dumps({"quantize": "int8", "schemes": {"embed_tokens": {"group": None}}}),  # a Scheme without bits
    json.dumps({"quantize": "int8", "schemes": []}),
])
def test_damaged_packing(packed_int8, tmp_path, capsys, text):
    """A damaged packing.json (the plan of packed parameters, which config.json cannot replace) is one line that
    names the file and says to convert again, from jaxspec.load and from the planner, never a traceback."""
    out = tmp_path / "out"
    shutil.copytree(packed_int8, out)
    (out / "packing.json").write_text(text)
    with pytest.raises(WeightsError) as e:
        jaxspec.load(out, tokenizer=False)
    msg = str(e.value)
    assert msg.startswith(f"{out / 'packing.json'} is damaged") and msg.endswith("; convert the model again"), msg
    assert "\n" not in msg
    assert plan_main([str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {msg}"


def test_native_gguf_round_trip(tmp_path):
    """--quantize native on a GGUF: Q8_0 / Q4_0 / Q4_1 blocks (Q4_1's offsets too) stay packed, F16 float,
    bitwise as `load(gguf, quantize="native")` holds them, with the same greedy tokens."""
    from test_quant import write_quantized_gguf

    types = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_1", "attn_output": "F16",
             "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q8_0"}
    write_quantized_gguf(tmp_path / "q.gguf", types)
    out = convert(tmp_path / "q.gguf", tmp_path / "out", "float32", quantize="native", progress=False)
    direct, restored = jaxspec.load(tmp_path / "q.gguf", quantize="native", tokenizer=False), jaxspec.load(out)
    attn = restored.module.layers[0].self_attn
    assert attn.v_proj.kernel.offset is not None and not isinstance(attn.o_proj.kernel, quant.Packed)
    assert_same_params(restored, direct)
    assert greedy(restored) == greedy(direct)


@pytest.mark.parametrize("quantize, tp, dp", [("int8", 8, 1), ("int4", 4, 2)])
def test_packed_on_mesh(packable, tmp_path, quantize, tp, dp):
    """A packed model loaded into a mesh, from the source and from its conversion, lies on its shards (codes
    split like the float kernel; int8's per-output scales of an input-split kernel replicated, int4's group
    scales split with their codes where the groups divide) and generates the same greedy AR and DDTree
    tokens as the packed model on one device."""
    one = jaxspec.load(packable, quantize=quantize)
    mesh = jaxspec.make_mesh(tp=tp, dp=dp)
    sharded = jaxspec.load(packable, quantize=quantize, mesh=mesh)
    out = convert(packable, tmp_path / "out", "float32", quantize=quantize, progress=False)
    restored = jaxspec.load(out, mesh=mesh)
    for m in (sharded, restored):
        want = jax.tree.leaves(m.layout.param_shardings(m.params))
        for leaf, sharding in zip(jax.tree.leaves(m.params), want, strict=True):
            assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.shape, leaf.sharding, sharding)
    down = sharded.params["layers"][0]["mlp"]["down_proj"]["kernel"]
    assert down["codes"][...].sharding.spec == P(None, "tp")
    assert down["scale"][...].sharding.spec == (P(None, None) if quantize == "int8" else P(None, "tp"))
    assert_same_params(restored, sharded)

    ar = greedy(one)
    assert len(set(ar)) > 8  # varied tokens, not one repeated
    assert greedy(sharded) == greedy(restored) == ar
    ddtree = lambda m: jaxspec.generate(  # noqa: E731
        m, input_ids=PROMPT, drafter=oracle_drafter(m, PROMPT + ar, noise=0.3, block_size=5), method="ddtree",
        budget=8, max_new_tokens=NEW)
    r_one, r_sharded = ddtree(one), ddtree(sharded)
    assert r_sharded.token_ids == r_one.token_ids == ar and r_sharded.stats["acceptance_length"] > 2.0


def _tensors(model_dir):
    from jaxspec.checkpoint import read_safetensors

    return dict(read_safetensors(model_dir))


def test_force_replaces_out(sharded, tmp_path, capfd):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    assert main([str(sharded), str(out), "--dtype", "float32", "--quiet", "--force"]) == 0
    assert not (out / "stale.txt").exists() and (out / "params").is_dir()
    assert sorted(os.listdir(tmp_path)) == ["out"]


def _header_rewrite(f, edit):
    """Rewrite a safetensors file's JSON header with `edit(header)`, keeping the data bytes."""
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    f.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


def _corrupt_header(d):
    f = sorted(d.glob("*.safetensors"))[1]
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" + f.read_bytes()[40:])


def _missing_shard(d):
    sorted(d.glob("*.safetensors"))[-1].unlink()


def _fp8_e5m2_tensor(d):
    def edit(h):
        name = next(k for k in h if k != "__metadata__")
        h[name]["dtype"] = "F8_E5M2"  # E4M3 (DeepSeek-V3's, with block scales) is read; E5M2 is not
    _header_rewrite(sorted(d.glob("*.safetensors"))[0], edit)


def _config_with_more_layers(d):
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))


@pytest.mark.parametrize("damage, words", [
    (_corrupt_header, "invalid header"),
    (_missing_shard, "listed in the index is missing"),
    (_fp8_e5m2_tensor, "has dtype F8_E5M2, which jaxspec does not read"),
    (_config_with_more_layers, "checkpoint is missing 9 tensors, e.g. 'layers.2.input_layernorm.weight'"),
])
def test_bad_checkpoint(sharded, tmp_path, capfd, damage, words):
    src = tmp_path / "src"
    shutil.copytree(sharded, src)
    damage(src)
    before = sorted(os.listdir(tmp_path))
    assert main([str(src), str(tmp_path / "out"), "--quiet"]) == 2
    err = capfd.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and words in err, err
    assert sorted(os.listdir(tmp_path)) == before  # no OUT, no temporary folder


@pytest.mark.parametrize("case, words", [
    ("out_exists", "already exists; pass --force"),
    ("src_missing", "does not exist"),
    ("bad_dtype", "unsupported --dtype 'float16'"),
    ("bad_quantize", "unsupported --quantize 'int3'; use int8, int4 or native"),
    ("native_without_packing", "quantize='native' keeps a checkpoint's own packing"),
])
def test_bad_arguments(sharded, tmp_path, capfd, case, words):
    out = tmp_path / "out"
    if case == "out_exists":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    src = tmp_path / "nope" if case == "src_missing" else sharded
    before = sorted(os.listdir(tmp_path))
    flags = {"bad_dtype": ["--dtype", "float16"], "bad_quantize": ["--quantize", "int3"],
             "native_without_packing": ["--quantize", "native"]}.get(case, [])
    assert main([str(src), str(out), "--dtype", "float32", *flags]) == 2
    err = capfd.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and words in err, err
    assert sorted(os.listdir(tmp_path)) == before
    if case == "out_exists":
        assert (out / "keep.txt").read_text() == "mine"


# Peak host memory. The conversion runs in a fresh process, which resets its RSS high-water mark (VmHWM,
# through /proc/self/clear_refs) after its imports and reads it when done: exact (no sampling) and counting
# everything the process holds (numpy, tensorstore, Orbax, the reader). FIXED is what a conversion costs beyond
# its tensors, measured at 20-30 MiB here (56 MiB for a first conversion of a 16 MiB-tensor model): Orbax's and
# tensorstore's thread pools, contexts and caches, and tracing the abstract module.
FIXED = 48 << 20
MEASURE = textwrap.dedent("""
    import json, re, sys
    import checkpoints_convert, orbax.checkpoint.experimental.v1, transformers.models.llama.configuration_llama
    status = lambda k: int(re.search(rf"{k}:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) << 10
    open("/proc/self/clear_refs", "w").write("5")
    base = status("VmRSS")
    checkpoints_convert.convert(sys.argv[1], sys.argv[2], "float32", progress=False)
    print(json.dumps({"above_start": status("VmHWM") - base}))
""")


def test_peak_memory_near_largest_tensor(tmp_path):
    """A 4-shard float32 Llama of 272 MiB whose largest tensors (embedding, head) are 96 MiB each."""
    from safetensors.numpy import save_file

    V, H, F, L = 24576, 1024, 2048, 2
    shapes = {"model.embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "model.norm.weight": (H,)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + f"self_attn.{x}_proj.weight": (H, H) for x in "qkvo"})
        shapes.update({p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
                       p + "mlp.down_proj.weight": (H, F), p + "input_layernorm.weight": (H,),
                       p + "post_attention_layernorm.weight": (H,)})
    src = tmp_path / "src"
    src.mkdir()
    rest, weight_map = list(shapes)[2:], {}
    # the two largest tensors side by side in one shard: holding one while reading the next would show
    for s, names in enumerate([["model.embed_tokens.weight", "lm_head.weight"], rest[0::3], rest[1::3], rest[2::3]]):
        f = f"model-{s + 1:05d}-of-00004.safetensors"
        save_file({n: np.full(shapes[n], 0.01, np.float32) for n in names}, str(src / f))
        weight_map.update(dict.fromkeys(names, f))
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=F, num_hidden_layers=L,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64, tie_word_embeddings=False)))
    largest = max(int(np.prod(s)) for s in shapes.values()) * 4
    total = sum(int(np.prod(s)) for s in shapes.values()) * 4
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", MEASURE, str(src), str(tmp_path / "out")], capture_output=True,
                       text=True, env=env, check=True)
    peak = json.loads(r.stdout.strip().splitlines()[-1])["above_start"]
    print(f"peak {peak / 2**20:.1f} MiB above start; largest tensor {largest / 2**20:.0f} MiB, "
          f"checkpoint {total / 2**20:.0f} MiB; "
          f"bound 1.5 x largest + {FIXED >> 20} MiB = {(1.5 * largest + FIXED) / 2**20:.0f} MiB")
    assert peak <= 1.5 * largest + FIXED
