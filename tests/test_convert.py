"""`python -m checkpoints_convert`: HF (sharded) and GGUF checkpoints -> Orbax -> `jaxspec.load` gives the same
logits and tokens as loading the source directly, on one device and on a dp 2 x tp 4 mesh; `--quantize` keeps
the packed weights bitwise as `jaxspec.load(SRC, quantize=)` holds them, and packed models generate on a mesh
as on one device; bad inputs give one `error:` line, exit status 2 and leave nothing behind; host memory stays
near the largest tensor; the source's dtype is kept unless --dtype says otherwise, and recorded; SIGINT / SIGTERM
stop a conversion (even raised inside a callback that swallows exceptions) and leave nothing, and the folder
a SIGKILL leaves is removed by the next conversion into OUT (or named, if its conversion still runs)."""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxspec
from checkpoints_convert import convert
from checkpoints_convert.__main__ import main
from jaxspec.checkpoint import WeightsError
from jaxspec.checkpoint.orbax import read_dtype
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
    out = convert(tmp_path / "tiny.gguf", tmp_path / "out", "bfloat16", progress=False)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert read_dtype(out) == "bfloat16" and stored_dtypes(out) == {"bfloat16"}
    direct = jaxspec.load(tmp_path / "tiny.gguf", "bfloat16", tokenizer=False)
    restored = jaxspec.load(out, "bfloat16")
    assert restored.dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(restored.logits(IDS), direct.logits(IDS))
    assert jaxspec.load(out).dtype == jax.numpy.bfloat16  # dtype="auto": the converted dtype, even on a CPU


def test_auto_dtype(tiny_hf, monkeypatch):
    """dtype="auto" is float32 on a CPU and bfloat16 on an accelerator (a 27B target in float32 fills an H100)."""
    from jaxspec.model import auto_dtype

    _, path = tiny_hf("llama")
    assert jaxspec.load(path, tokenizer=False).dtype == jax.numpy.float32
    assert auto_dtype(jaxspec.make_mesh(tp=2)) == "float32"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert auto_dtype() == "bfloat16"


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
    placed = lambda x, spec: x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)  # noqa: E731
    assert placed(down["codes"][...], P(None, "tp"))  # the layout may name tp's devices (tp_kv, tp_rep)
    assert placed(down["scale"][...], P(None, None) if quantize == "int8" else P(None, "tp"))
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


def _config_with_more_layers(d, n=3):
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": n}))


def _config_with_a_million_layers(d):  # built a layer at a time, this would seem to hang
    _config_with_more_layers(d, 10**6)


@pytest.mark.parametrize("damage, words", [
    (_corrupt_header, "invalid header"),
    (_missing_shard, "listed in the index is missing"),
    (_fp8_e5m2_tensor, "has dtype F8_E5M2, which jaxspec does not read"),
    (_config_with_more_layers, "says num_hidden_layers 3, but the checkpoint's tensors fill 2 layers"),
    (_config_with_a_million_layers, "says num_hidden_layers 1000000, but the checkpoint's tensors fill 2 layers"),
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


def stored_dtypes(out) -> set[str]:
    """The dtypes of the parameters as written in OUT's Orbax checkpoint."""
    import orbax.checkpoint.experimental.v1 as ocp

    return {str(m.dtype) for m in ocp.metadata(out / "params").metadata.values()}


def _bf16_source(path, keep_f32: str | None = None):
    """The tiny Llama saved in bfloat16 (one module's parameters, `keep_f32`, left in float32)."""
    import torch

    from conftest import build_tiny_hf

    hf = build_tiny_hf("llama").to(torch.bfloat16)
    if keep_f32 is not None:
        hf.get_submodule(keep_f32).float()
    hf.save_pretrained(path)
    return path


@pytest.mark.parametrize("source, flags, want", [
    ("float32", [], "float32"),
    ("bfloat16", [], "bfloat16"),
    ("mixed", [], "float32"),  # a float32 norm in a bfloat16 checkpoint: float32 keeps it exact
    ("gguf", [], "float32"),
    ("float32", ["--dtype", "bfloat16"], "bfloat16"),
    ("bfloat16", ["--dtype", "float32"], "float32"),
])
def test_default_dtype_is_the_sources(sharded, tiny_hf, tmp_path, capsys, source, flags, want):
    """Without --dtype the parameters keep the source's dtype (a float32 source restores its exact logits, no
    bfloat16 rounding); --dtype overrides; the success line and packing.json say which dtype was written."""
    if source == "float32":
        src = sharded
    elif source == "gguf":
        from test_weights import write_llama_gguf

        src = tmp_path / "tiny.gguf"
        write_llama_gguf(tiny_hf("llama")[0], src)
    else:
        src = _bf16_source(tmp_path / "src", "model.norm" if source == "mixed" else None)
    out = tmp_path / "out"
    assert main([str(src), str(out), "--quiet", *flags]) == 0
    assert f"wrote {out} ({want} parameters); load it with" in capsys.readouterr().out
    assert read_dtype(out) == want and stored_dtypes(out) == {want}
    direct, restored = jaxspec.load(src, want, tokenizer=False), jaxspec.load(out, want)
    np.testing.assert_array_equal(restored.logits(IDS), direct.logits(IDS))


def test_load_restores_the_recorded_dtype(tmp_path):
    out = convert(_bf16_source(tmp_path / "src"), tmp_path / "out", progress=False)
    assert jaxspec.load(out).dtype == jax.numpy.bfloat16


@pytest.mark.parametrize("old", ["no_packing_file", "no_dtype_field"])
def test_old_converted_dirs_load_as_before(converted, packed_int8, tmp_path, old):
    """Directories converted before the dtype was recorded (no packing.json, or one without "dtype") load as
    before: float32 unless dtype= says otherwise."""
    out = tmp_path / "out"
    shutil.copytree(converted if old == "no_packing_file" else packed_int8, out)
    f = out / "packing.json"
    if old == "no_packing_file":
        f.unlink(missing_ok=True)
    else:
        f.write_text(json.dumps({k: v for k, v in json.loads(f.read_text()).items() if k != "dtype"}))
    assert read_dtype(out) is None
    assert jaxspec.load(out, tokenizer=False).dtype == jax.numpy.float32
    assert jaxspec.load(out, "bfloat16", tokenizer=False).dtype == jax.numpy.bfloat16


# The converter in a fresh process, each parameter written `delay` seconds late (so a signal lands mid-way);
# "swallowed": the third parameter runs Python from a destructor (as a callback from C such as JAX's or a
# thread pool's), which sends SIGTERM and keeps running bytecode there, so a handler that raises does so where
# the exception is printed and ignored.
RUN = textwrap.dedent("""
    import importlib, os, signal, sys, time
    from checkpoints_convert.__main__ import main
    c = importlib.import_module("checkpoints_convert.convert")  # the package's `convert` is the function
    how, delay = sys.argv[1], float(sys.argv[2])
    write, n = c._ParamWriter.__call__, [0]

    class Callback:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            end = time.time() + 1.0
            while time.time() < end:  # the handler runs here, inside the destructor
                pass

    def slow(self, arr, var, path):
        n[0] += 1
        if how == "swallowed" and n[0] == 3:
            Callback()
        time.sleep(delay)
        return write(self, arr, var, path)

    c._ParamWriter.__call__ = slow
    sys.exit(main(sys.argv[3:]))
""")


def _start(how, delay, src, out):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, "-c", RUN, how, str(delay), str(src), str(out), "--quiet",
                             "--dtype", "float32"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_temporary(p, where, timeout=120):
    """The conversion's temporary folder, once its first parameter is written."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and p.poll() is None:
        tmp = [d for d in where.iterdir() if d.name.endswith(".converting") and set(os.listdir(d)) - {".lock"}]
        if tmp:
            return tmp[0]
        time.sleep(0.02)
    p.kill()
    pytest.fail(f"no temporary folder appeared (exit {p.poll()}): {p.communicate()[1][-2000:]}")


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "swallowed"])
def test_signal_stops_and_leaves_nothing(sharded, tmp_path, how):
    """SIGINT / SIGTERM stop the conversion within a tensor or two, with one `error: interrupted` line and
    status 128 + signal, no OUT and no temporary folder; a SIGTERM whose handler runs inside a callback that
    swallows exceptions stops it too."""
    out = tmp_path / "out"
    p = _start(how, 0.1, sharded, out)
    signum = signal.SIGTERM
    if how != "swallowed":
        _wait_for_temporary(p, tmp_path)
        signum = getattr(signal, how)
        p.send_signal(signum)
    sent = time.monotonic()
    try:
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 128 + signum, err[-2000:]
    assert time.monotonic() - sent < 60 or how == "swallowed"
    assert err.strip().splitlines()[-1] == f"error: interrupted by {signal.Signals(signum).name}; {out} was not written"
    assert "Traceback" not in err, err[-2000:]
    assert os.listdir(tmp_path) == []


def test_sigkill_leftover_removed_by_next_run(sharded, tmp_path, capfd):
    """A SIGKILL leaves the temporary folder; the next conversion into the same OUT removes it (its lock is
    free), says so, and finishes with nothing else beside OUT."""
    out = tmp_path / "out"
    p = _start("slow", 0.3, sharded, out)
    left = _wait_for_temporary(p, tmp_path)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=60)
    assert left.is_dir() and f".out.{p.pid}." in left.name
    capfd.readouterr()
    assert main([str(sharded), str(out), "--quiet", "--dtype", "float32"]) == 0
    assert f"note: removed {left}, left by an interrupted conversion (pid {p.pid})" in capfd.readouterr().err
    assert os.listdir(tmp_path) == ["out"] and not (out / ".lock").exists()


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_stale_temporary_folders(sharded, tmp_path, capfd):
    """Only OUT's own temporary folders whose process is gone are removed: a free lock, or no lock and a dead
    pid (a ".old" folder of --force too); a folder whose pid still runs but has no lock yet, another OUT's and
    one not named by this converter stay. A folder still locked is a conversion at work: refused, named."""
    dead, me = _dead_pid(), os.getpid()
    names = {f".out.{dead}.a1.converting": True, f".out.{dead}.b2.old": False, f".out.{me}.c3.converting": False,
             f".other.{dead}.d4.converting": True, ".out.e5f6g7h8.converting": False, f".out.{me}.h9.converting": True}
    for name, locked in names.items():
        (tmp_path / name).mkdir()
        if locked:
            (tmp_path / name / ".lock").touch()
    out = tmp_path / "out"

    held = os.open(tmp_path / f".out.{me}.h9.converting" / ".lock", os.O_RDWR)  # a conversion at work
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        assert main([str(sharded), str(out), "--quiet", "--dtype", "float32"]) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert err[-1] == (f"error: another conversion into {out} is running (pid {me}, writing "
                           f"{tmp_path / f'.out.{me}.h9.converting'}); wait for it or stop it")
    finally:
        os.close(held)
    assert main([str(sharded), str(out), "--quiet", "--dtype", "float32"]) == 0
    stay = {f".out.{me}.c3.converting", f".other.{dead}.d4.converting", ".out.e5f6g7h8.converting"}
    assert set(os.listdir(tmp_path)) == stay | {"out"}
