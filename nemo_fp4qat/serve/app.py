"""The HTTP API (FastAPI): the OpenAI completions and chat completions APIs over a serving backend.

Endpoints: ``GET /health`` (liveness, no auth), ``GET /ready``, ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (the export's chat template), ``GET /metrics``
(Prometheus text). Both generation endpoints take ``stream`` (server-sent events in the OpenAI chunk
format, ``data: [DONE]`` last, usage in a final chunk with ``stream_options.include_usage``), ``n``,
``logprobs`` / ``top_logprobs``, ``stop``, ``seed``, ``user``; unknown fields are refused. Requests
are validated by pydantic and by configured limits; every error is a JSON
``{"error": {"message", "type", "param"}}`` with a 4xx status (504 when a request exceeds the timeout,
which also stops its generation between tokens; 413 for a body over ``max_body_bytes``; 503 with
``Retry-After`` when ``max_queued_requests`` are already waiting; 500 for the one request whose generation
raised, while the requests batched with it are served). Queued requests are batched into one decode loop up
to ``max_batch_size`` rows, each row with its own sampling parameters; a streaming client that
disconnects cancels its rows.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .generation import GenerationRow, SamplingParams
from .refusals import (
    APIError,
    BodySizeLimit,
    chat_max_tokens,
    check_api_key,
    check_chat_request,
    check_generation,
    completion_prompts,
    error_response,
)

__all__ = ["ChatCompletionRequest", "CompletionRequest", "ServeSettings", "create_app"]

SYSTEM_FINGERPRINT = "nemo-fp4qat"


@dataclass
class ServeSettings:
    max_prompt_tokens: int = 1024
    max_tokens: int = 256
    max_batch_size: int = 8
    timeout_s: float = 60.0
    batch_window_s: float = 0.005
    api_key: str | None = None
    max_body_bytes: int = 1 << 20  # a request body over this gets 413 before it is read whole
    max_queued_requests: int = 64  # requests waiting for a batch beyond this get 503 + Retry-After


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both generation endpoints share (OpenAI names and ranges)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float = Field(0.0, ge=0.0, le=2.0)  # greedy unless asked: reproducible answers by default
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as the OpenAI API allows

    def stops(self) -> tuple[str, ...]:
        return tuple([self.stop] if isinstance(self.stop, str) else (self.stop or []))


class CompletionRequest(_Sampling):
    prompt: str | list[str] = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(422, "messages: only text content parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=5)


def _backend_error(e: Exception) -> APIError:
    return APIError(500, f"generation failed: {type(e).__name__}: {e}", kind="server_error")


@dataclass
class Metrics:
    """Counters for ``/metrics``. Hand-written Prometheus text (a handful of lines) instead of a
    prometheus_client dependency."""

    requests: int = 0
    errors: dict[int, int] = field(default_factory=dict)
    latency_sum: float = 0.0
    latency_count: int = 0
    completion_tokens: int = 0
    generate_seconds: float = 0.0
    batches: int = 0
    cancelled: int = 0  # rows stopped early (client gone or timeout)
    backend_errors: int = 0  # requests whose generation raised (each answered 500, the others served)
    rejected_overload: int = 0  # 503: the queue was full
    rejected_body: int = 0  # 413: the body was over max_body_bytes

    def count_error(self, status: int) -> None:
        self.errors[status] = self.errors.get(status, 0) + 1

    def text(self) -> str:
        tps = self.completion_tokens / self.generate_seconds if self.generate_seconds else 0.0
        lines = [
            "# TYPE fp4qat_requests_total counter", f"fp4qat_requests_total {self.requests}",
            "# TYPE fp4qat_request_errors_total counter",
            *[f'fp4qat_request_errors_total{{status="{s}"}} {n}' for s, n in sorted(self.errors.items())],
            "# TYPE fp4qat_request_latency_seconds summary",
            f"fp4qat_request_latency_seconds_sum {self.latency_sum:.6f}",
            f"fp4qat_request_latency_seconds_count {self.latency_count}",
            "# TYPE fp4qat_completion_tokens_total counter", f"fp4qat_completion_tokens_total {self.completion_tokens}",
            "# TYPE fp4qat_batches_total counter", f"fp4qat_batches_total {self.batches}",
            "# TYPE fp4qat_cancelled_rows_total counter", f"fp4qat_cancelled_rows_total {self.cancelled}",
            "# TYPE fp4qat_tokens_per_second gauge", f"fp4qat_tokens_per_second {tps:.3f}",
            "# TYPE fp4qat_backend_errors_total counter", f"fp4qat_backend_errors_total {self.backend_errors}",
            "# TYPE fp4qat_rejected_total counter",
            f'fp4qat_rejected_total{{reason="overload"}} {self.rejected_overload}',
            f'fp4qat_rejected_total{{reason="body_too_large"}} {self.rejected_body}',
        ]  # fmt: skip
        return "\n".join(lines) + "\n"


@dataclass
class _Job:
    """One request: its rows (prompt x n), where their progress goes, and how to cancel them."""

    prompts: list[str]
    params: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue | None = None  # streaming: a snapshot of the rows after each decode step
    cancel: threading.Event = field(default_factory=threading.Event)

    def push(self, rows: list[GenerationRow]) -> None:
        """From the generation thread: hand a copy of this job's rows to its stream."""
        if self.events is not None:
            snap = [(r.text, r.finish_reason, list(r.logprobs)) for r in rows]
            self.loop.call_soon_threadsafe(self.events.put_nowait, snap)


class Batcher:
    """Runs queued jobs as one decode loop of up to ``max_batch_size`` rows (each row with its own
    sampling parameters), one batch at a time."""

    def __init__(self, backend: Any, settings: ServeSettings, metrics: Metrics) -> None:
        self.backend, self.settings, self.metrics = backend, settings, metrics
        self.queue: asyncio.Queue[_Job] = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self.inflight = 0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self.queue.get()
            jobs, held = [first], []
            await asyncio.sleep(self.settings.batch_window_s)
            n = len(first.prompts)
            while not self.queue.empty():
                j = self.queue.get_nowait()
                if n + len(j.prompts) <= self.settings.max_batch_size:
                    jobs.append(j)
                    n += len(j.prompts)
                else:
                    held.append(j)
            for j in held:
                self.queue.put_nowait(j)
            jobs = [j for j in jobs if not j.cancel.is_set()]
            if not jobs:
                continue
            prompts = [p for j in jobs for p in j.prompts]
            params = [j.params for j in jobs for _ in j.prompts]
            cancelled = [j.cancel for j in jobs for _ in j.prompts]
            spans, i = [], 0
            for j in jobs:
                spans.append((j, i, i + len(j.prompts)))
                i += len(j.prompts)

            def on_step(rows: list[GenerationRow], _spans=spans) -> None:
                for j, a, b in _spans:
                    j.push(rows[a:b])

            t0 = time.perf_counter()
            self.inflight += 1
            try:
                call = functools.partial(self.backend.generate_rows, prompts, params, cancelled, on_step)
                out = await loop.run_in_executor(None, call)
            except Exception as e:
                # One request's failure must not fail the others batched with it: run each alone, so only
                # the requests that fail by themselves get the error (rare path: a second pass per job).
                if len(jobs) == 1:
                    self._fail(jobs[0], e)
                else:
                    await self._run_alone(jobs)
                continue
            finally:
                self.inflight -= 1
            self.metrics.generate_seconds += time.perf_counter() - t0
            self.metrics.batches += 1
            self.metrics.cancelled += sum(r.finish_reason == "cancelled" for r in out)
            for j, a, b in spans:
                if not j.future.done():
                    j.future.set_result(out[a:b])

    async def _run_alone(self, jobs: list[_Job]) -> None:
        loop = asyncio.get_running_loop()
        for j in jobs:
            call = functools.partial(self.backend.generate_rows, j.prompts, [j.params] * len(j.prompts),
                                     [j.cancel] * len(j.prompts), j.push)  # fmt: skip
            try:
                rows = await loop.run_in_executor(None, call)
            except Exception as e:
                self._fail(j, e)
                continue
            if not j.future.done():
                j.future.set_result(rows)

    def _fail(self, job: _Job, error: Exception) -> None:
        self.metrics.backend_errors += 1
        if not job.future.done():
            job.future.set_exception(error)


def _completion_logprobs(row: GenerationRow) -> dict[str, Any]:
    offsets, pos = [], 0
    for lp in row.logprobs:
        offsets.append(pos)
        pos += len(lp.token)
    return {
        "tokens": [lp.token for lp in row.logprobs],
        "token_logprobs": [lp.logprob for lp in row.logprobs],
        "top_logprobs": [dict(lp.top) for lp in row.logprobs],
        "text_offset": offsets,
    }


def _chat_logprobs(logprobs: list[Any]) -> dict[str, Any]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs]}  # fmt: skip


def _usage(rows: list[GenerationRow], n: int) -> dict[str, int]:
    prompt = sum(r.prompt_tokens for r in rows[::n])  # each prompt counted once, not once per choice
    completion = sum(len(r.token_ids) for r in rows)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def create_app(backend: Any, settings: ServeSettings | None = None) -> FastAPI:
    settings = settings or ServeSettings()
    metrics = Metrics()
    batcher = Batcher(backend, settings, metrics)

    async def lifespan(app: FastAPI):
        batcher.task = asyncio.create_task(batcher.run())
        yield
        # graceful shutdown: uvicorn stops accepting and waits for open requests; then the worker goes
        while not batcher.queue.empty() or batcher.inflight:
            await asyncio.sleep(0.01)
        batcher.task.cancel()

    app = FastAPI(title="nemo-fp4qat", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, limit=settings.max_body_bytes, metrics=metrics)
    app.state.batcher = batcher
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        status = 400 if err.get("type") == "json_invalid" else 422
        metrics.count_error(status)
        return error_response(status, f"{'.'.join(loc) or 'body'}: {err.get('msg')}", ".".join(loc) or None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.count_error(exc.status)
        response = error_response(exc.status, exc.message, exc.param, exc.kind)
        if exc.status == 503:
            response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.count_error(exc.status_code)
        return error_response(exc.status_code, str(exc.detail))

    def auth(request: Request) -> None:
        check_api_key(request.headers.get("authorization", ""), settings.api_key)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", dependencies=[Depends(auth)])
    async def ready() -> dict[str, Any]:
        return {"ready": True, "backend": backend.name, "model": backend.model_id}

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": backend.model_id, "object": "model", "owned_by": "nemo-fp4qat"}]}

    @app.get("/metrics", dependencies=[Depends(auth)], response_class=PlainTextResponse)
    async def metrics_text() -> str:
        return metrics.text()

    def check(req: _Sampling, prompts: list[str], max_tokens: int) -> None:
        check_generation(settings, prompts, req.n, max_tokens, req.model, backend.model_id, backend.count_tokens)

    async def submit(prompts: list[str], req: _Sampling, params: SamplingParams) -> _Job:
        if batcher.queue.qsize() >= settings.max_queued_requests:
            metrics.rejected_overload += 1
            raise APIError(503, f"server busy: {batcher.queue.qsize()} requests queued (max_queued_requests "
                           f"{settings.max_queued_requests}); retry shortly", kind="overloaded")  # fmt: skip
        loop = asyncio.get_running_loop()
        job = _Job([p for p in prompts for _ in range(req.n)], params, loop.create_future(), loop,
                   asyncio.Queue() if req.stream else None)  # fmt: skip
        await batcher.queue.put(job)
        return job

    async def finish(job: _Job) -> list[GenerationRow]:
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), timeout=settings.timeout_s)
        except asyncio.TimeoutError:
            job.cancel.set()  # generation stops at the next token
            raise APIError(504, f"request exceeded the timeout of {settings.timeout_s:g} s", kind="timeout") from None
        except Exception as e:  # the backend raised for this request (and only this one: Batcher._run_alone)
            raise _backend_error(e) from e

    def envelope(kind: str, rid: str) -> dict[str, Any]:
        return {"id": rid, "object": kind, "created": int(time.time()), "model": backend.model_id,
                "system_fingerprint": SYSTEM_FINGERPRINT}  # fmt: skip

    async def stream(job: _Job, req: _Sampling, rid: str, chat: bool, t0: float) -> AsyncIterator[str]:
        """Server-sent events: one chunk per choice whose text grew (or finished) at each step."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        sent = [0] * len(job.prompts)
        sent_lp = [0] * len(job.prompts)
        done = [False] * len(job.prompts)
        deadline = t0 + settings.timeout_s

        def chunk(i: int, text: str, reason: str | None, lps: list[Any]) -> str:
            if chat:
                delta: dict[str, Any] = {"content": text} if text or reason is None else {}
                if sent[i] == 0 and not done[i] and (text or reason is not None):
                    delta = {"role": "assistant", **delta}
                choice = {"index": i, "delta": delta, "finish_reason": reason,
                          "logprobs": _chat_logprobs(lps) if req.logprobs and lps else None}  # fmt: skip
            else:
                lp = None
                if req.logprobs is not None and lps:
                    lp = _completion_logprobs(GenerationRow(0, logprobs=lps))
                choice = {"index": i, "text": text, "finish_reason": reason, "logprobs": lp}
            return f"data: {json.dumps({**envelope(kind, rid), 'choices': [choice]})}\n\n"

        try:
            while not all(done):
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    job.cancel.set()
                    err = {"message": f"request exceeded the timeout of {settings.timeout_s:g} s", "type": "timeout"}
                    yield f"data: {json.dumps({'error': err})}\n\n"
                    return
                get = asyncio.ensure_future(job.events.get())  # type: ignore[union-attr]
                fut = asyncio.ensure_future(asyncio.shield(job.future))
                finished, _ = await asyncio.wait({get, fut}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                if get in finished:
                    snaps = get.result()
                    fut.cancel()
                else:
                    get.cancel()
                    if fut not in finished:
                        continue
                    try:
                        rows = fut.result()
                    except Exception as e:
                        err = _backend_error(e)
                        yield f"data: {json.dumps({'error': {'message': err.message, 'type': err.kind}})}\n\n"
                        done = [True] * len(done)
                        return
                    snaps = [(r.text, r.finish_reason, list(r.logprobs)) for r in rows]
                for i, (text, reason, lps) in enumerate(snaps):
                    if done[i]:
                        continue
                    new, new_lp = text[sent[i] :], lps[sent_lp[i] :]
                    if new or reason is not None:
                        yield chunk(i, new, reason, new_lp)
                        sent[i], sent_lp[i] = len(text), len(lps)
                        done[i] = reason is not None
            rows = await asyncio.shield(job.future)
            if req.stream_options is not None and req.stream_options.include_usage:
                yield f"data: {json.dumps({**envelope(kind, rid), 'choices': [], 'usage': _usage(rows, req.n)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not all(done):
                job.cancel.set()  # the client went away (or timed out): free its rows

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(req: CompletionRequest) -> Any:
        t0 = time.perf_counter()
        metrics.requests += 1
        prompts = completion_prompts(req.prompt)
        check(req, prompts, req.max_tokens)
        params = SamplingParams(req.max_tokens, req.temperature, req.top_p, req.stops(), req.seed, req.logprobs)
        job = await submit(prompts, req, params)
        rid = f"cmpl-{uuid.uuid4().hex[:16]}"
        if req.stream:
            return StreamingResponse(stream(job, req, rid, False, t0), media_type="text/event-stream")
        rows = await finish(job)
        record(t0, rows)
        choices = [{"index": i, "text": r.text, "finish_reason": r.finish_reason,
                    "logprobs": _completion_logprobs(r) if req.logprobs is not None else None}
                   for i, r in enumerate(rows)]  # fmt: skip
        return {**envelope("text_completion", rid), "choices": choices, "usage": _usage(rows, req.n)}

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat_completions(req: ChatCompletionRequest) -> Any:
        t0 = time.perf_counter()
        metrics.requests += 1
        check_chat_request(bool(backend.chat_template), backend.model_id, req.logprobs, req.top_logprobs)
        prompt = backend.apply_chat_template([{"role": m.role if m.role != "developer" else "system",
                                               "content": m.text()} for m in req.messages])  # fmt: skip
        max_tokens = chat_max_tokens(req.max_completion_tokens, req.max_tokens, settings.max_tokens)
        check(req, [prompt], max_tokens)
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = SamplingParams(max_tokens, req.temperature, req.top_p, req.stops(), req.seed, top)
        job = await submit([prompt], req, params)
        rid = f"chatcmpl-{uuid.uuid4().hex[:16]}"
        if req.stream:
            return StreamingResponse(stream(job, req, rid, True, t0), media_type="text/event-stream")
        rows = await finish(job)
        record(t0, rows)
        choices = [{"index": i, "message": {"role": "assistant", "content": r.text},
                    "finish_reason": r.finish_reason, "logprobs": _chat_logprobs(r.logprobs) if req.logprobs else None}
                   for i, r in enumerate(rows)]  # fmt: skip
        return {**envelope("chat.completion", rid), "choices": choices, "usage": _usage(rows, req.n)}

    def record(t0: float, rows: list[GenerationRow]) -> None:
        metrics.latency_sum += time.perf_counter() - t0
        metrics.latency_count += 1
        metrics.completion_tokens += sum(len(r.token_ids) for r in rows)

    return app
