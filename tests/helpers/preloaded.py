"""Worker scripts started from a process that has already imported their heavy libraries.

A Megatron-Bridge or NeMo worker process spends most of its CPU time importing torch, megatron-core and Bridge or NeMo
(about 17 CPU-seconds each for Bridge on these machines), and one test starts up to nine of them. multiprocessing's
fork server, preloaded with those imports once per test session, forks each worker instead; the worker script then
runs as ``__main__`` in the forked child with its own argv, environment and output files, as a fresh process would.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import runpy
import sys
from pathlib import Path
from typing import Any

# NEMO_FP4QAT_TEST_FORK_SERVER=0 starts every worker as a fresh interpreter instead
FORK_SERVER = os.environ.get("NEMO_FP4QAT_TEST_FORK_SERVER", "1") != "0"
_PRELOADED: list[str] = []


def _run_script(script: str, argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """The forked child: the worker's environment, working folder and output files, then its script as __main__."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = [script, *argv]
    # as a fresh interpreter's: the script's folder first, then PYTHONPATH's
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [str(Path(script).parent), *[p for p in extra if p not in sys.path]]
    code: Any = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    # what a fresh interpreter does at exit: its exit handlers (multiprocessing's among them: the worker's own helper
    # processes, a data loader's or a checkpoint writer's, are stopped and joined, not left behind holding memory)
    import atexit

    try:
        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


class PreloadedProcess:
    """A worker script run in a child of the preloaded fork server; ``communicate`` as ``subprocess.Popen``'s."""

    def __init__(self, preload: list[str], script: str | Path, argv: list[str], env: dict[str, str], cwd: str | Path,
                 logs: Path) -> None:  # fmt: skip
        global _PRELOADED
        ctx = mp.get_context("forkserver")
        if not _PRELOADED:  # the server starts on first use, with what it was told to import by then
            ctx.set_forkserver_preload(preload)
            _PRELOADED = list(preload)
            # the server imports them before it takes this process's sys.path (Python 3.11 / 3.12): the helpers
            # folder goes on the PYTHONPATH it starts with, or a preload module there is skipped without a word
            here = str(Path(__file__).parent)
            paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
            os.environ["PYTHONPATH"] = os.pathsep.join([here, *[p for p in paths if p != here]])
        logs.mkdir(parents=True, exist_ok=True)
        self._out, self._err = logs / "stdout", logs / "stderr"
        self._proc = ctx.Process(target=_run_script, args=(str(script), [str(a) for a in argv], dict(env), str(cwd),
                                                           str(self._out), str(self._err)))  # fmt: skip
        self._proc.start()

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self._proc.join(timeout)
        if self._proc.is_alive():
            import subprocess

            raise subprocess.TimeoutExpired(str(self._proc), timeout or 0)
        return self._out.read_text(errors="replace"), self._err.read_text(errors="replace")

    def kill(self) -> None:
        self._proc.kill()
