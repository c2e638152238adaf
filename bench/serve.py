"""The server under load: requests/s, output tokens/s, time to first token and per-token latency at several
concurrency levels, for AR and DDTree through the same server flags, in one run.

Each method gets its own `python -m jaxspec.serve` process on localhost (the bundled SmolLM2 pair by default).
Clients stream held-out chat prompts (never used in training) with the `openai` client, greedy, and every
answer is checked against the first method's: the server must not change a token. Each level runs twice and
the second run is timed (the first compiles the refill programs its prompt widths and group sizes need).
A process's speed moves with the spell of a shared VM it runs in (by tens of percent on the 2-core VM), so
`--repeats N` starts N servers per method, alternating methods, and reports each figure's median and the
DDTree / AR ratio of each pair.

    python bench/serve.py --concurrency 1,4,16 --requests 32 --max-tokens 64 [--max-batch 4] [--repeats 3]
        [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxspec.train.data import read_prompts  # noqa: E402

NAME = "SmolLM2-135M-Instruct"


def start_server(method: str, args, log: Path) -> tuple[subprocess.Popen, str]:
    """The server for `method` on a free port, its stderr in `log`, once it answers /health."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "jaxspec.serve", "--port", str(port), "--method", method, "--max-batch",
           str(args.max_batch), "--max-model-len", str(args.max_model_len), "--chunk", str(args.chunk)]
    if method == "ddtree" and args.budget:
        cmd += ["--budget", args.budget]
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stderr=err, text=True, env={**os.environ, "XLA_FLAGS": ""})
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if proc.poll() is not None:
            raise SystemExit(f"the {method} server exited: {log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the {method} server did not start")


def one(client: openai.OpenAI, prompt: str, max_tokens: int) -> dict:
    """One streamed chat request: its text, token count, time to first token and per-token latency."""
    t0, first, text, usage = time.perf_counter(), None, [], None
    for c in client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True}):
        if c.choices and c.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(c.choices[0].delta.content)
        if c.usage:
            usage = c.usage
    end = time.perf_counter()
    n = usage.completion_tokens
    first = first or end
    return dict(text="".join(text), tokens=n, ttft=first - t0, tpot=(end - first) / (n - 1) if n > 1 else None)


def level(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[dict, list[str]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one(client, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    q = lambda xs, f: statistics.quantiles(xs, n=10)[8] if f == "p90" else statistics.median(xs)  # noqa: E731
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    row = dict(concurrency=concurrency, requests=len(prompts), seconds=wall, requests_per_s=len(prompts) / wall,
               output_tokens_per_s=sum(r["tokens"] for r in results) / wall,
               ttft_median_s=q(ttft, "median"), ttft_p90_s=q(ttft, "p90"),
               tpot_median_s=q(tpot, "median"), tpot_p90_s=q(tpot, "p90"))
    return row, [r["text"] for r in results]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=32, help="requests per level (held-out prompts, cycled)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--budget", default="auto", help="DDTree's budget flag for the server")
    ap.add_argument("--methods", default="ar,ddtree")
    ap.add_argument("--repeats", type=int, default=1, help="server processes per method, alternating (medians)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1 (server processes per method), got {args.repeats}")
    levels = [int(c) for c in args.concurrency.split(",")]
    heldout = read_prompts("heldout")
    prompts = [heldout[i % len(heldout)] for i in range(args.requests)]
    runs, reference, choices = {}, None, {}  # runs[method][concurrency]: one row per server process
    logs = tempfile.TemporaryDirectory(prefix="jaxspec-serve-bench-")
    for rep, method in ((r, m) for r in range(args.repeats) for m in args.methods.split(",")):
        log = Path(logs.name) / f"{method}-{rep}.log"
        proc, url = start_server(method, args, log)
        choice = next((ln for ln in log.read_text().splitlines() if ln.startswith("budget auto:")), None)
        if choice:  # each process chooses from the cost table as it stands then
            choices.setdefault(method, []).append(choice)
            print(f"{method:>6}  {choice}", flush=True)
        try:
            for c in levels:
                level(url, prompts, c, args.max_tokens)  # compiles what this level needs
                row, texts = level(url, prompts, c, args.max_tokens)
                if reference is None:
                    reference = texts
                assert texts == reference, f"{method} at concurrency {c}: answers differ from the first run's"
                runs.setdefault(method, {}).setdefault(c, []).append(row)
                print(f"{method:>6}  c={c:>3}  {row['requests_per_s']:6.2f} req/s  {row['output_tokens_per_s']:7.1f} "
                      f"tok/s  TTFT {row['ttft_median_s'] * 1e3:7.0f} / {row['ttft_p90_s'] * 1e3:7.0f} ms  "
                      f"TPOT {row['tpot_median_s'] * 1e3:6.1f} / {row['tpot_p90_s'] * 1e3:6.1f} ms", flush=True)
        finally:
            proc.terminate()
            proc.wait(120)
    logs.cleanup()
    # each figure's median over the processes (a process's speed moves with the VM's spell: the methods alternate)
    results = {m: [dict({k: statistics.median(r[k] for r in rows) for k in rows[0]}, runs=rows)
                   for rows in by_level.values()] for m, by_level in runs.items()}
    if "ar" in results and "ddtree" in results:
        for c in levels:
            pairs = zip(runs["ar"][c], runs["ddtree"][c])
            ratios = [d["output_tokens_per_s"] / a["output_tokens_per_s"] for a, d in pairs]
            print(f"c={c:>3}: DDTree / AR output tokens/s = {statistics.median(ratios):.2f}x "
                  f"({', '.join(f'{r:.2f}' for r in ratios)})")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}  # where it was written is no setting
        Path(args.json).write_text(json.dumps(dict(args=settings, budget_auto=choices, results=results), indent=2))


if __name__ == "__main__":
    main()
