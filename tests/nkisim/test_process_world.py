"""nkisim.process_world: ranks spread over processes (each process's LNC=1 launches are one rank; an all-gather of
picklable objects carries the collectives). Stood in here by threads with a barrier-based exchange that pickles
every object, as a real inter-process exchange would: results equal the same kernel under run_ranks."""

import pickle
import threading

import numpy as np
import pytest

import nkisim

nkisim.install()
import nki  # noqa: E402
import nki.collectives as ncc  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402


@nki.jit
def k_a2a_then_reduce(x, groups):
    src, mid = (nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.private_hbm) for _ in range(2))
    red = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.private_hbm)
    nisa.dma_copy(dst=src, src=x)
    ncc.all_to_all(srcs=[src], dsts=[mid], replica_group=ncc.ReplicaGroup(groups), collective_dim=0)
    ncc.all_reduce(srcs=[mid], dsts=[red], replica_group=ncc.ReplicaGroup([[0, 1, 2, 3]]), op=nl.add)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=red)
    return out


class _Exchange:
    """all_gather_object over n threads (objects round-trip through pickle, as between processes)."""

    def __init__(self, n):
        self.n, self.slots, self.barrier = n, [None] * n, threading.Barrier(n, timeout=30)

    def for_rank(self, r):
        def exchange(obj):
            self.slots[r] = pickle.dumps(obj)
            self.barrier.wait()
            got = [pickle.loads(s) for s in self.slots]
            self.barrier.wait()
            return got
        return exchange


def _run_processes(n, fn):
    ex, results, errors = _Exchange(n), [None] * n, []

    def body(r):
        try:
            with nkisim.process_world(r, n, ex.for_rank(r)):
                results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            ex.barrier.abort()
    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_process_world_equals_run_ranks():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((8, 16)).astype(np.float32) for _ in range(4)]
    groups = [[0, 2], [1, 3]]
    want = nkisim.run_ranks(k_a2a_then_reduce, 4, lambda r: {"x": xs[r], "groups": groups}).outputs
    got = _run_processes(4, lambda r: k_a2a_then_reduce(xs[r], groups))
    for r in range(4):
        np.testing.assert_array_equal(got[r], want[r])


def test_process_world_divergence_is_named():
    def fn(r):
        if r == 0:
            return k_a2a_then_reduce(np.zeros((8, 16), np.float32), [[0, 1], [2, 3]])
        return k_a2a_then_reduce(np.zeros((8, 16), np.float32), [[0, 2], [1, 3]])
    with pytest.raises(nkisim.NkiCollectiveError, match="diverge"):
        _run_processes(4, fn)


def test_process_world_refuses_lnc2():
    with pytest.raises(nkisim.NkiValidationError, match="LNC=1"):
        _run_processes(1, lambda r: k_a2a_then_reduce[2](np.zeros((8, 16), np.float32), [[0]]))
