"""The HTTP API (FastAPI): OpenAI-style completions over a serving backend.

Endpoints: ``GET /health`` (liveness, no auth), ``GET /ready``, ``GET /v1/models``,
``POST /v1/completions``, ``GET /metrics`` (Prometheus text). Requests are validated by pydantic
and by configured limits; every error is a JSON ``{"error": {"message", "type", "param"}}`` with a
4xx status (504 when a request exceeds the timeout, which also stops its generation between
tokens). Concurrent requests with the same sampling parameters are batched up to
``max_batch_size`` prompts.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ["CompletionRequest", "ServeSettings", "create_app"]


@dataclass
class ServeSettings:
    max_prompt_tokens: int = 1024
    max_tokens: int = 256
    max_batch_size: int = 8
    timeout_s: float = 60.0
    batch_window_s: float = 0.005
    api_key: str | None = None


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[str] = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: Literal[1] = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param}})


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
            "# TYPE fp4qat_tokens_per_second gauge", f"fp4qat_tokens_per_second {tps:.3f}",
        ]  # fmt: skip
        return "\n".join(lines) + "\n"


@dataclass
class _Job:
    prompts: list[str]
    key: tuple
    future: asyncio.Future
    cancelled: bool = False


class Batcher:
    """Groups queued requests with identical sampling parameters into one ``generate`` call."""

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
                if j.key == first.key and n + len(j.prompts) <= self.settings.max_batch_size:
                    jobs.append(j)
                    n += len(j.prompts)
                else:
                    held.append(j)
            for j in held:
                self.queue.put_nowait(j)
            jobs = [j for j in jobs if not j.cancelled]
            if not jobs:
                continue
            cancel = threading.Event()
            for j in jobs:
                j.future.cancel_event = cancel  # type: ignore[attr-defined]
            prompts = [p for j in jobs for p in j.prompts]
            max_tokens, temperature, top_p, stop, seed = first.key
            t0 = time.perf_counter()
            self.inflight += 1
            try:
                call = functools.partial(self.backend.generate, prompts, max_tokens, temperature, top_p,
                                         list(stop) if stop else None, seed, cancel)  # fmt: skip
                out = await loop.run_in_executor(None, call)
            except Exception as e:  # a backend failure answers every request of the batch
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(e)
                continue
            finally:
                self.inflight -= 1
            self.metrics.generate_seconds += time.perf_counter() - t0
            self.metrics.batches += 1
            i = 0
            for j in jobs:
                if not j.future.done():
                    j.future.set_result(out[i : i + len(j.prompts)])
                i += len(j.prompts)


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
    app.state.batcher = batcher
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        status = 400 if err.get("type") == "json_invalid" else 422
        metrics.errors[status] = metrics.errors.get(status, 0) + 1
        return _error(status, f"{'.'.join(loc) or 'body'}: {err.get('msg')}", ".".join(loc) or None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.errors[exc.status] = metrics.errors.get(exc.status, 0) + 1
        return _error(exc.status, exc.message, exc.param, exc.kind)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.errors[exc.status_code] = metrics.errors.get(exc.status_code, 0) + 1
        return _error(exc.status_code, str(exc.detail))

    def auth(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), settings.api_key):
            raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)", kind="authentication_error")

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

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(req: CompletionRequest) -> dict[str, Any]:
        t0 = time.perf_counter()
        metrics.requests += 1
        prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
        if not prompts or any(not isinstance(p, str) or not p for p in prompts):
            raise APIError(422, "prompt: give a non-empty string or list of non-empty strings", "prompt")
        if len(prompts) > settings.max_batch_size:
            raise APIError(422, f"prompt: {len(prompts)} prompts exceed max_batch_size {settings.max_batch_size}",
                           "prompt")  # fmt: skip
        if req.max_tokens > settings.max_tokens:
            raise APIError(422, f"max_tokens: {req.max_tokens} exceeds the limit {settings.max_tokens}", "max_tokens")
        if req.model is not None and req.model != backend.model_id:
            raise APIError(404, f"model: {req.model!r} is not served (serving {backend.model_id!r})", "model")
        for p in prompts:
            n = backend.count_tokens(p)
            if n > settings.max_prompt_tokens:
                raise APIError(413, f"prompt: {n} tokens exceed max_prompt_tokens {settings.max_prompt_tokens}",
                               "prompt")  # fmt: skip
        stop = tuple([req.stop] if isinstance(req.stop, str) else (req.stop or []))
        key = (req.max_tokens, req.temperature, req.top_p, stop, req.seed)
        job = _Job(prompts, key, asyncio.get_running_loop().create_future())
        await batcher.queue.put(job)
        try:
            results = await asyncio.wait_for(asyncio.shield(job.future), timeout=settings.timeout_s)
        except asyncio.TimeoutError:
            job.cancelled = True
            ev = getattr(job.future, "cancel_event", None)
            if ev is not None:
                ev.set()  # generation stops at the next token
            raise APIError(504, f"request exceeded the timeout of {settings.timeout_s:g} s", kind="timeout") from None
        dt = time.perf_counter() - t0
        metrics.latency_sum += dt
        metrics.latency_count += 1
        metrics.completion_tokens += sum(r.completion_tokens for r in results)
        return {
            "id": f"cmpl-{uuid.uuid4().hex[:16]}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": backend.model_id,
            "choices": [
                {"index": i, "text": r.text, "finish_reason": r.finish_reason, "logprobs": None}
                for i, r in enumerate(results)
            ],
            "usage": {
                "prompt_tokens": sum(r.prompt_tokens for r in results),
                "completion_tokens": sum(r.completion_tokens for r in results),
                "total_tokens": sum(r.prompt_tokens + r.completion_tokens for r in results),
            },
        }

    return app
