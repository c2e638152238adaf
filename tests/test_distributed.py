"""Two processes on localhost (jax.distributed, CPU collectives over gloo, 4 fake devices each) generate the
same tokens on a dp 2 x tp 4 mesh spanning both as this single process does on its 8 devices."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import jaxspec
from jaxspec.config import dense_config_from_dict
from jaxspec.testing import oracle_drafter

CONFIG = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=512)
PROMPT = [3, 17, 42, 8, 91, 5, 60, 33, 2, 71]


def run() -> list:
    """Batched AR, then DDTree with an oracle drafter, on a dp 2 x tp 4 mesh of all visible devices."""
    m = jaxspec.random_model(dense_config_from_dict(CONFIG), seed=5, mesh=jaxspec.make_mesh(tp=4, dp=2))
    ar = jaxspec.generate(m, input_ids=[PROMPT, PROMPT[2:]], method="ar", max_new_tokens=16).token_ids
    d = oracle_drafter(m, PROMPT + ar[0], noise=0.3, block_size=4)
    tree = jaxspec.generate(m, input_ids=PROMPT, drafter=d, method="ddtree", budget=6, max_new_tokens=16)
    return [ar, tree.token_ids]


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices: see conftest.py")
def test_two_processes_match_one(tmp_path):
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent), str(here)]), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs = []
    for i in range(2):  # output to files, not pipes: nobody reads them until this process has its own answer
        with open(tmp_path / f"out{i}", "w") as out, open(tmp_path / f"err{i}", "w") as err:
            procs.append(subprocess.Popen([sys.executable, str(here / "multihost_worker.py"), str(port), str(i)],
                                          env=env, stdout=out, stderr=err, text=True))
    try:
        want = run()  # this process's answer while the workers start, compile and wait on each other
    finally:
        for p in procs:
            try:
                p.wait(timeout=600)
            finally:
                p.kill()  # a no-op once it has exited
    outs = []
    for i, p in enumerate(procs):
        out, err = ((tmp_path / f"{name}{i}").read_text() for name in ("out", "err"))
        lines = [ln for ln in out.splitlines() if ln.startswith("TOKENS ")]
        assert p.returncode == 0 and lines, f"worker failed (status {p.returncode}):\n{err[-3000:]}"
        outs.append(json.loads(lines[0][len("TOKENS "):]))
    assert outs[0] == outs[1] == want
