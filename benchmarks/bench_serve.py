"""Serving load test: the demo model's default export vs the same model unquantized, side by side.

For each variant a real server on 127.0.0.1; ``CLIENTS`` concurrent clients for ``DURATION_S`` seconds,
each cycling through completions, chat, streamed completions and streamed chat (the official
request shapes, sent with httpx). Time to first token is the first streamed content chunk (streaming)
or the whole answer (otherwise). Loopback only, bounded in time; requests still in flight when the
time is up are waited for and counted.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from common import RESULTS_DIR, machine

CLIENTS, DURATION_S, MAX_TOKENS = 64, 60.0, 16
KINDS = ["completion", "chat", "completion-stream", "chat-stream"]


def _body(kind: str, i: int) -> tuple[str, dict]:
    chat = kind.startswith("chat")
    body: dict = {"max_tokens": MAX_TOKENS, "temperature": 0, "stream": kind.endswith("stream")}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Tell me about Emma, request {i}."}]
    else:
        body["prompt"] = f"Emma Woodhouse, request {i}, was"
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


async def _client(url: str, cid: int, deadline: float, out: list[dict]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        i = 0
        while time.perf_counter() < deadline:
            kind = KINDS[(cid + i) % len(KINDS)]
            path, body = _body(kind, cid * 1000 + i)
            t0 = time.perf_counter()
            rec = {"kind": kind, "ok": False, "ttft": None, "latency": None, "tokens": 0}
            try:
                if body["stream"]:
                    body["stream_options"] = {"include_usage": True}
                    async with c.stream("POST", path, json=body) as r:
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            d = json.loads(line[6:])
                            if "error" in d:
                                break
                            ch = d.get("choices") or []
                            text = ch and (ch[0].get("text") or (ch[0].get("delta") or {}).get("content"))
                            if text and rec["ttft"] is None:
                                rec["ttft"] = time.perf_counter() - t0
                            if d.get("usage"):
                                rec["tokens"] = d["usage"]["completion_tokens"]
                                rec["ok"] = r.status_code == 200
                else:
                    r = await c.post(path, json=body)
                    rec["ok"] = r.status_code == 200
                    rec["tokens"] = r.json()["usage"]["completion_tokens"] if rec["ok"] else 0
                    rec["ttft"] = time.perf_counter() - t0
            except httpx.HTTPError:
                rec["ok"] = False
            rec["latency"] = time.perf_counter() - t0
            out.append(rec)
            i += 1


def _pct(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def _load(model_dir: Path) -> dict:
    from nemo_fp4qat.serve import PyTorchBackend, ServeSettings

    from serving import running_server

    backend = PyTorchBackend(model_dir)
    settings = ServeSettings(max_prompt_tokens=256, max_tokens=MAX_TOKENS, max_batch_size=8, timeout_s=600)
    with running_server(backend, settings) as url:
        out: list[dict] = []
        t0 = time.perf_counter()

        async def run() -> None:
            deadline = time.perf_counter() + DURATION_S
            await asyncio.gather(*[_client(url, i, deadline, out) for i in range(CLIENTS)])

        asyncio.run(run())
        wall = time.perf_counter() - t0
    ok = [r for r in out if r["ok"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    stream_ttft = [r["ttft"] for r in ok if r["kind"].endswith("stream") and r["ttft"] is not None]
    return {"requests": len(out), "errors": len(out) - len(ok), "wall_s": wall, "req_per_s": len(ok) / wall,
            "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_p50_s": statistics.median(ttft) if ttft else float("nan"), "ttft_p95_s": _pct(ttft, 0.95),
            "stream_ttft_p50_s": statistics.median(stream_ttft) if stream_ttft else float("nan"),
            "latency_p95_s": _pct([r["latency"] for r in ok], 0.95),
            "by_kind": {k: sum(r["kind"] == k for r in ok) for k in KINDS}}  # fmt: skip


def main() -> None:
    import torch

    from nemo_fp4qat import QATController
    from nemo_fp4qat.demo.model import load_corpus, load_smollm2
    from nemo_fp4qat.export import ExportConfig, export_checkpoint

    rows = {}
    with tempfile.TemporaryDirectory() as d:
        model, tok = load_smollm2()
        plain = Path(d) / "smollm2-unquantized"
        model.save_pretrained(plain)
        tok.save_pretrained(plain)
        ids = tok(load_corpus("emma")[:60_000])["input_ids"]
        ctl = QATController(policy="default", schedule="direct", calibration=4, forward_fn=lambda m, b: m(b))
        ctl.prepare(model)
        ctl.calibrate(model, [torch.tensor(ids[i * 128 : (i + 1) * 128])[None] for i in range(4)])
        export = export_checkpoint(model, Path(d) / "smollm2-default", ExportConfig(kind="hf"), tokenizer=tok)
        del model
        for name, path in (("default export (FP8 attention, NVFP4 MLP)", export), ("unquantized", plain)):
            rows[name] = _load(path)
            print(name, rows[name], flush=True)
    q, b = rows["default export (FP8 attention, NVFP4 MLP)"], rows["unquantized"]
    lines = ["## Serving load test (SmolLM2-135M, PyTorch backend on the CPU, 127.0.0.1)", "",
             f"Machine: {machine()}. {CLIENTS} concurrent clients for {DURATION_S:.0f} s, each cycling through "
             f"completions, chat, streamed completions and streamed chat; max_tokens {MAX_TOKENS}, greedy; "
             "max_batch_size 8. `benchmarks/bench_serve.py`.", "",
             "| model | requests | errors | req/s | tokens/s | TTFT p50 | TTFT p95 | streamed TTFT p50 | latency p95 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in rows.items():
        lines.append(f"| {name} | {r['requests']} | {r['errors']} | {r['req_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['ttft_p50_s']:.2f} s | {r['ttft_p95_s']:.2f} s | {r['stream_ttft_p50_s']:.2f} s | "
                     f"{r['latency_p95_s']:.2f} s |")  # fmt: skip
    lines += ["", f"- errors: **{q['errors'] + b['errors']}** (target 0)",
              f"- tokens/s, export / unquantized: **{q['tokens_per_s'] / b['tokens_per_s']:.2f}** (the CPU backend "
              "dequantizes weights once and fake-quantizes activations per step: no FP4 speed-up on a CPU; "
              "TensorRT-LLM on a GPU is where FP4 is fast)", ""]  # fmt: skip
    (RESULTS_DIR / "serve_load.md").write_text("\n".join(lines))
    (RESULTS_DIR / "serve_load.json").write_text(json.dumps(rows, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
