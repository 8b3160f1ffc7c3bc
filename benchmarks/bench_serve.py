"""Serving load test: 200 completions, 16 concurrent, against a real server on 127.0.0.1.

The served model is a tiny NVFP4/FP8 (trtllm_mixed) Llama exported by the plugin (the test
fixture's), so the figures measure the server (batching, HTTP, validation), not a real model.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from common import RESULTS_DIR, machine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

N, CONCURRENCY, MAX_TOKENS = 200, 16, 8


def main() -> None:
    from test_export import _qat_model
    from test_serve import _char_tokenizer

    from nemo_fp4qat.export import ExportConfig, export_checkpoint
    from nemo_fp4qat.serve import PyTorchBackend, ServeSettings, create_app

    with tempfile.TemporaryDirectory() as d:
        out = export_checkpoint(_qat_model("trtllm_mixed", seed=5), Path(d) / "export", ExportConfig(kind="hf"),
                                tokenizer=_char_tokenizer())  # fmt: skip
        backend = PyTorchBackend(out)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(backend, ServeSettings(max_batch_size=8, max_tokens=32))
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/v1/completions"

    def one(i: int) -> tuple[int, float, int]:
        t = time.perf_counter()
        with httpx.Client(timeout=120) as c:
            r = c.post(url, json={"prompt": f"request number {i}", "max_tokens": MAX_TOKENS})
        toks = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
        return r.status_code, time.perf_counter() - t, toks

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as ex:
        res = list(ex.map(one, range(N)))
    wall = time.perf_counter() - t0
    srv.should_exit = True
    lat = sorted(r[1] for r in res)
    row = {"requests": N, "concurrency": CONCURRENCY, "errors": sum(r[0] != 200 for r in res),
           "wall_s": wall, "req_per_s": N / wall, "tokens_per_s": sum(r[2] for r in res) / wall,
           "latency_p50_s": statistics.median(lat), "latency_p95_s": lat[int(0.95 * N) - 1],
           "batches": app.state.metrics.batches}  # fmt: skip
    lines = ["## Serving load test (tiny exported Llama, PyTorch backend, 127.0.0.1)", "",
             f"Machine: {machine()}. {N} requests, {CONCURRENCY} concurrent, max_tokens {MAX_TOKENS}.", "",
             "| errors | req/s | tokens/s | p50 latency | p95 latency | generate batches |",
             "|---|---|---|---|---|---|",
             f"| {row['errors']} | {row['req_per_s']:.1f} | {row['tokens_per_s']:.1f} | {row['latency_p50_s']:.3f} s | "
             f"{row['latency_p95_s']:.3f} s | {row['batches']} for {N} requests |", ""]  # fmt: skip
    (RESULTS_DIR / "serve_load.md").write_text("\n".join(lines))
    (RESULTS_DIR / "serve_load.json").write_text(json.dumps(row, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
