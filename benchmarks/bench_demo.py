"""The demo as a benchmark: wall time of `make demo`'s pipeline and its accuracy recovery.

recovery = (ppl_PTQ - ppl_QAT) / (ppl_PTQ - ppl_BF16_finetuned), target >= 0.9, with every variant
measured in the same run on the same data. Pass ``--report runs/demo/report.json`` to record a demo
that already ran instead of running it again.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


def main(report_path: str | None = None) -> dict:
    from common import machine, write_result

    if report_path is None:
        from nemo_fp4qat.demo import run_demo

        out = Path(tempfile.mkdtemp(prefix="nemo_fp4qat_demo_"))
        t = time.time()
        run_demo(out_dir=str(out))
        wall = time.time() - t
        report = json.loads((out / "report.json").read_text())
    else:
        report = json.loads(Path(report_path).read_text())
        wall = report["wall_time_s"]
    v, rec, cfg = report["variants"], report["recovery"], report["config"]
    md = "\n".join([
        "## Demo (`make demo`): wall time and accuracy recovery",
        "",
        f"Machine: {machine()}. SmolLM2-135M (fp32 on CPU), train on *Emma*, validate on *Persuasion* "
        f"({cfg['eval_windows']} x {cfg['eval_window']} tokens); {cfg['steps']} steps of "
        f"{cfg['batch_size']} x {cfg['seq_len']} tokens, AdamW lr {cfg['lr']}, policy `{cfg['policy']}`, "
        f"schedule `{cfg['schedule']}`, calibration {cfg['calib_samples']} samples.",
        "",
        "| variant | perplexity | bits/weight | weights vs bf16 |",
        "|---|---:|---:|---:|",
        *[f"| {k} | {x['ppl']:.3f} | {x['bits_per_weight']:.2f} | {x['weight_ratio_vs_bf16']:.3f} |"
          for k, x in v.items()],
        "",
        f"- recovery: **{rec:.3f}** (target >= 0.9: {'met' if rec >= 0.9 else 'NOT met'})",
        f"- wall time: **{wall:.0f} s** (budget 600 s: {'met' if wall <= 600 else 'NOT met'}; includes the one-time "
        "GGUF conversion only on a first run)",
        "",
    ])  # fmt: skip
    write_result("demo", md, {"report": report, "wall_s": wall})
    print(md)
    return report


if __name__ == "__main__":
    main(sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "--report" else None)
