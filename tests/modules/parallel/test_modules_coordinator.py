"""GroupCoordinator collectives on real gloo groups, each against a single-process reference."""

import pytest
import torch

from modules.parallel.coordinator import CollectiveLog, GroupCoordinator, StaticGroup
from modules.parallel.rank_lists import build_dp_column_group_ranks, build_tp_group_ranks
from modules.testing import run_distributed


def _inputs(world, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(world)]


def _check_collectives(rank, world_size, emulate):
    log = CollectiveLog()
    world = GroupCoordinator([list(range(world_size))], "world", log=log, emulate=emulate)
    single = GroupCoordinator([[r] for r in range(world_size)], "self", log=log, emulate=emulate)
    assert (world.world_size, world.rank_in_group) == (world_size, rank)
    assert (single.world_size, single.rank_in_group, single.ranks) == (1, 0, [rank])
    ws = world_size
    xs = _inputs(ws, (2 * ws, 3))

    x = xs[rank].clone()
    out = world.all_reduce(x)
    torch.testing.assert_close(out, sum(xs))
    assert torch.equal(x, xs[rank]), "all_reduce must be out of place"

    for dim in (0, 1, -1):
        torch.testing.assert_close(world.all_gather(xs[rank], dim=dim), torch.cat(xs, dim=dim))
    # Non-contiguous input.
    torch.testing.assert_close(world.all_gather(xs[rank].t(), dim=0), torch.cat([t.t() for t in xs], 0))

    for dim in (0, 1):
        if xs[0].shape[dim] % ws == 0:
            chunk = xs[0].shape[dim] // ws
            ref = sum(xs).narrow(dim, rank * chunk, chunk)
            torch.testing.assert_close(world.reduce_scatter(xs[rank], dim=dim), ref)

    # all_to_all, even: piece j of rank i lands at rank j, position i.
    ref = torch.cat([xs[i].chunk(ws)[rank] for i in range(ws)])
    torch.testing.assert_close(world.all_to_all(xs[rank]), ref)
    # all_to_all, uneven: rank i sends (j + 1) rows to rank j → rank j receives j + 1 rows from everyone.
    send = [torch.full((j + 1, 2), float(10 * rank + j)) for j in range(ws)]
    got = world.all_to_all(torch.cat(send), input_split_sizes=[j + 1 for j in range(ws)],
                           output_split_sizes=[rank + 1] * ws)
    ref = torch.cat([torch.full((rank + 1, 2), float(10 * i + rank)) for i in range(ws)])
    torch.testing.assert_close(got, ref)
    # all_to_all along dim 1.
    y = torch.arange(2 * ws, dtype=torch.float32).reshape(2, ws) + 100 * rank
    ref = torch.cat([(torch.arange(2 * ws, dtype=torch.float32).reshape(2, ws) + 100 * i)[:, rank:rank + 1]
                     for i in range(ws)], dim=1)
    torch.testing.assert_close(world.all_to_all(y, dim=1), ref)

    # Ragged all-gather with a zero-row rank.
    sizes = [(i * 2) % 3 for i in range(ws)]  # 0, 2, 1, 0, ...
    parts = [torch.full((s, 2), float(i)) for i, s in enumerate(sizes)]
    torch.testing.assert_close(world.all_gatherv(parts[rank], sizes), torch.cat(parts))
    # Zero-row everywhere.
    assert world.all_gather(torch.empty(0, 4)).shape == (0, 4)
    assert world.all_reduce(torch.empty(0)).shape == (0,)
    assert world.reduce_scatter(torch.empty(0, 4)).shape == (0, 4)
    # bf16 all-reduce.
    torch.testing.assert_close(world.all_reduce(torch.ones(3, dtype=torch.bfloat16)),
                               torch.full((3,), float(ws), dtype=torch.bfloat16))

    # Size-1 bypass: same object back, no communication, logged as bypassed.
    before = log.count()
    z = torch.randn(4, 2)
    for fn in (single.all_reduce, single.all_gather, single.reduce_scatter, single.all_to_all):
        assert fn(z) is z
    assert log.count() == before
    assert log.count(include_bypassed=True, group="self") == 4

    # Log: (op, group, bytes) of the logical op, emulated or not.
    with log.capture() as cap:
        world.reduce_scatter(xs[rank])
        world.all_reduce(xs[rank])
    assert cap.ops() == [("reduce_scatter", "world"), ("all_reduce", "world")]
    assert cap.total_bytes() == 2 * xs[rank].numel() * 4

    # Shape errors name the value.
    for bad, msg in ((lambda: world.reduce_scatter(torch.zeros(ws + 1, 2)), f"x.shape[0]={ws + 1}"),
                     (lambda: world.all_gatherv(torch.zeros(5, 2), sizes), "x.shape[0]=5"),
                     (lambda: world.all_to_all(torch.zeros(ws, 1), input_split_sizes=[1] * (ws + 1)),
                      "input_split_sizes"),
                     (lambda: world.all_gather(torch.zeros(2), dim=3), "dim=3")):
        try:
            bad()
        except ValueError as e:
            assert msg in str(e), (msg, str(e))
        else:
            raise AssertionError(f"expected ValueError mentioning {msg}")

    # Sub-groups: TP pairs and DP columns of a tp=2 layout.
    if ws >= 4:
        tp = GroupCoordinator(build_tp_group_ranks(ws, 2), "tp", log=log, emulate=emulate)
        col = GroupCoordinator(build_dp_column_group_ranks(ws, 2, ws // 2), "col", log=log, emulate=emulate)
        assert tp.ranks == [rank - rank % 2, rank - rank % 2 + 1] and tp.rank_in_group == rank % 2
        assert col.ranks == list(range(rank % 2, ws, 2)) and col.rank_in_group == rank // 2
        t = torch.tensor([float(rank)])
        assert tp.all_reduce(t).item() == sum(tp.ranks)
        assert col.all_gather(t).tolist() == [float(r) for r in col.ranks]
        torch.testing.assert_close(col.reduce_scatter(torch.arange(float(col.world_size)) + rank),
                                   torch.tensor([float(sum(col.ranks) + col.world_size * col.rank_in_group)]))
    return log.count()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size,emulate", [(2, ()), (4, ()), (4, ("reduce_scatter", "all_to_all")),
                                                (8, ())])
def test_collectives_match_reference(world_size, emulate):
    counts = run_distributed(_check_collectives, world_size, emulate)
    assert len(set(counts)) == 1  # every rank issued the same collectives


def test_static_group():
    g = StaticGroup()
    x = torch.ones(2)
    assert g.all_reduce(x) is x and g.all_gather(x) is x and g.log.count(include_bypassed=True) == 2
    with pytest.raises(RuntimeError, match=r"world_size=4\) cannot run all_reduce"):
        StaticGroup(4, 1).all_reduce(x)
    assert g.all_gatherv(x, sizes=[2]) is x and g.all_to_all(x, input_split_sizes=[2], output_split_sizes=[2]) is x
    with pytest.raises(ValueError, match=r"sizes=\[3\] must be \[x.shape\[0\]\]=\[2\]"):
        g.all_gatherv(x, sizes=[3])
    with pytest.raises(ValueError, match=r"output_split_sizes=\[1, 1\] must be"):
        g.all_to_all(x, output_split_sizes=[1, 1])
    with pytest.raises(ValueError, match=r"dim=1 out of range"):
        g.all_gather(x, dim=1)
    refused = StaticGroup(4, 1)
    with pytest.raises(RuntimeError):
        refused.all_gather(x)
    assert refused.log.count(include_bypassed=True) == 0  # a refused collective is not logged
    with pytest.raises(ValueError, match=r"rank_in_group=4 must be in \[0, world_size=4\)"):
        StaticGroup(4, 4)


def test_coordinator_requires_init():
    with pytest.raises(RuntimeError, match=r"not initialized"):
        GroupCoordinator([[0]], "x")
