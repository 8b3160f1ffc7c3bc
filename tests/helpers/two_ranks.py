"""Two real gloo ranks for a test: rank 0 in the test process, rank 1 spawned.

Rank 0 runs in the test process so coverage and mutation tools see the code it reaches (mutmut attributes a
function to the tests whose call reaches it, in the test process only). When the process already holds a
default process group (NeMo's tests leave one), both ranks are spawned instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from preloaded import FORK_SERVER, preloaded_context


def run_two_ranks(worker: Callable[..., None], init: str, *args: Any) -> dict[int, Any]:
    """``worker(rank, init, *args, out)`` on ranks 0 and 1; returns what each wrote to ``out[rank]``."""
    here = not dist.is_initialized()
    with mp.Manager() as manager:  # shut down on exit: an unreferenced Manager's process outlives the test
        shared = manager.dict()
        # forked from the preloaded fork server (a fresh interpreter per rank spends seconds importing torch,
        # transformers and modelopt); spawned without it
        ctx = preloaded_context() if FORK_SERVER else mp.get_context("spawn")
        peers = [ctx.Process(target=worker, args=(r, init, *args, shared)) for r in ((1,) if here else (0, 1))]
        for p in peers:
            p.start()
        try:
            if here:
                worker(0, init, *args, shared)
        finally:
            for p in peers:
                p.join(timeout=300)  # a broken collective hangs: fail instead of waiting forever
                if p.is_alive():
                    p.kill()
                    pytest.fail("a rank hung")
        assert all(p.exitcode == 0 for p in peers), [p.exitcode for p in peers]
        return {r: shared[r] for r in (0, 1)}
