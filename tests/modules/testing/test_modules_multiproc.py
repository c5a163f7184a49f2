"""The multi-process helper itself: results, fail-fast on an exception or a dead rank, timeouts."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from modules.testing import RankFailedError, find_free_port, run_distributed


def _sum_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "world": dist.get_world_size(), "sum": t.item() * scale, "tensor": torch.ones(2) * rank}


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 would wait here forever without fail-fast


def _die_on_rank0(rank, world_size):
    if rank == 0:
        os._exit(3)
    dist.barrier()


def _hang(rank, world_size):
    time.sleep(600)


@pytest.mark.timeout(60)
def test_results_ordered_by_rank():
    out = run_distributed(_sum_ranks, 4, 2.0)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert all(o["world"] == 4 and o["sum"] == 12.0 for o in out)
    assert torch.equal(out[3]["tensor"], torch.full((2,), 3.0))


@pytest.mark.timeout(60)
def test_exception_reports_rank_traceback_fast():
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank 1 of 2 failed") as info:
        run_distributed(_raise_on_rank1, 2, timeout=50)
    assert info.value.rank == 1 and "boom from rank 1" in info.value.rank_traceback
    assert time.monotonic() - start < 30  # fail fast, not at the timeout


@pytest.mark.timeout(60)
def test_dead_rank_detected():
    with pytest.raises(RankFailedError, match=r"rank 0 of 2 died with exit code 3") as info:
        run_distributed(_die_on_rank0, 2, timeout=50)
    assert info.value.rank == 0


@pytest.mark.timeout(60)
def test_timeout_kills_hung_ranks():
    with pytest.raises(RankFailedError, match=r"timed out after 3.0s; ranks \[0, 1\] did not finish"):
        run_distributed(_hang, 2, timeout=3.0)


def test_bad_world_size_and_free_port():
    with pytest.raises(ValueError, match=r"world_size must be a positive integer, got 0"):
        run_distributed(_sum_ranks, 0)
    assert 0 < find_free_port() < 65536
