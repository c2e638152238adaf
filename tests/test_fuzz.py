"""Fuzzing what a user's files and flags can throw at `python -m jaxspec.generate` and `jaxspec.load`:
truncated, zeroed and bit-flipped safetensors and GGUF files, config.json files (a target's and a drafter's)
with wrong types, impossible values and missing keys, and bad values for every flag.

Each case is drawn from a seeded generator, so a failure names a case that reruns. A damaged file may still
be a valid one (a flipped bit inside a weight): then the command runs. Otherwise `jaxspec.load` raises a
ConfigError or WeightsError (never IndexError, KeyError, struct.error...), and the command ends with exit
status 2, nothing on stdout and exactly one `error:` line on stderr; no case may run past its deadline.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys

import pytest

import jaxspec
from jaxspec.checkpoint import WeightsError
from jaxspec.cli import main
from jaxspec.config import ConfigError
from test_cli import char_tokenizer, save_tiny
from test_quant import write_quantized_gguf

SEED = 55
DEADLINE_S = 30  # per case; a case that loads and generates takes 3 s at most here


class Hang(BaseException):
    """A case still running at its deadline (a BaseException, so no `except Exception` can swallow it)."""


@contextlib.contextmanager
def deadline(seconds: float = DEADLINE_S):
    """Raise Hang in a case still running after `seconds`; where the case is stuck inside one long C call, which
    a signal handler cannot interrupt, end the whole process 30 s later, printing every thread's stack."""
    def expire(*_):
        raise Hang(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(seconds + 30, exit=True, file=sys.__stderr__)  # pytest swaps sys.stderr
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Qwen3 with a character tokenizer, a drafter for it, a tiny llama GGUF with quantised tensors
    (no tokenizer: the command stops at that after loading it), a binary file and an empty one."""
    root = tmp_path_factory.mktemp("fuzz")
    save_tiny(root / "model")
    char_tokenizer().save_pretrained(root / "model")
    jaxspec.init_drafter(jaxspec.load(root / "model"), block_size=4).save(root / "drafter")
    write_quantized_gguf(root / "model.gguf", {"attn_q": "Q4_0", "ffn_up": "Q8_0", "ffn_down": "Q4_1"})
    (root / "binary").write_bytes(b"\xff\xfe\x00abc")
    (root / "empty.txt").write_text("")
    return root


def cli(capsys, *argv):
    with deadline():
        rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(rc, out, err, case) -> None:
    lines = err.strip().splitlines()
    assert rc == 2 and out == "", (case, rc, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), (case, err)


def ran_or_one_error_line(rc, out, err, case) -> None:
    """A damaged file that is still valid runs (text on stdout, the summary last on stderr); anything else is
    one error line."""
    if rc == 0:
        assert out.endswith("\n") and " tokens/s" in err.strip().splitlines()[-1], (case, out, err)
    else:
        one_error_line(rc, out, err, case)


def load_typed(path, case, **kw) -> None:
    """jaxspec.load of a damaged file: a model, or a ConfigError / WeightsError."""
    try:
        with deadline():
            jaxspec.load(path, tokenizer=False, **kw)
    except (ConfigError, WeightsError):
        pass
    except Exception as e:  # any other type is the bug this file looks for: report it with its case
        raise AssertionError(f"{case}: {type(e).__name__}: {e}") from e


def damaged(data: bytes, rng: random.Random, header: int) -> tuple[str, bytes]:
    """`data` truncated anywhere, zeroed whole, a run of its header zeroed, or 1-3 bits of its header flipped
    (metadata, tensor names, shapes, offsets; a flip among the weights' bytes only changes a weight)."""
    how = rng.choice(["truncate", "zero all", "zero run", "flip", "flip", "flip"])
    b = bytearray(data)
    if how == "truncate":
        return how, bytes(b[: rng.randrange(len(b))])
    if how == "zero all":
        return how, bytes(len(b))
    if how == "zero run":
        i, n = rng.randrange(header), rng.randrange(1, 64)
        b[i: i + n] = bytes(len(b[i: i + n]))
        return how, bytes(b)
    for _ in range(rng.randrange(1, 4)):
        b[rng.randrange(header)] ^= 1 << rng.randrange(8)
    return how, bytes(b)


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_damaged_weights(files, tmp_path, capsys, fmt):
    """14 damaged copies of each format (a GGUF with quantised tensors, loaded as float or native), each through
    jaxspec.load and the command."""
    rng = random.Random(f"{SEED}-{fmt}")
    if fmt == "safetensors":
        src = files / "model" / "model.safetensors"
        data = src.read_bytes()
        header = 8 + int.from_bytes(data[:8], "little")
    else:
        import gguf

        src = files / "model.gguf"
        data = src.read_bytes()
        header = gguf.GGUFReader(str(src)).data_offset  # metadata and the tensor table
    for i in range(14):
        how, bad = damaged(data, rng, header)
        case = f"{fmt} case {i} ({how})"
        if fmt == "safetensors":
            path = tmp_path / f"m{i}"
            shutil.copytree(files / "model", path)
            (path / "model.safetensors").write_bytes(bad)
        else:
            path = tmp_path / f"m{i}.gguf"
            path.write_bytes(bad)
        load_typed(path, case, quantize=rng.choice([None, "native"]) if fmt == "gguf" else None)
        ran_or_one_error_line(*cli(capsys, "--model", path, "--prompt", "Hi", "--max-new-tokens", 2), case)


def patched_gguf(src, dst, field, values) -> None:
    """A copy of GGUF `src` with the numbers of one header field (a ReaderField, found in a reader of `src`)
    overwritten in place, the file's layout otherwise unchanged: the corruption of a bit flip, chosen."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    part = field(reader)
    at = part.ctypes.data - reader.data.ctypes.data
    data = bytearray(src.read_bytes())
    data[at: at + part.nbytes] = np.asarray(values, part.dtype).tobytes()
    dst.write_bytes(bytes(data))


def test_corrupt_counts_fail_fast(files, tmp_path, capsys):
    """Corruptions that the random cases may miss and that once hung or escaped: a GGUF whose block count reads
    2**20 (a module of a million layers, built before any tensor is read: hours), a config.json or a drafter's
    claiming 100000 layers (likewise), a GGUF whose query projection's rows no longer split into its heads
    (llama.cpp's row order undone by a reshape that raised a bare ValueError), and safetensors header entries
    of valid JSON but the wrong types (a bare TypeError or ValueError)."""
    blocks = lambda r: (f := r.fields["llama.block_count"]).parts[f.data[0]]  # noqa: E731
    q_dims = lambda r: next(t for t in r.tensors if t.name == "blk.0.attn_q.weight").field.parts[3]  # noqa: E731
    patched_gguf(files / "model.gguf", tmp_path / "deep.gguf", blocks, [2**20])
    patched_gguf(files / "model.gguf", tmp_path / "rows.gguf", q_dims, [64, 66])
    for which in ("model", "drafter"):
        shutil.copytree(files / which, tmp_path / which)
        cfg = json.loads((tmp_path / which / "config.json").read_text()) | {"num_hidden_layers": 100_000}
        del cfg["layer_types"]  # one per layer, else the count is refused at once
        (tmp_path / which / "config.json").write_text(json.dumps(cfg))
    for i, field in enumerate([{"shape": ["64", 64]}, {"data_offsets": [0, 16384, 32768]}, {"dtype": ["F32"]}]):
        shutil.copytree(files / "model", tmp_path / f"header{i}")  # a header entry of valid JSON, wrong types
        f = tmp_path / f"header{i}" / "model.safetensors"
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8: 8 + n])
        header["model.norm.weight"].update(field)
        text = json.dumps(header).encode()
        f.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    for path, words in [("deep.gguf", "says 1048576 blocks but its tensors fill 2"),
                        ("rows.gguf", "cannot read GGUF tensor blk.0.attn_q.weight"),
                        ("model", "says num_hidden_layers 100000, but the checkpoint's tensors fill 2 layers"),
                        ("header0", "invalid header"), ("header1", "invalid header"), ("header2", "has dtype")]:
        with deadline(), pytest.raises(WeightsError, match=words):
            jaxspec.load(tmp_path / path, tokenizer=False)
    rc, out, err = cli(capsys, "--model", files / "model", "--drafter", tmp_path / "drafter", "--prompt", "Hi")
    one_error_line(rc, out, err, "drafter with 100000 layers")
    assert "says num_hidden_layers 100000, but the checkpoint's tensors fill 1 layers" in err


WRONG = ["64", "abc", -1, -64, 0, None, [1, 2], [], {}, {"a": 1}, 1.5, True, 100_000, 2**31, 10**30, math.nan, math.inf,
         -0.5]
TARGET_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
               "eos_token_id", "tie_word_embeddings", "model_type", "layer_types", "sliding_window", "hidden_act"]
DRAFTER_KEYS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "block_size", "dflash_config", "layer_types", "rms_norm_eps", "rope_theta",
                "num_target_layers", "max_position_embeddings"]


def bad_config(d, keys, rng: random.Random) -> tuple[str, object]:
    """A config dict with one or two keys given a wrong type or an impossible value, or deleted; or no object."""
    if rng.random() < 0.1:
        whole = rng.choice([[], "config", None, 3])
        return f"whole file {whole!r}", whole
    d, changes = dict(d), []
    for key in rng.sample(keys, rng.choice([1, 1, 2])):
        if rng.random() < 0.2:
            d.pop(key, None)
            changes.append(f"no {key}")
        else:
            d[key] = rng.choice(WRONG)
            changes.append(f"{key}={d[key]!r}")
    return ", ".join(changes), d


def test_bad_config_json(files, tmp_path, capsys):
    """Target configs through `jaxspec.load` and the command, drafter configs through `--drafter`; a config that
    only changes what the weights need not show (a missing eos_token_id) runs."""
    rng = random.Random(f"{SEED}-config")
    target = json.loads((files / "model" / "config.json").read_text())
    drafter = json.loads((files / "drafter" / "config.json").read_text())
    for i in range(24):
        which = "drafter" if i % 3 == 2 else "model"
        what, cfg = bad_config(drafter if which == "drafter" else target, DRAFTER_KEYS if which == "drafter"
                               else TARGET_KEYS, rng)
        case = f"{which} config case {i}: {what}"
        path = tmp_path / f"{which}{i}"
        shutil.copytree(files / which, path)
        (path / "config.json").write_text(json.dumps(cfg))
        if which == "model":
            load_typed(path, case)
            argv = ("--model", path)
        else:
            argv = ("--model", files / "model", "--drafter", path, "--budget", 2)
        ran_or_one_error_line(*cli(capsys, *argv, "--prompt", "Hi", "--max-new-tokens", 2), case)


BAD_FLAGS = {  # values none of which may run
    "--max-new-tokens": ["0", "-5", "abc", "1e3", "", "99999999999999999999", "nan", "1000000"],
    "--temperature": ["nan", "inf", "-1", "abc", "1e309", "", "-0.5"],
    "--top-p": ["nan", "0", "-0.5", "1.5", "inf", "x", ""],
    "--top-k": ["-1", "1.5", "x", "-99999999999999999999", ""],
    "--seed": ["x", "1.5", "99999999999999999999999", "-99999999999999999999999", ""],
    "--budget": ["0", "-1", "1025", "x", "1.5", "99999999999999999999", "", "AUTO"],
    "--dtype": ["float16", "int8", "", "Float32"],
    "--quantize": ["int3", "native", "", "INT8"],
    "--method": ["beam", "", "DDTREE", "dflash", "ddtree"],
    "--model": ["{nowhere}", "{root}/binary", "{root}", "/dev/null", "{root}/drafter", "{root}/model/config.json",
                "{root}/empty.txt"],
    "--drafter": ["{nowhere}", "{root}/binary", "{root}/model", "{root}", "/dev/null"],
    "--prompt-file": ["{nowhere}", "{root}", "{root}/binary", "{root}/empty.txt", "/dev/null"],
}


def test_bad_flags(files, capsys):
    """One or two flags with a bad value each (out of range, not a number, nan / inf, not a choice, a path to
    nothing, to the wrong thing or to a binary file), the rest good: always one error line, before any
    generation (paths to the wrong model are found by loading it)."""
    rng = random.Random(f"{SEED}-flags")
    for i in range(40):
        flags, bad = {"--model": files / "model", "--prompt": "Hi", "--max-new-tokens": "2"}, {}
        for flag in rng.sample(sorted(BAD_FLAGS), rng.choice([1, 1, 2])):
            bad[flag] = rng.choice(BAD_FLAGS[flag]).format(root=files, nowhere=files / "nowhere")
            if flag == "--prompt-file":
                del flags["--prompt"]
        argv = [str(x) for kv in (flags | bad).items() for x in kv]
        one_error_line(*cli(capsys, *argv), f"flags case {i}: {bad}")


def test_no_traceback_reaches_the_terminal(files, tmp_path):
    """The command as a user runs it: a zeroed GGUF and a config.json that is a JSON list (which once died in an
    AttributeError) each print one error line and exit with 2."""
    (tmp_path / "zero.gguf").write_bytes(bytes((files / "model.gguf").stat().st_size))
    shutil.copytree(files / "model", tmp_path / "listed")
    (tmp_path / "listed" / "config.json").write_text("[]")
    for extra in (["--model", tmp_path / "zero.gguf"], ["--model", tmp_path / "listed"]):
        cmd = [sys.executable, "-m", "jaxspec.generate", "--prompt", "Hi", *map(str, extra)]
        # the user's cache directory, where the CPU kernel is built already (a new one builds it: seconds)
        run = subprocess.run(cmd, env=dict(os.environ, JAXSPEC_COMPILATION_CACHE="0"), capture_output=True,
                             text=True, timeout=120)
        one_error_line(run.returncode, run.stdout, run.stderr, extra)
        assert "Traceback" not in run.stderr
