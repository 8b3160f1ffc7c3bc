"""Writes the public-domain texts shipped in ``nemo_fp4qat/demo/data`` from Debian packages.

* Jane Austen's six novels, from ``r-cran-janeaustenr``: R character vectors (one line each) in a lazy-load database
  (``Rdata.rdb`` / ``.rdx``: per object, a 4-byte length and a zlib stream of an RDS serialization), which PyPI's
  ``rdata`` parses.
* The King James Version's Pentateuch (Genesis to Deuteronomy), from ``bible-kjv-text``, printed by ``bible-kjv``'s
  ``bible`` program, verse numbers dropped. With Austen's five novels besides *Persuasion* (879,640 SmolLM2 tokens)
  it makes the >= 1M distinct training tokens of the GPU acceptance run's ``qad_budget`` section.

The texts are committed, so nothing runs this at build or test time; it records how they were made:

    apt-get download r-cran-janeaustenr bible-kjv-text bible-kjv && for d in *.deb; do dpkg-deb -x $d deb; done
    pip install rdata && python benchmarks/extract_texts.py deb
"""

from __future__ import annotations

import re
import subprocess
import sys
import zlib
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "nemo_fp4qat" / "demo" / "data"


def austen(root: Path) -> None:
    import rdata

    base = root / "usr/lib/R/site-library/janeaustenr/data/Rdata"
    index = rdata.conversion.convert(rdata.parser.parse_file(f"{base}.rdx"))
    blob = Path(f"{base}.rdb").read_bytes()
    for name, (offset, length) in index["variables"].items():
        lines = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(blob[offset + 4 : offset + length])))
        text = "\n".join("" if line is None else str(line) for line in lines)
        (OUT / f"{name}.txt").write_text(text)
        print(f"{name}: {len(text):,} characters")


def pentateuch(root: Path) -> None:
    # the program takes its data file relative to its search path (an absolute -d fails to open)
    printed = subprocess.run([str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-d", "bible.data",
                              "Ge1:1-De34:12"], capture_output=True, text=True, check=True).stdout  # fmt: skip
    text = re.sub(r"^ +\d+ ", "", printed.strip("\n"), flags=re.M)  # the verse numbers
    (OUT / "kjv_pentateuch.txt").write_text(text)
    print(f"kjv_pentateuch: {len(text):,} characters")


if __name__ == "__main__":
    austen(Path(sys.argv[1]))
    pentateuch(Path(sys.argv[1]))
