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


def _run_script(script: str, argv: list[str], env: dict[str, str], cwd: str, out: str, err: str,
                new_session: bool = False, append: bool = False) -> None:  # fmt: skip
    """The forked child: the worker's environment, working folder and output files, then its script as __main__."""
    if new_session:  # its own process group, which a kill takes down whole (as Popen's start_new_session)
        os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, mode, 0o644)
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


def session_preload() -> list[str]:
    """What this environment's workers import: NeMo's stack in the nemo environment, Megatron-Bridge's in the Bridge
    one, else torch, Lightning, transformers and modelopt (the core environment's workers). The server is one per test
    process and imports its preload once, when it starts, so the preload follows the environment, not the caller.
    Installed distributions decide, not import specs: ``tests/`` is on a test session's path, where ``tests/nemo``
    is a namespace package named ``nemo``."""
    from importlib.metadata import PackageNotFoundError, distribution

    for dist, preload in (("nemo_toolkit", "nemo_preload"), ("megatron-bridge", "bridge_preload")):
        try:
            distribution(dist)
            return [preload]
        except PackageNotFoundError:
            pass
    return ["core_preload"]


def preloaded_context() -> Any:
    """multiprocessing's fork server context, the server preloaded with :func:`session_preload`'s modules:
    ``ctx.Process(target=...)`` forks from it."""
    global _PRELOADED
    ctx = mp.get_context("forkserver")
    if not _PRELOADED:  # the server starts on first use, with what it was told to import by then
        _PRELOADED = session_preload()
        ctx.set_forkserver_preload(_PRELOADED)
        # the server imports them before it takes this process's sys.path (Python 3.11 / 3.12): the helpers
        # folder goes on the PYTHONPATH it starts with, or a preload module there is skipped without a word
        here = str(Path(__file__).parent)
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *[p for p in paths if p != here]])
    return ctx


def start_server() -> None:
    """Start the fork server and wait until it has imported its preload (a first child that does nothing), so that
    a run timed after it is not charged the imports."""
    child = preloaded_context().Process(target=os.getpid)
    child.start()
    child.join()


class PreloadedProcess:
    """A worker script run in a child of the preloaded fork server; ``communicate`` as ``subprocess.Popen``'s."""

    def __init__(self, script: str | Path, argv: list[str], env: dict[str, str], cwd: str | Path, logs: Path | None,
                 new_session: bool = False, stdout: Path | None = None,
                 stderr: Path | None = None) -> None:  # fmt: skip
        """Args:
        new_session: the child leads a process group of its own (``os.killpg(proc.pid, ...)`` stops it whole).
        logs: the folder of the child's ``stdout`` and ``stderr`` files (None: both given as files).
        stdout, stderr: files the child appends to instead.
        """
        ctx = preloaded_context()
        if stdout is None or stderr is None:
            assert logs is not None, "logs: the folder of the output files not given"
            logs.mkdir(parents=True, exist_ok=True)
        self._out, self._err = stdout or logs / "stdout", stderr or logs / "stderr"  # type: ignore[operator]
        append = stdout is not None or stderr is not None
        args = (str(script), [str(a) for a in argv], dict(env), str(cwd), str(self._out), str(self._err), new_session,
                append)  # fmt: skip
        self._proc = ctx.Process(target=_run_script, args=args)
        self._proc.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def wait(self, timeout: float | None = None) -> int:
        """The exit code (negative: the signal that ended it), as ``subprocess.Popen.wait``."""
        self._proc.join(timeout)
        if self._proc.is_alive():
            import subprocess

            raise subprocess.TimeoutExpired(str(self._proc), timeout or 0)
        return self._proc.exitcode  # type: ignore[return-value]

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self._out.read_text(errors="replace"), self._err.read_text(errors="replace")

    def kill(self) -> None:
        self._proc.kill()
