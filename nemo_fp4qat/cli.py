"""The ``nemo-fp4qat`` command line: ``demo``, ``formats``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _formats(_: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .formats import list_formats

    t = Table(title="nemo-fp4qat formats")
    for col in ("name", "element", "block", "scale", "bits/elem", "TRT-LLM quant_algo", "native on"):
        t.add_column(col)
    for f in list_formats():
        if f.element is None:
            el = "-"
        elif f.element[0] == "int":
            el = f"INT{f.element[1]}"
        else:
            el = f"E{f.element[0]}M{f.element[1]}"
        t.add_row(
            f.name,
            el,
            str(f.block_size or "-"),
            f.scale,
            f"{f.bits_per_element:g}",
            f.trtllm_quant_algo or "-",
            ", ".join(f.hardware),
        )
    Console().print(t)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(out_dir=args.out, quick=args.quick)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nemo-fp4qat", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run the end-to-end FP4 QAT demo on the embedded default")
    d.add_argument("--out", default="runs/demo", help="output directory")
    d.add_argument("--quick", action="store_true", help="a few steps only (smoke test)")
    d.set_defaults(fn=_demo)
    f = sub.add_parser("formats", help="list the supported quantization formats")
    f.set_defaults(fn=_formats)
    args = p.parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
