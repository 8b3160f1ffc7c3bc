"""Prints the uv flags that give uv the package sources pip is configured with on this machine.

uv reads no pip configuration, and these machines configure pip with local wheel folders and indexes (among them
the CPU build of torch that the requirement files pin; PyPI's build of the same version is CUDA's, gigabytes). So
the Makefile hands pip's ``find-links``, ``index-url`` and ``extra-index-url`` (from ``pip config`` and ``PIP_*``
variables) and its ``constraint`` files to uv, with pip's rule of taking the best version across all sources.
Nothing is printed for a source pip does not have, so on a plain machine uv uses PyPI alone.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys


def pip_config() -> dict[str, str]:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    conf: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        conf.setdefault(name, value.strip().strip("'\""))  # the first listing of a key wins, as in pip
    for name in ("find-links", "index-url", "extra-index-url", "constraint"):
        env = os.environ.get("PIP_" + name.upper().replace("-", "_"))
        if env:
            conf[name] = env
    return conf


def main() -> None:
    conf = pip_config()
    args = ["--index-strategy", "unsafe-best-match"]
    for name in ("find-links", "extra-index-url", "constraint"):
        for value in conf.get(name, "").split():
            if name == "constraint" and not os.path.exists(value):
                continue
            args += [f"--{name}", value]
    if conf.get("index-url"):
        args += ["--index-url", conf["index-url"]]
    print(shlex.join(args))


if __name__ == "__main__":
    main()
