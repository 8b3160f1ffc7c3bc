"""The official `openai` client against `nemo-fp4qat serve` of the embedded model's default (deployable)
export, on a real uvicorn server: completions, chat, streaming, n, logprobs, stop, auth, disconnects."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("openai")
pytest.importorskip("fastapi")
import httpx
import openai

from nemo_fp4qat import QATController
from nemo_fp4qat.demo.model import load_corpus, load_smollm2
from nemo_fp4qat.export import ExportConfig, export_checkpoint
from nemo_fp4qat.serve import PyTorchBackend, ServeSettings

from serving import running_server

# core environment only: serving reads exports through the plugin's own code, tested once (0.37's exports
# are validated and evaluated as deployed in tests/export)

KEY = "k-123"
M = "export"  # the served model id: the export directory's name
PROMPT = "Emma Woodhouse, handsome, clever, and rich, with a comfortable home"


@pytest.fixture(scope="module")
def trained_and_export(tmp_path_factory):
    model, tok = load_smollm2()
    ids = tok(load_corpus("emma")[:30_000])["input_ids"]
    ctl = QATController(policy="default", schedule="direct", calibration=2, forward_fn=lambda m, b: m(b))
    ctl.prepare(model)
    ctl.calibrate(model, [torch.tensor(ids[i * 128 : (i + 1) * 128])[None] for i in range(2)])
    out = export_checkpoint(
        model, tmp_path_factory.mktemp("srv") / "export", ExportConfig(kind="hf", runtime="pytorch"), tokenizer=tok
    )
    return model, tok, out


@pytest.fixture(scope="module")
def served(trained_and_export):
    backend = PyTorchBackend(trained_and_export[2])
    settings = ServeSettings(max_prompt_tokens=512, max_tokens=32, max_batch_size=8, timeout_s=120, api_key=KEY)
    with running_server(backend, settings) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0), url, backend


def test_completion_is_what_the_trained_model_generates(served, trained_and_export):
    """Greedy text through HTTP and the openai client = Hugging Face `generate` on the trained (fake-quant)
    model: the served export computes what was trained, and the hand-written decode loop what HF's does."""
    client, _, backend = served
    model, tok, _ = trained_and_export
    r = client.completions.create(model=backend.model_id, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.system_fingerprint
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    enc = tok(PROMPT, return_tensors="pt")
    with torch.no_grad():
        ref = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    assert r.choices[0].text == tok.decode(ref[0, enc.input_ids.shape[1] :], skip_special_tokens=True)
    assert r.usage.prompt_tokens == enc.input_ids.shape[1]


def test_streamed_completion_equals_the_whole_one(served):
    client, _, _ = served
    whole = client.completions.create(model=M, prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    stream = client.completions.create(
        model=M, prompt=PROMPT, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 3, "streamed token by token, not in one piece"
    assert "".join(c.choices[0].text for c in text_chunks) == whole
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_and_streamed_chat(served):
    client, _, _ = served
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Who is Emma?"}]
    r = client.chat.completions.create(model=M, messages=msgs, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str) and msg.content
    chunks = list(client.chat.completions.create(model=M, messages=msgs, max_tokens=12, temperature=0,
                                                 stream=True))  # fmt: skip
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_n_logprobs_and_stop(served):
    client, _, _ = served
    r = client.completions.create(model=M, prompt=PROMPT, max_tokens=6, temperature=0.9, seed=7, n=2, logprobs=2)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    assert r.usage.completion_tokens == 12
    greedy = client.completions.create(model=M, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1)
    lp = greedy.choices[0].logprobs
    assert [max(t.values()) for t in lp.top_logprobs] == pytest.approx(lp.token_logprobs)  # greedy = top-1
    hi = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(
        model=M, messages=hi, max_completion_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content)
    full = client.completions.create(model=M, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = full.strip().split()[1]
    cut = client.completions.create(model=M, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "zzz"])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert full.startswith(cut.choices[0].text)


def test_errors_the_client_sees(served, trained_and_export):
    client, url, _ = served
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).completions.create(model=M, prompt="x")
    assert httpx.get(f"{url}/health").status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-this-one", prompt="x")
    with pytest.raises(openai.UnprocessableEntityError, match="max_tokens"):
        client.completions.create(model=M, prompt="x", max_tokens=1000)
    with pytest.raises(openai.UnprocessableEntityError, match="top_logprobs"):
        client.chat.completions.create(model=M, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(openai.UnprocessableEntityError, match="frequency_penalty"):
        client.completions.create(
            model=M, prompt="x", frequency_penalty=0.5
        )  # unknown to this server: refused, not ignored
    no_template = PyTorchBackend(trained_and_export[2])
    no_template.tokenizer.chat_template = None
    with running_server(no_template, ServeSettings()) as other:
        r = httpx.post(f"{other}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_a_client_that_disconnects_mid_stream_frees_its_rows(served):
    client, url, _ = served
    H = {"Authorization": f"Bearer {KEY}"}

    def cancelled() -> int:
        text = httpx.get(f"{url}/metrics", headers=H).text
        return int(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith("fp4qat_cancelled_rows_total")))

    before = cancelled()
    body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=H, timeout=60) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: {")
    deadline = time.time() + 30
    while cancelled() == before and time.time() < deadline:
        time.sleep(0.1)
    assert cancelled() == before + 1, "the abandoned stream's row kept generating"
    assert client.completions.create(model=M, prompt="Hello", max_tokens=2).choices[0].finish_reason == "length"
