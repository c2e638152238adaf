"""The server (`python -m jaxspec.serve`): a real server process on 127.0.0.1 with the bundled SmolLM2 pair
(DDTree, 2 rows), spoken to with the real `openai` client and raw HTTP.

Greedy answers are checked against `jaxspec.generate` (AR, in this process): through both endpoints, streamed
and not, alone, with 8 concurrent clients and in a load test, since continuous batching must not change a row's
tokens. Also: stop strings, seeded sampling, a client that goes away, every bad request, a full queue, SIGTERM.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import jaxspec  # noqa: E402

NAME = "SmolLM2-135M-Instruct"
# CTX: the server compiles one refill per 64-token prompt width up to it (3 here), and a long request (CTX - 16
# tokens) still takes seconds, so it holds its row well past the checks that need a busy row
ROWS, QUEUE, CTX = 2, 16, 192
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
             "What is 12 times 7?", "Give me a synonym for happy.", "Why is the sky blue?",
             "List two planets.", "Say hello in Spanish."]
N = 24  # max_tokens of the greedy checks


@pytest.fixture(scope="module")
def server(smollm2_gguf, tmp_path_factory):
    """(base URL, process): the server with a few rows and a short queue, so a full queue is cheap to reach."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve") / "server.log"
    args = [sys.executable, "-m", "jaxspec.serve", "--port", str(port), "--max-batch", str(ROWS), "--max-queue",
            str(QUEUE), "--budget", "4", "--max-model-len", str(CTX), "--chunk", "8"]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "XLA_FLAGS": ""})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited ({proc.returncode}): {log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        proc.kill()
        pytest.fail(f"the server did not become healthy: {log.read_text()}")
    yield url, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    """Greedy token ids from jaxspec.generate (AR): chat answers to QUESTIONS and a raw completion of each."""
    model = jaxspec.load(smollm2_gguf)
    chat = jaxspec.generate(model, QUESTIONS, chat=True, max_new_tokens=N, method="ar").token_ids
    raw = jaxspec.generate(model, QUESTIONS, chat=False, max_new_tokens=N, method="ar").token_ids
    text = lambda ids: model.tokenizer.decode(ids, skip_special_tokens=True,  # noqa: E731
                                              clean_up_tokenization_spaces=False)
    return {"chat": chat, "raw": raw, "text": text}


def ask(client, i: int, max_tokens: int = N, **kw):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTIONS[i]}],
                                          max_tokens=max_tokens, temperature=0, **kw)


def metric(url, *names) -> list[float]:
    text = httpx.get(url + "/metrics").text
    return [float(re.search(rf"^{name} (\S+)$", text, re.M).group(1)) for name in names]


def running(url) -> tuple[float, float]:
    """(queue depth, running rows) from /metrics."""
    return tuple(metric(url, "jaxspec_queue_depth", "jaxspec_running_rows"))


def wait_idle(url, timeout=30):
    deadline = time.time() + timeout
    while running(url) != (0, 0):
        assert time.time() < deadline, f"rows still busy: {running(url)}"
        time.sleep(0.2)


def test_health_models_and_metrics(server):
    url = server[0]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [NAME] and models["data"][0]["max_model_len"] == CTX
    text = httpx.get(url + "/metrics").text
    for name in ("jaxspec_requests_total", "jaxspec_queue_depth", "jaxspec_running_rows",
                 "jaxspec_generated_tokens_total", "jaxspec_acceptance_length_bucket",
                 "jaxspec_time_to_first_token_seconds_bucket", "jaxspec_time_per_output_token_seconds_bucket"):
        assert name in text, name


def test_answers_equal_generate(client, reference):
    """Chat and completions, streamed and not: the greedy text and token count of jaxspec.generate."""
    ids, text = reference["chat"][0], reference["text"]
    r = ask(client, 0)
    assert r.choices[0].message.content == text(ids)
    assert r.usage.completion_tokens == len(ids) and r.usage.prompt_tokens > 10
    assert r.choices[0].finish_reason == ("stop" if len(ids) < N else "length")
    chunks = list(ask(client, 0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text(ids)
    assert chunks[-1].usage.completion_tokens == len(ids)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2  # streamed, not at once
    raw = reference["raw"][1]
    c = client.completions.create(model=NAME, prompt=QUESTIONS[1], max_tokens=N, temperature=0)
    assert c.choices[0].text == text(raw) and c.usage.completion_tokens == len(raw)
    streamed = client.completions.create(model=NAME, prompt=QUESTIONS[1], max_tokens=N, temperature=0, stream=True)
    assert "".join(x.choices[0].text for x in streamed) == text(raw)


def test_concurrent_clients_get_their_own_answers(client, reference):
    """8 clients at once (2 rows, the rest queued, rows refilled as answers end), two of them sampling: every
    greedy answer is still generate's."""
    def one(i):
        if i >= len(QUESTIONS):
            return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Tell a story."}],
                                                  max_tokens=N, temperature=1.0,
                                                  extra_body={"top_k": 50}).choices[0]
        return ask(client, i).choices[0].message.content

    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(one, range(len(QUESTIONS) + 2)))
    assert answers[: len(QUESTIONS)] == [reference["text"](ids) for ids in reference["chat"]]


def test_stop_strings(client, reference):
    full = reference["text"](reference["chat"][5])
    stop = full.split()[3]  # a word in the middle of the answer
    r = ask(client, 5, stop=[stop, "\u2603never"])
    assert r.choices[0].message.content == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = ask(client, 5, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == full[: full.index(stop)]


def test_seeded_sampling_repeats(client):
    kw = dict(model=NAME, messages=[{"role": "user", "content": "Tell me a story about a dog."}], max_tokens=16,
              temperature=0.9, top_p=0.95)
    a, b, c = (client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (7, 7, 8))
    assert a == b and a != c


def test_a_client_that_goes_away_frees_its_row(server, client, reference):
    url = server[0]
    body = {"model": NAME, "prompt": "Count to a thousand:", "max_tokens": CTX - 16, "temperature": 0,
            "stream": True}
    (before,) = metric(url, "jaxspec_generated_tokens_total")
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url + "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert running(url)[1] == 1
    wait_idle(url, timeout=10)
    deadline = time.time() + 10  # the row is freed just before its tokens are counted
    while (generated := metric(url, "jaxspec_generated_tokens_total")[0] - before) == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert 0 < generated < body["max_tokens"], generated  # cancelled, not run to its end
    assert ask(client, 3).choices[0].message.content == reference["text"](reference["chat"][3])


BAD = [  # (body or raw text, the field the error must name)
    ("{not json", None),
    ({"model": NAME, "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "max_tokens": CTX}, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "temperature": -0.5}, "temperature"),
    ('{"model": "%s", "prompt": "hi", "temperature": Infinity}' % NAME, "temperature"),
    ({"model": NAME, "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": NAME, "prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"model": NAME, "prompt": "hi", "top_k": -3}, "top_k"),
    ({"model": NAME, "prompt": "word " * CTX}, "prompt"),
    ({"model": NAME, "prompt": [1, 2, 10 ** 9]}, "prompt"),
    ({"model": NAME, "prompt": ""}, "prompt"),
    ({"model": "gpt-4", "prompt": "hi"}, "model"),
    ({"prompt": "hi"}, "model"),
    ({"model": NAME, "prompt": "hi", "n": 2}, "n"),
    ({"model": NAME, "prompt": "hi", "stop": 5}, "stop"),
    ({"model": NAME, "prompt": "hi", "stream": "yes"}, "stream"),
    ({"model": NAME, "messages": []}, "messages"),
    ({"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"model": NAME, "messages": "hi"}, "messages"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD)])
def test_bad_requests_get_400_naming_the_field(server, body, param):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else \
        {"json": body}
    r = httpx.post(server[0] + path, timeout=60, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param or (param or "") in (err["param"] or ""), err


def test_a_full_queue_answers_503(server, client, reference):
    url = server[0]
    body = {"model": NAME, "prompt": "Count to a thousand:", "max_tokens": CTX - 16, "temperature": 0,
            "stream": True}
    http = httpx.Client(timeout=60)
    held = []
    try:
        for i in range(ROWS + QUEUE):
            held.append(http.send(http.build_request("POST", url + "/v1/completions", json=body), stream=True))
            while i < ROWS and running(url)[1] <= i:  # the rows fill first, then the queue
                time.sleep(0.05)
        assert [r.status_code for r in held] == [200] * (ROWS + QUEUE) and running(url) == (QUEUE, ROWS)
        r = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_overloaded"
    finally:
        for r in held:
            r.close()
        http.close()
    wait_idle(url)
    assert ask(client, 4).choices[0].message.content == reference["text"](reference["chat"][4])


def test_load(client, reference):
    """32 requests from 16 clients: every one completes, every greedy answer is right."""
    n = 12
    want = [reference["text"](ids[:n]) for ids in reference["chat"]]

    def one(i):
        return ask(client, i % len(QUESTIONS), max_tokens=n).choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(32)))
    assert answers == [want[i % len(QUESTIONS)] for i in range(32)]


def test_bad_flags_exit_2(capsys):
    from jaxspec.serve import main

    for argv in (["--max-batch", "0"], ["--port", "70000"], ["--budget", "0"], ["--max-batch", "3", "--dp", "2"],
                 ["--model", "/nonexistent/model.gguf"], ["--method", "bogus"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), (argv, err)


def test_out_of_device_memory_exits_with_one_line(tmp_path):
    """An engine whose buffers do not fit the device (a 2^22-token context of 8192-wide heads: 128 GiB for one K
    buffer of the speculative cache, allocated whole at start-up, in a process limited to 40 GiB of address
    space, so the allocation fails whatever this machine's memory) takes the server down: exit 1 and one line
    naming the fix, not a process answering 503 for ever."""
    from test_cli import char_tokenizer, save_tiny

    path = save_tiny(tmp_path / "target", num_attention_heads=1, num_key_value_heads=1, head_dim=8192,
                     max_position_embeddings=1 << 23)
    char_tokenizer().save_pretrained(path)
    jaxspec.init_drafter(jaxspec.load(path), num_layers=1, block_size=4).save(tmp_path / "drafter")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["bash", "-c", f'ulimit -v {40 << 20} && exec "$@"', "-", sys.executable, "-m", "jaxspec.serve",
            "--model", str(path), "--drafter", str(tmp_path / "drafter"), "--budget", "4", "--max-batch", "1",
            "--max-model-len", str(1 << 22), "--port", str(port)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**os.environ, "XLA_FLAGS": ""})
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert last.startswith("error: the engine stopped: out of device memory (RESOURCE_EXHAUSTED") and \
        "python -m jaxspec.plan" in last, proc.stderr[-3000:]


def test_event_stream_format(server):
    """Raw SSE: `data: {json}` events, a chunk with a finish_reason, then `data: [DONE]`."""
    with socket.create_connection(("127.0.0.1", int(server[0].rsplit(":", 1)[1])), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in s.recv(1000)
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True}
    events = [line for line in httpx.post(server[0] + "/v1/completions", json=body, timeout=60).text.splitlines()
              if line]
    assert events[-1] == "data: [DONE]"
    parsed = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert parsed[-1]["choices"][0]["finish_reason"] == "length"


def test_sigterm_finishes_running_requests_and_exits_0(server, client, reference):
    url, proc = server
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", ask(client, 2)))
    t.start()
    deadline = time.time() + 30
    while running(url)[1] == 0 and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert result["r"].choices[0].message.content == reference["text"](reference["chat"][2])
    assert proc.wait(120) == 0
