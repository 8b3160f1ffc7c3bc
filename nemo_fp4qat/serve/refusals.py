"""What the HTTP API refuses, and with which status: the checks every request passes before it is queued.

Kept apart from the routes (``serve/app.py``) so each rule is a plain function that names its limit, and
so mutation testing reaches them: mutmut does not mutate decorated functions (every FastAPI route is
one). pydantic checks field types and ranges first (422, 400 for bad JSON); these add the limits that need
the settings or the backend: the body size (413, before the body is read whole), the API key (401),
batch rows, ``max_tokens`` and prompt tokens (422 / 413), the served model's id (404), and the chat
endpoint's preconditions.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

__all__ = [
    "APIError",
    "BodySizeLimit",
    "chat_max_tokens",
    "check_api_key",
    "check_chat_request",
    "check_generation",
    "completion_prompts",
    "error_response",
]


class APIError(Exception):
    """A refusal with its HTTP status, OpenAI error ``type`` and the request field (``param``) at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_response(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
) -> JSONResponse:
    """OpenAI's error body: ``{"error": {"message", "type", "param"}}``."""
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param}})


class BodySizeLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 without being read whole.

    Checked on the declared Content-Length and again while a chunked body streams in. Hand-written
    because neither Starlette nor FastAPI limits body size (uvicorn only limits header size).
    ``metrics`` counts the refusals (``rejected_body``, ``count_error``).
    """

    def __init__(self, app: Any, limit: int, metrics: Any) -> None:
        self.app, self.limit, self.metrics = app, limit, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(send)
        # Read the body first (the app reads it whole anyway to parse JSON), stopping at the limit, then
        # replay it to the app; after the replay `receive` is the server's again (disconnect detection).
        messages, seen = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.limit:
                return await self._reject(send)
            if not message.get("more_body", False):
                break

        async def replay() -> dict:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send: Any) -> None:
        self.metrics.rejected_body += 1
        self.metrics.count_error(413)
        msg = f"body: request body exceeds max_body_bytes {self.limit}; send a smaller request"
        response = error_response(413, msg, "body")
        await send({"type": "http.response.start", "status": 413, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})


def check_api_key(authorization: str, api_key: str | None) -> None:
    """401 unless ``authorization`` is ``Bearer <api_key>`` (no key configured: every request passes)."""
    if api_key is None:
        return
    scheme, _, token = authorization.partition(" ")
    # constant time, on bytes: compare_digest refuses non-ASCII str (a header can carry any latin-1 byte)
    given = token.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given, api_key.encode()):
        raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)", kind="authentication_error")


def completion_prompts(prompt: Any) -> list[str]:
    """The completions endpoint's ``prompt`` (a string or a list of them) as a list of non-empty strings."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not prompts or any(not isinstance(p, str) or not p for p in prompts):
        raise APIError(422, "prompt: give a non-empty string or list of non-empty strings", "prompt")
    return prompts


def check_chat_request(has_chat_template: bool, model_id: str, logprobs: bool, top_logprobs: int | None) -> None:
    """The chat endpoint needs the export's chat template (400), and ``top_logprobs`` needs ``logprobs`` (422)."""
    if not has_chat_template:
        raise APIError(400, f"messages: the export {model_id!r} has no chat template; use /v1/completions, "
                       "or export with a tokenizer that carries one", "messages")  # fmt: skip
    if top_logprobs is not None and not logprobs:
        raise APIError(422, "top_logprobs: requires logprobs: true", "top_logprobs")


def chat_max_tokens(max_completion_tokens: int | None, max_tokens: int | None, limit: int) -> int:
    """OpenAI's newer ``max_completion_tokens`` first, then ``max_tokens``, else the limit (at most 256)."""
    return max_completion_tokens or max_tokens or min(limit, 256)


def check_generation(
    settings: Any,
    prompts: list[str],
    n: int,
    max_tokens: int,
    model: str | None,
    model_id: str,
    count_tokens: Callable[[str], int],
) -> None:
    """The limits of ``settings`` (a ``ServeSettings``) and the served model, in the order a client fixes them.

    Rows (``len(prompts) * n``) over ``max_batch_size``: 422 on ``n`` (or ``prompt``); ``max_tokens`` over its
    limit: 422; a ``model`` other than the one served: 404; a prompt over ``max_prompt_tokens``: 413.
    """
    if len(prompts) * n > settings.max_batch_size:
        raise APIError(422, f"prompt: {len(prompts)} prompt(s) x n={n} exceed max_batch_size "
                       f"{settings.max_batch_size}", "n" if n > 1 else "prompt")  # fmt: skip
    if max_tokens > settings.max_tokens:
        raise APIError(422, f"max_tokens: {max_tokens} exceeds the limit {settings.max_tokens}", "max_tokens")
    if model is not None and model != model_id:
        raise APIError(404, f"model: {model!r} is not served (serving {model_id!r})", "model")
    for p in prompts:
        tokens = count_tokens(p)
        if tokens > settings.max_prompt_tokens:
            raise APIError(413, f"prompt: {tokens} tokens exceed max_prompt_tokens {settings.max_prompt_tokens}",
                           "prompt")  # fmt: skip
