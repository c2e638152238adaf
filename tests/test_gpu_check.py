"""bench/gpu_check.py, the script a session runs once when it is lent a GPU: its dry run (the same code on tiny
shapes, on the CPU) must finish with every section measured and no error, so a broken script is caught here
rather than on the lease."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"
TARGETS = ("llama-8b", "qwen3.6-27b")
STEPS = ("build", "ar_step", "verify", "generate", "verify_more", "batched")


def positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def no_errors(node, where="") -> list[str]:
    """Every section below `node` whose status is not "ok" (errors and skips alike), and every row with an error."""
    bad = []
    if isinstance(node, dict):
        if node.get("status", "ok") != "ok" or "error" in node or "skipped" in node:
            why = node.get("error") or node.get("reason") or node.get("skipped")
            bad.append(f"{where}: {node.get('status')} {why}")
        for k, v in node.items():
            bad += no_errors(v, f"{where}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            bad += no_errors(v, f"{where}[{i}]")
    return bad


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_dry_run_measures_every_section(dry_run):
    report, stdout = dry_run
    s = report["sections"]
    assert report["dry_run"] and "interrupted" not in report
    assert not no_errors(s), no_errors(s)
    assert set(s) == {"bandwidth", "commit_kernels", "decode_kernel", "grouped_matmul", *TARGETS}
    assert list(s)[4:] == list(TARGETS)  # the 8B first
    rows = s["decode_kernel"]["rows"]  # the flash-decoding kernel (interpreted here) beside the blocked loop
    assert [r["query_rows"] for r in rows] == [2, 130, 4, 260] and all(r["max_abs_diff"] < 0.05 for r in rows)
    assert [r.get("latent") for r in rows] == [None, None, 192, 192]  # over a KV cache, then MLA's latents
    assert "turned_off" not in s["decode_kernel"]
    g = s["grouped_matmul"]  # JAX's grouped matmul (interpreted) beside lax.ragged_dot
    assert g["status"] == "ok" and "turned_off" not in g and [r["groups"] for r in g["rows"]] == [6], g
    assert g["rows"][0]["max_abs_diff"] < 0.1
    assert all(positive(s["bandwidth"][k]) for k in ("copy_gb_per_s", "read_gb_per_s", "gb_per_s"))
    for row in s["commit_kernels"]["rows"]:
        assert row["same_as_xla"] and positive(row["xla_us"]) and positive(row["pallas_us"])
    for name in TARGETS:
        t = s[name]
        assert all(t[step]["status"] == "ok" for step in STEPS), {k: t[k].get("status") for k in STEPS}
        ar = t["ar_step"]
        for buf in ("tight", "long"):
            for k in ("ms", "roofline_ms", "of_roofline", "bytes_read", "cache_read_bytes"):
                assert positive(ar[buf][k]), (name, buf, k, ar[buf])
        assert ar["long"]["cache_slots"] > ar["tight"]["cache_slots"]
        assert ar["long"]["cache_read_bytes"] > ar["tight"]["cache_read_bytes"]  # attention reads the whole buffer
        assert ar["long"]["cache_used_bytes"] == ar["tight"]["cache_used_bytes"]  # the same 500 committed slots
        rows = t["verify"]["rows"] + t["verify_more"]["rows"]
        budgets = {report["plan"]["budget"], *report["plan"]["more_budgets"]}
        for buf in ("tight", "long"):
            assert {r["budget"] for r in rows if r["buffer"] == buf} == budgets
        assert all(positive(r["ms"]) and positive(r["over_ar_step"]) for r in rows)
        g = t["generate"]
        for k in ("ar_tokens_per_s", "ddtree_tokens_per_s", "acceptance_length", "rounds_per_s", "speedup"):
            assert positive(g[k]), (name, k, g)
        assert g["same_tokens_as_ar"], g  # float32 on the CPU: DDTree is exactly AR's greedy output
        (b,) = t["batched"]["rows"]
        assert b["batch"] == 2 and all(positive(b[k]) for k in ("ar_ms", "verify_ms", "verify_over_ar",
                                                                   "ar_over_rows_alone"))
    assert "| llama-8b | ok |" in stdout and "| qwen3.6-27b | ok |" in stdout  # the summary


def test_roofline_counts_one_embedding_row(dry_run):
    """An AR step reads every weight but the input embedding's table, of which one row (the LM head in full)."""
    report, _ = dry_run
    for name in TARGETS:
        ar = report["sections"][name]["ar_step"]
        vocab, hidden = 512, 128  # gpu_check.TINY
        assert ar["embedding_table_bytes"] == vocab * hidden * 4  # float32 in the dry run
        assert not ar["tied_embeddings"]
        assert ar["weight_read_bytes"] == ar["weight_bytes"] - ar["embedding_table_bytes"] + hidden * 4
        for buf in ("tight", "long"):
            assert ar[buf]["bytes_read"] == ar["weight_read_bytes"] + ar[buf]["cache_read_bytes"]


def test_a_failing_section_is_recorded_and_saved(tmp_path, monkeypatch):
    """A section that raises keeps its partial numbers and its error in the JSON on disk, and the run goes on."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    report = gpu_check.Report(tmp_path / "r.json", dict(backend="cpu"))

    def fails(out):
        out["measured"] = 1.5
        raise ValueError("out of memory")

    report.section(report.data["sections"], "a", fails)
    report.section(report.data["sections"], "b", lambda out: out.update(x=2))
    report.section(report.data["sections"], "c", lambda out: None, need_s=60, clock=gpu_check.Clock(1))
    saved = json.loads((tmp_path / "r.json").read_text())["sections"]
    assert saved["a"]["status"] == "error" and saved["a"]["measured"] == 1.5
    assert "ValueError: out of memory" in saved["a"]["error"]
    assert saved["b"] == dict(saved["b"], status="ok", x=2)
    assert saved["c"]["status"] == "skipped"
