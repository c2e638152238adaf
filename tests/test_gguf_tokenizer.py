"""A GGUF's tokenizer without torch (jaxspec.checkpoint.gguf_tokenizer): the same tokenizer as transformers'
GGUF loader (which imports torch, so the comparisons need it) on the bundled SmolLM2 and on tiny GGUFs of each
tokenizer kind of jaxspec's GGUF architectures, and `jaxspec.load` of the bundled model in a process where
torch cannot be imported."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jaxspec.model as jm
from jaxspec.checkpoint.gguf_tokenizer import gguf_tokenizer, read_tokenizer_fields

TEXTS = [
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "Héllo wörld, naïve café: 日本語のテキスト, Ελληνικά, русский, العربية",
    "emoji 👋🏽 👨‍👩‍👧‍👦 🇫🇷 ✨🚀",
    "  two\tspaces\n\n\nthree   \t  \r\n end   ",
    " leading space, trailing space ",
    "def f(x):\n    return x ** 2  # ok",
    "<|im_start|>user\nHi<|im_end|> <think>",
    "",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[1] + " " + TEXTS[2]}]


def reference(path: Path):
    """transformers' own tokenizer of the GGUF (its reader imports torch)."""
    pytest.importorskip("torch", reason="the reference GGUF tokenizer of transformers needs torch")
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def assert_same(tok, want, chat: bool = True):
    assert type(tok) is type(want)
    for text in TEXTS:
        ids = want(text)["input_ids"]
        assert tok(text)["input_ids"] == ids, text
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == want.decode(ids, skip_special_tokens=skip)
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    assert [getattr(tok, n) for n in names] == [getattr(want, n) for n in names]
    assert [getattr(tok, f"{n}_id") for n in names] == [getattr(want, f"{n}_id") for n in names]
    assert (tok.all_special_tokens, tok.all_special_ids) == (want.all_special_tokens, want.all_special_ids)
    assert tok.get_vocab() == want.get_vocab() and len(tok) == len(want)
    assert tok.chat_template == want.chat_template
    if chat:
        kw = dict(add_generation_prompt=True)
        assert tok.apply_chat_template(CHAT, tokenize=False, **kw) == want.apply_chat_template(CHAT, tokenize=False,
                                                                                                **kw)
        got = tok.apply_chat_template(CHAT, return_dict=True, **kw)["input_ids"]
        assert got == want.apply_chat_template(CHAT, return_dict=True, **kw)["input_ids"]


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_gguf):
    return gguf_tokenizer(Path(smollm2_gguf))


def test_smollm2_fields(smollm2_gguf):
    arch, fields, config = read_tokenizer_fields(Path(smollm2_gguf))
    assert (arch, fields["tokenizer_type"], len(fields["tokens"]), len(fields["merges"])) == ("llama", "gpt2",
                                                                                              49152, 48900)
    assert {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token", "add_bos_token")} == {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>", "add_bos_token": False}
    assert config["chat_template"].startswith("{% for message in messages %}")


def test_smollm2_matches_transformers(smollm2_gguf, smollm2_tok, tmp_path, monkeypatch):
    """Built from gguf's reading of the file, then as jaxspec.load keeps it (saved in the cache directory on
    first use, read back after): each encodes, decodes and renders the chat template as transformers' does."""
    path = Path(smollm2_gguf)
    want = reference(path)
    assert_same(smollm2_tok, want)
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
    assert_same(jm._gguf_tokenizer(path), want)  # built, then saved
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1
    assert_same(jm._gguf_tokenizer(path), want)  # read back


# ------------------------------------------------------------------- tiny GGUFs of each tokenizer kind

SP_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
SP_WORDS = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "llo", "▁he", "▁hello", "▁w", "or", "▁wor",
            "▁world", "  ", "   "]
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                  "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_gguf(path: Path, arch: str, model: str, template: str | None, add_bos: bool | None):
    """A GGUF with a toy vocabulary of the kind `model` (tokenizer.ggml.model) and one tensor: a sentencepiece
    vocabulary (scores, byte tokens, no merges) or a byte-level BPE one (merges, qwen2 split, an added
    `<think>`)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, v in dict(context_length=64, embedding_length=8, block_count=1, feed_forward_length=16, head_count=2,
                       head_count_kv=1, layer_norm_rms_eps=1e-6, rope_freq_base=1e4, key_length=4,
                       value_length=4).items():
        getattr(w, f"add_{key}")(v)
    w.add_tokenizer_model(model)
    if model == "gpt2":
        from tokenizers import pre_tokenizers

        merges = ["Ġ h", "e l", "Ġh el", "l o", "Ġhel lo", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in merges] + specials
        tokens.append("<think>")
        types = [1] * (len(tokens) - 4) + [3, 3, 3, 4]  # normal, control, user-defined
        w.add_tokenizer_pre("qwen2")
        w.add_token_merges(merges)
        ids = dict(eos=len(tokens) - 2, pad=len(tokens) - 4)
    else:
        tokens = SP_SPECIAL + [f"<0x{i:02X}>" for i in range(256)] + SP_WORDS
        types = [3, 3, 3, 2, 3, 3, 3] + [6] * 256 + [1] * len(SP_WORDS)  # control, unknown, byte, normal
        w.add_token_scores([0.0] * (len(SP_SPECIAL) + 256) + [-float(i) for i in range(len(SP_WORDS))])
        ids = dict(pad=0, eos=1, bos=2, unk=3)
    w.add_vocab_size(len(tokens))
    w.add_token_list(tokens)
    w.add_token_types(types)
    for name, i in ids.items():
        getattr(w, f"add_{name}_token_id")(i)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if template:
        w.add_chat_template(template)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,model,template,add_bos", [
    ("llama", "llama", None, None),  # sentencepiece, BOS by default
    ("gemma3", "llama", GEMMA_TEMPLATE, None),  # GemmaTokenizer
    ("gemma4", "gemma4", GEMMA_TEMPLATE, True),  # the file's BOS flag overridden (the template writes it)
    ("qwen3", "gpt2", CHATML, None),  # Qwen2Tokenizer, byte-level BPE, no BOS id
])
def test_tiny_gguf_matches_transformers(tmp_path, arch, model, template, add_bos):
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, model, template, add_bos)
    want = reference(path)
    assert_same(gguf_tokenizer(path), want, chat=template is not None)


# --------------------------------------------------------------------------------------- without torch

NO_TORCH = """
import json, sys
sys.modules["torch"] = None  # `import torch` now raises ImportError
import jaxspec
from jaxspec.cli import bundled_model
from jaxspec.model import _gguf_tokenizer, encode_prompt
from pathlib import Path
model = jaxspec.load(bundled_model(), kernels="xla")
again = _gguf_tokenizer(Path(bundled_model()))  # read back from the cache directory
assert sys.modules["torch"] is None and not [m for m in sys.modules if m.startswith("torch.")]
print(json.dumps(dict(chat=encode_prompt(model, sys.argv[1], chat=True), plain=again(sys.argv[1])["input_ids"],
                      eos=model.tokenizer.eos_token_id)))
"""


def test_load_without_torch(smollm2_tok, tmp_path):
    """jaxspec.load of the bundled GGUF in a process where torch cannot be imported (an empty cache directory,
    so the tokenizer is built there, then read back) gives the tokenizer built here."""
    prompt = "What is the capital of France? ✨ 日本"
    env = dict(os.environ, JAXSPEC_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", NO_TORCH, prompt], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    tok = smollm2_tok
    chat = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   return_dict=True)["input_ids"]
    assert got == dict(chat=chat, plain=tok(prompt)["input_ids"], eos=tok.eos_token_id)
    assert got["chat"][-4:] == tok("<|im_start|>assistant\n")["input_ids"]
