"""Run a function on N gloo ranks on localhost; collect results; fail fast with the dead rank's traceback.

The parent owns the rendezvous TCPStore (bound to a free port it holds, so no port race), starts N processes,
and polls a result queue and the processes' exit codes. The first rank to fail — by exception or by dying —
makes the parent kill the others and raise ``RankFailedError`` with that rank's traceback. A wall-clock
``timeout`` bounds every run, so a deadlocked collective cannot hang the test session.

Start method: ``forkserver`` with torch preloaded by default. It gives a fresh interpreter (not a fork of
pytest) like ``spawn``, but each rank costs a fork instead of a torch import (~0.3 s vs ~1.3 s per rank on a
2-core machine). ``start_method="spawn"`` is available.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_PRELOAD = ("torch", "torch.distributed", "safetensors.torch", "modules.parallel.coordinator")
# How long a rank that exited may take to be seen as dead (or to have its result arrive) before it is blamed.
DEAD_PEER_GRACE_S = 1.0


class RankFailedError(RuntimeError):
    """A rank raised, died, or the run timed out. ``rank`` is the first failing rank (None on timeout)."""

    def __init__(self, message: str, rank: int | None = None, rank_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.rank_traceback = rank_traceback


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, host, port, backend, timeout_s, args, kwargs, results) -> None:
    # One thread per rank: 2 cores shared by up to 16 ranks; oversubscription makes gloo slow and flaky.
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR=host, MASTER_PORT=str(port))
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        out = fn(rank, world_size, *args, **kwargs)
        # Plain pickle (not the torch ForkingPickler reductions): tensors travel by value, so a rank may exit
        # before the parent reads its result.
        payload = pickle.dumps(out)
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt/SystemExit
        results.put((rank, False, traceback.format_exc()))
        return
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    results.put((rank, True, payload))


def _dead_peers(procs: Sequence[mp.process.BaseProcess], done: dict, failed: int, wait: float) -> list[int]:
    """Ranks other than `failed` (and not finished) that exited nonzero, polling up to `wait` seconds for one."""
    end = time.monotonic() + wait
    while True:
        dead = [r for r, p in enumerate(procs) if r not in done and r != failed and p.exitcode]
        if dead or time.monotonic() >= end:
            return dead
        time.sleep(0.02)


def _kill_all(procs: Sequence[mp.process.BaseProcess], grace: float = 0.0) -> None:
    end = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    backend: str = "gloo",
    start_method: str = "forkserver",
    preload: Sequence[str] = DEFAULT_PRELOAD,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on world_size ranks; return results ordered by rank.

    fn must be importable by name (a module-level function). Raises RankFailedError on the first failing or
    dead rank, or when ``timeout`` seconds pass.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(preload))
    host = "127.0.0.1"
    # The parent hosts the store: it binds a free port itself and keeps it, and outlives every rank.
    store = dist.TCPStore(host, 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, name=f"rank{r}", daemon=True,
                    args=(fn, r, world_size, host, store.port, backend, timeout, args, kwargs, results))
        for r in range(world_size)
    ]
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        dead_since: dict[int, float] = {}
        while len(out) < world_size:
            try:
                rank, ok, payload = results.get(timeout=0.05)
            except queue_mod.Empty:
                pass
            else:
                if not ok:
                    # Peers of a dead rank fail with "connection reset", often before the parent has seen the dead
                    # process exit: give its exit the same moment as a result in flight, then name it as the cause.
                    dead = _dead_peers(procs, out, rank, wait=DEAD_PEER_GRACE_S)
                    if dead:
                        r = dead[0]
                        raise RankFailedError(
                            f"rank {r} of {world_size} died with exit code {procs[r].exitcode}; then rank {rank} "
                            f"failed:\n{payload}", r, payload)
                    raise RankFailedError(f"rank {rank} of {world_size} failed:\n{payload}", rank, payload)
                out[rank] = pickle.loads(payload)
                continue
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r in out or p.exitcode is None:
                    continue
                # A rank that exited may still have its result in flight; give the queue a moment first.
                first = dead_since.setdefault(r, now)
                if now - first > DEAD_PEER_GRACE_S:
                    raise RankFailedError(
                        f"rank {r} of {world_size} died with exit code {p.exitcode} without reporting a result",
                        r)
            if now > deadline:
                missing = sorted(set(range(world_size)) - set(out))
                raise RankFailedError(f"timed out after {timeout:.1f}s; ranks {missing} did not finish")
    finally:
        # On success let ranks exit on their own (they already reported); on failure kill at once.
        _kill_all(procs, grace=5.0 if len(out) == world_size else 0.0)
        results.close()
        del store
    return [out[r] for r in range(world_size)]
