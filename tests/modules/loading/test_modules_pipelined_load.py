"""load_sharded_pipelined is a real two-stage pipeline: same result as load_sharded, errors from either stage
surface in the caller, and the reader runs ahead of the placing (checked by order of events, not by timing)."""

import threading

import pytest
import torch
from test_modules_checkpoint import MAPPINGS, Block, ckpt_dir  # noqa: F401 - ckpt_dir is a fixture

from modules.loading import SafetensorsCheckpoint
from modules.parallel.coordinator import StaticGroup


def test_pipelined_equals_sequential(ckpt_dir):  # noqa: F811
    ckpt = SafetensorsCheckpoint(ckpt_dir)
    for r in range(2):
        a, b = Block(StaticGroup(2, r)), Block(StaticGroup(2, r))
        sa = ckpt.load_sharded(r, 2, a, MAPPINGS)
        sb = ckpt.load_sharded_pipelined(r, 2, b, MAPPINGS, depth=1)
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k])
        for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert torch.equal(p, q), n


def test_reader_runs_ahead_of_placing(ckpt_dir, monkeypatch):  # noqa: F811
    """While parameter i is being placed, the reader must be able to read parameter i + 1: placing waits for
    that read. A sequential loader cannot do it (the wait times out and the flag records it)."""
    ckpt = SafetensorsCheckpoint(ckpt_dir)
    read_events: list[threading.Event] = [threading.Event() for _ in range(32)]
    overlapped: list[bool] = []
    wait_s = [10.0]  # generous: the reader is normally there within microseconds
    read_all, place = SafetensorsCheckpoint._read_all, SafetensorsCheckpoint._place

    def spy_read_all(self, *a):
        for i, item in enumerate(read_all(self, *a)):
            read_events[i].set()
            yield item

    def spy_place(*a):
        i = len(overlapped)
        last = i == len(dict(Block(StaticGroup()).named_parameters())) - 1
        overlapped.append(last or read_events[i + 1].wait(timeout=wait_s[0]))
        return place(*a)

    monkeypatch.setattr(SafetensorsCheckpoint, "_read_all", spy_read_all)
    monkeypatch.setattr(SafetensorsCheckpoint, "_place", staticmethod(spy_place))
    ckpt.load_sharded_pipelined(0, 1, Block(StaticGroup()), MAPPINGS, depth=2)
    assert overlapped and all(overlapped), overlapped
    overlapped.clear()
    for e in read_events:
        e.clear()
    wait_s[0] = 0.0  # the sequential loader would only time out
    ckpt.load_sharded(0, 1, Block(StaticGroup()), MAPPINGS)
    assert not overlapped[0]  # the sequential loader places parameter 0 before reading parameter 1


def test_errors_of_either_stage_reach_the_caller(ckpt_dir):  # noqa: F811
    ckpt = SafetensorsCheckpoint(ckpt_dir)
    bad_key = dict(MAPPINGS, **{"up.weight": "model.nope.weight"})
    with pytest.raises(KeyError, match="no tensor 'model.nope.weight'"):  # read stage (reader thread)
        ckpt.load_sharded_pipelined(0, 1, Block(StaticGroup()), bad_key)
    bad_shape = dict(MAPPINGS, **{"up.weight": "model.down.weight"})
    with pytest.raises(ValueError, match="parameter 'up.weight'"):  # a shape error, whichever stage sees it
        ckpt.load_sharded_pipelined(0, 1, Block(StaticGroup()), bad_shape, depth=1)
    with pytest.raises(ValueError, match="depth must be a positive integer"):
        ckpt.load_sharded_pipelined(0, 1, Block(StaticGroup()), MAPPINGS, depth=0)
