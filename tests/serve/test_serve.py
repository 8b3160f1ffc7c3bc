"""The HTTP API against a real uvicorn server on 127.0.0.1 with a real HTTP client (httpx)."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
import httpx

from nemo_fp4qat.export import ExportConfig, export_checkpoint
from nemo_fp4qat.qat.modelopt_compat import uses_list_config
from nemo_fp4qat.serve import PyTorchBackend, ServeSettings

from serving import char_tokenizer, running_server
from tiny_models import VOCAB, calibrated_tiny_llama

# core environment only: serving reads exports through the plugin's own code, tested once (0.37's exports
# are validated and evaluated as deployed in tests/export)

KEY = "s3cret-token"


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):

    model = calibrated_tiny_llama("trtllm_mixed", seed=5)
    served = ExportConfig(kind="hf", runtime="pytorch")  # this plugin's server: float32, as trained
    return export_checkpoint(model, tmp_path_factory.mktemp("srv") / "export", served, tokenizer=char_tokenizer())


@pytest.fixture(scope="module")
def server(export_dir):
    backend = PyTorchBackend(export_dir)
    settings = ServeSettings(max_prompt_tokens=64, max_tokens=32, max_batch_size=4, timeout_s=20, api_key=KEY)
    with running_server(backend, settings) as url:
        yield url, backend


H = {"Authorization": f"Bearer {KEY}"}


def test_served_weights_are_the_exported_codes(export_dir):
    from nemo_fp4qat.export import load_export
    from nemo_fp4qat.export.unpack import dequantize_linear

    backend = PyTorchBackend(export_dir)
    _, _, (t,) = load_export(export_dir)
    name = "model.layers.1.mlp.down_proj"
    parts = {k.rsplit(".", 1)[1]: v for k, v in t.items() if k.rsplit(".", 1)[0] == name}
    w = backend.model.get_submodule(name).weight
    assert torch.equal(w, dequantize_linear(parts, "NVFP4").to(w.dtype))


def test_greedy_completion_equals_the_exported_model(server):
    url, backend = server
    prompts = ["hello world", "the quick brown fox"]
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompts, "max_tokens": 8}, headers=H, timeout=60)
    assert r.status_code == 200, r.text
    direct = backend.generate(prompts, 8)
    assert [c["text"] for c in r.json()["choices"]] == [d.text for d in direct]
    assert r.json()["usage"]["completion_tokens"] == sum(d.completion_tokens for d in direct) > 0


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        (b"{not json", 400, None),
        ({"prompt": 5}, 422, "prompt"),
        ({"prompt": "x" * 100}, 413, "prompt"),
        ({"prompt": "hi", "max_tokens": -1}, 422, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 10**6}, 422, "max_tokens"),
        ({"prompt": "hi", "bogus": 1}, 422, "bogus"),
        ({"prompt": ["a"] * 9}, 422, "prompt"),
        ({"prompt": "hi", "temperature": "hot"}, 422, "temperature"),
        ({"prompt": "hi", "model": "some-other-model"}, 404, "model"),
    ],
)
def test_bad_requests_get_4xx_naming_the_field(server, body, status, field):
    url, _ = server
    kw = {"content": body, "headers": {**H, "content-type": "application/json"}} if isinstance(body, bytes) else {
        "json": body, "headers": H}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if field:
        assert field in err["message"]
    assert httpx.get(f"{url}/ready", headers=H).status_code == 200  # still serving


def test_api_key_on_every_endpoint_but_health(server):
    url, _ = server
    assert httpx.get(f"{url}/health").status_code == 200
    for path in ("/ready", "/v1/models", "/metrics"):
        assert httpx.get(f"{url}{path}").status_code == 401
        assert httpx.get(f"{url}{path}", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{url}{path}", headers=H).status_code == 200
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}).status_code == 401


def test_concurrent_load_batches_without_errors(server):
    url, _ = server
    n, conc = 64, 16

    def one(i):
        with httpx.Client(timeout=60) as c:
            return c.post(f"{url}/v1/completions", json={"prompt": f"request {i}", "max_tokens": 4}, headers=H)

    with concurrent.futures.ThreadPoolExecutor(conc) as ex:
        codes = [r.status_code for r in ex.map(one, range(n))]
    assert codes == [200] * n, codes
    metrics = httpx.get(f"{url}/metrics", headers=H).text
    batches = int(next(line.split()[1] for line in metrics.splitlines() if line.startswith("fp4qat_batches_total")))
    assert batches < n  # concurrent requests were batched together


@pytest.mark.skipif(not uses_list_config(), reason="modelopt 0.37's W4A8 export is refused up front")
def test_w4a8_export_is_served_with_the_trained_numerics(tmp_path):
    # NVFP4 weights from their codes and scales, FP8 inputs from the exported input_scale: the logits of
    # the trained fake-quantized model (float32 throughout)

    model = calibrated_tiny_llama("nvfp4_w4a8", seed=5)
    out = export_checkpoint(
        model, tmp_path / "w4a8", ExportConfig(kind="hf", runtime="pytorch"), tokenizer=char_tokenizer()
    )
    backend = PyTorchBackend(out)
    assert backend.algos["model.layers.0.mlp.down_proj"] == "W4A8_NVFP4_FP8"
    x = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(x).logits, backend.model(x).logits
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()


def test_a_request_past_the_timeout_gets_504_and_its_generation_stops(export_dir):
    """504 names the timeout; the generation is told to stop (its cancel event is set) and the server
    goes on serving."""
    backend = PyTorchBackend(export_dir)
    stopped = []
    original = backend.generate_rows

    def slow_generate_rows(prompts, params, cancelled=None, on_step=None):
        for _ in range(200):  # slower than the timeout, unless told to stop
            if cancelled and all(c is not None and c.is_set() for c in cancelled):
                stopped.append(True)
                break
            time.sleep(0.01)
        return original(prompts, params, cancelled, on_step)

    backend.generate_rows = slow_generate_rows
    settings = ServeSettings(max_prompt_tokens=64, max_tokens=32, max_batch_size=4, timeout_s=0.3)
    with running_server(backend, settings) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["type"] == "timeout" and "0.3 s" in r.json()["error"]["message"]
        deadline = time.time() + 10
        while not stopped and time.time() < deadline:
            time.sleep(0.05)
        assert stopped, "the timed-out generation was not told to stop"
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_an_unquantized_model_directory_is_served_as_it_is(tmp_path):
    """The baseline beside an export (the load benchmark serves both): a plain Hugging Face directory
    loads unchanged, and the decode loop's greedy text equals Hugging Face `generate`."""
    from tiny_models import tiny_llama

    model = tiny_llama(seed=3).eval()
    tok = char_tokenizer()
    model.save_pretrained(tmp_path / "plain")
    tok.save_pretrained(tmp_path / "plain")
    backend = PyTorchBackend(tmp_path / "plain")
    assert backend.algos == {}
    for name, p in model.state_dict().items():
        assert torch.equal(backend.model.state_dict()[name], p), name
    enc = tok("hello", return_tensors="pt", return_token_type_ids=False)
    with torch.no_grad():
        ref = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert backend.generate(["hello"], 6)[0].text == tok.decode(
        ref[0, enc.input_ids.shape[1] :], skip_special_tokens=True
    )
