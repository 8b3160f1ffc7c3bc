"""The serving API's refusals (``serve/refusals.py``) at their limits: one under passes, one over is refused
with the status, error type, field and message a client acts on. The HTTP tests (test_serve*.py) show the
same refusals through a running server; here each rule is pinned at its boundary, and the body-size
middleware runs under a real ASGI app (httpx's ASGI transport: no socket, the same messages a server sends)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request

from nemo_fp4qat.serve import ServeSettings
from nemo_fp4qat.serve.app import Metrics
from nemo_fp4qat.serve.refusals import (
    APIError,
    BodySizeLimit,
    chat_max_tokens,
    check_api_key,
    check_chat_request,
    check_generation,
    completion_prompts,
    error_response,
)

# core environment only: serving reads exports through the plugin's own code, tested once (0.37's exports
# are validated and evaluated as deployed in tests/export)

LIMITS = ServeSettings(max_batch_size=4, max_tokens=8, max_prompt_tokens=5)


def _refusal(fn, *args) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    return info.value


def _gen(prompts, n=1, max_tokens=8, model=None):
    check_generation(LIMITS, prompts, n, max_tokens, model, "served-id", len)  # one token per character


def test_rows_up_to_max_batch_size_pass_and_one_more_is_refused_on_the_field_that_grew():
    _gen(["a", "b"], n=2)  # 4 rows: the limit
    e = _refusal(_gen, ["a"] * 5)
    assert (e.status, e.param, e.kind) == (422, "prompt", "invalid_request_error")
    assert e.message == "prompt: 5 prompt(s) x n=1 exceed max_batch_size 4"
    e = _refusal(_gen, ["a"], 5)
    assert (e.status, e.param) == (422, "n") and e.message == "prompt: 1 prompt(s) x n=5 exceed max_batch_size 4"
    e = _refusal(_gen, ["a", "b", "c"], 2)
    assert e.param == "n"


def test_max_tokens_up_to_the_limit_pass():
    _gen(["a"], max_tokens=8)
    e = _refusal(_gen, ["a"], 1, 9)
    assert (e.status, e.param) == (422, "max_tokens") and e.message == "max_tokens: 9 exceeds the limit 8"


def test_only_the_served_model_or_none_is_accepted():
    _gen(["a"], model=None)
    _gen(["a"], model="served-id")
    e = _refusal(_gen, ["a"], 1, 8, "other")
    assert (e.status, e.param) == (404, "model")
    assert e.message == "model: 'other' is not served (serving 'served-id')"


def test_every_prompt_is_counted_against_max_prompt_tokens():
    _gen(["abcde", "x"])  # 5 tokens: the limit
    e = _refusal(_gen, ["x", "abcdef"])  # the second prompt is the long one
    assert (e.status, e.param) == (413, "prompt")
    assert e.message == "prompt: 6 tokens exceed max_prompt_tokens 5"


def test_the_first_rule_broken_is_the_one_reported():
    e = _refusal(_gen, ["abcdefgh"] * 5, 1, 99, "other")  # every rule broken: the batch size comes first
    assert e.param == "prompt" and "max_batch_size" in e.message
    e = _refusal(_gen, ["abcdefgh"], 1, 99, "other")
    assert e.param == "max_tokens"
    e = _refusal(_gen, ["abcdefgh"], 1, 8, "other")
    assert e.status == 404


@pytest.mark.parametrize("header", ["Bearer k3y", "bearer k3y", "BEARER k3y", "Bearer  k3y ", "Bearer k3y\t"])
def test_the_right_key_passes_in_any_scheme_case_and_padding(header):
    check_api_key(header, "k3y")


@pytest.mark.parametrize("header", ["", "k3y", "Bearer", "Bearer wrong", "Bearer k3y2", "Token k3y", "Bearerk3y",
                                    "Bearer k\udce9y"])  # fmt: skip
def test_anything_else_is_refused_with_401(header):
    e = _refusal(check_api_key, header, "k3y")
    assert (e.status, e.kind, e.param) == (401, "authentication_error", None)
    assert e.message == "missing or invalid API key (Authorization: Bearer <key>)"


def test_without_a_configured_key_every_request_passes():
    for header in ("", "Bearer anything", "junk"):
        check_api_key(header, None)


def test_completion_prompts_are_a_non_empty_list_of_non_empty_strings():
    assert completion_prompts("hi") == ["hi"]
    assert completion_prompts(["a", "b"]) == ["a", "b"]
    assert completion_prompts(("a",)) == ["a"]
    for bad in ("", [], ["a", ""], ["a", 3]):
        e = _refusal(completion_prompts, bad)
        assert (e.status, e.param) == (422, "prompt")
        assert e.message == "prompt: give a non-empty string or list of non-empty strings"


def test_chat_needs_a_template_and_top_logprobs_needs_logprobs():
    check_chat_request(True, "m", False, None)
    check_chat_request(True, "m", True, 0)
    check_chat_request(True, "m", True, 5)
    e = _refusal(check_chat_request, False, "m", False, None)
    assert (e.status, e.param) == (400, "messages")
    assert e.message == ("messages: the export 'm' has no chat template; use /v1/completions, or export with a "
                         "tokenizer that carries one")  # fmt: skip
    for top in (0, 3):  # 0 is a value too: it still asks for logprobs
        e = _refusal(check_chat_request, True, "m", False, top)
        assert (e.status, e.param, e.message) == (422, "top_logprobs", "top_logprobs: requires logprobs: true")


def test_chat_max_tokens_prefers_max_completion_tokens_then_max_tokens_then_the_capped_limit():
    assert chat_max_tokens(5, 7, 100) == 5
    assert chat_max_tokens(None, 7, 100) == 7
    assert chat_max_tokens(None, None, 100) == 100
    assert chat_max_tokens(None, None, 1000) == 256


def test_error_response_is_openais_error_body():
    r = error_response(404, "model: gone", "model")
    assert r.status_code == 404
    assert json.loads(r.body) == {
        "error": {"message": "model: gone", "type": "invalid_request_error", "param": "model"}
    }
    r = error_response(504, "slow", kind="timeout")
    assert json.loads(r.body) == {"error": {"message": "slow", "type": "timeout", "param": None}}
    assert str(APIError(418, "teapot")) == "teapot"


def _echo_app(limit: int) -> tuple[BodySizeLimit, Metrics]:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"received": len(await request.body())}

    metrics = Metrics()
    return BodySizeLimit(app, limit, metrics), metrics


def _post(asgi, content, headers=None) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://t") as c:
            return await c.post("/echo", content=content, headers=headers or {})

    return asyncio.run(go())


def test_a_body_at_the_limit_reaches_the_app_whole_and_one_byte_more_is_refused():
    asgi, metrics = _echo_app(10)
    r = _post(asgi, b"x" * 10)
    assert r.status_code == 200 and r.json() == {"received": 10}
    r = _post(asgi, b"x" * 11)
    assert r.status_code == 413
    assert r.json() == {"error": {"message": "body: request body exceeds max_body_bytes 10; send a smaller request",
                                  "type": "invalid_request_error", "param": "body"}}  # fmt: skip
    assert metrics.rejected_body == 1 and metrics.errors == {413: 1}
    assert r.headers["content-type"] == "application/json"


def test_a_chunked_body_is_measured_as_it_streams_in_and_replayed_to_the_app_in_full():
    asgi, metrics = _echo_app(10)

    def chunks(n):
        async def gen():
            for _ in range(n):
                yield b"abcd"

        return gen()

    r = _post(asgi, chunks(2))  # no Content-Length: 8 bytes in two chunks
    assert r.status_code == 200 and r.json() == {"received": 8}
    r = _post(asgi, chunks(3))  # 12 bytes: refused once the third chunk arrives
    assert r.status_code == 413 and metrics.rejected_body == 1


def _raw(limit: int, incoming: list[dict], app_reads: int) -> tuple[list[dict], list[dict], list]:
    """The middleware over an app that reads ``app_reads`` messages, fed ``incoming`` by hand (what a server's
    ``receive`` returns, in order): (what the app received, what went back to the client, the sends the app got)."""
    got: list[dict] = []
    sends: list = []

    async def app(scope, receive, send):
        sends.append(send)
        for _ in range(app_reads):
            got.append(await receive())

    queue = list(incoming)

    async def receive():
        return queue.pop(0)

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    asyncio.run(BodySizeLimit(app, limit, Metrics())({"type": "http", "headers": []}, receive, send))
    return got, sent, sends


def test_a_message_without_more_body_ends_the_body():
    got, sent, _ = _raw(10, [{"type": "http.request", "body": b"abc"}], 1)  # ASGI: more_body defaults to false
    assert got == [{"type": "http.request", "body": b"abc"}] and not sent


def test_after_the_body_the_app_receives_from_the_server_again():
    """Once the buffered body is replayed, ``receive`` is the server's: a disconnect reaches the app."""
    incoming = [{"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.request", "body": b"c"},
                {"type": "http.disconnect"}]  # fmt: skip
    got, _, _ = _raw(10, incoming, 3)
    assert got == incoming


def test_a_client_gone_before_its_body_ended_is_still_handed_to_the_app():
    """The app sees the disconnect (and answers nothing), as it would without the middleware."""
    incoming = [{"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.disconnect"}]
    got, sent, _ = _raw(10, incoming, 2)
    assert got == incoming and not sent


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_read():
    seen: list[tuple] = []

    async def inner(scope, receive, send):  # the app behind the middleware
        seen.append((scope, receive, send))

    limit = BodySizeLimit(inner, 10, Metrics())
    sent: list[dict] = []

    async def receive():
        raise AssertionError("the body was read")

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "headers": [(b"content-length", b"11")]}
    asyncio.run(limit(scope, receive, send))
    assert sent[0]["status"] == 413 and not seen
    assert dict(sent[0]["headers"])[b"content-type"] == b"application/json"
    lifespan = {"type": "lifespan"}
    asyncio.run(limit(lifespan, receive, send))  # not HTTP: passed to the app untouched
    assert seen == [(lifespan, receive, send)]
