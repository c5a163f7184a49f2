"""load_sharded_pipelined is a real pipeline (readers → placing): byte-for-byte the result of load_sharded (on the
test block and on tiny Llama- and GPT-OSS-shaped HF checkpoints, MXFP4 experts included), errors from either stage
surface in the caller in parameter order, and readers run ahead of the placing (checked by order of events, never
by timing)."""

import functools
import threading
import types

import pytest
import torch
from test_modules_checkpoint import MAPPINGS, Block, ckpt_dir  # noqa: F401 - ckpt_dir is a fixture

from modules.config import NeuronConfig
from modules.loading import SafetensorsCheckpoint
from modules.model_specs import TextModelSpec
from modules.models import PrefillModel, gpt_oss_mlp, gpt_oss_mlp_mappings, llama_mlp, llama_mlp_mappings
from modules.models.hf_layout import random_dense_state, random_gpt_oss_state, write_checkpoint
from modules.parallel.coordinator import StaticGroup

TINY_LLAMA = TextModelSpec("tiny-llama", layers=2, hidden=64, intermediate=128, heads=8, kv_heads=2, head_dim=8,
                           vocab=100)
TINY_GPT_OSS = TextModelSpec("tiny-gpt-oss", layers=2, hidden=64, intermediate=64, heads=8, kv_heads=2, head_dim=8,
                             vocab=100, experts=4, top_k=2, sliding_window=4, attention_bias=True)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_same_state(sa: dict, sb: dict, a: torch.nn.Module, b: torch.nn.Module) -> None:
    assert list(sa) == list(sb)
    for k in sa:
        assert same_bytes(sa[k], sb[k]), k
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert same_bytes(p.detach(), q.detach()), n


@pytest.mark.parametrize(("readers", "depth"), [(1, 1), (2, 1), (2, 4), (3, 2)])
def test_pipelined_equals_sequential(ckpt_dir, readers, depth):  # noqa: F811
    ckpt = SafetensorsCheckpoint(ckpt_dir)
    for r in range(2):
        a, b = Block(StaticGroup(2, r)), Block(StaticGroup(2, r))
        sa = ckpt.load_sharded(r, 2, a, MAPPINGS)
        sb = ckpt.load_sharded_pipelined(r, 2, b, MAPPINGS, depth=depth, readers=readers)
        assert_same_state(sa, sb, a, b)


def _prefill_model(spec, tp, rank, mxfp4):
    state = types.SimpleNamespace(tp=StaticGroup(tp, rank),
                                  config=NeuronConfig(prefill_buckets=(16,), decode_buckets=(1,)))
    if spec.is_moe:
        return PrefillModel(spec, state, gpt_oss_mlp, functools.partial(gpt_oss_mlp_mappings, mxfp4=mxfp4),
                            dtype=torch.bfloat16)
    return PrefillModel(spec, state, llama_mlp, llama_mlp_mappings, dtype=torch.bfloat16)


@pytest.mark.parametrize("form", ["llama", "gpt_oss_bf16", "gpt_oss_mxfp4"])
def test_pipelined_equals_sequential_on_model_checkpoints(tmp_path, form):
    """Every parameter of a prefill graph (TP 2, both ranks), fp32 checkpoint tensors placed into bf16 parameters
    (the dtype conversion of the placing stage), MXFP4 experts dequantised by the read stage."""
    mxfp4 = form == "gpt_oss_mxfp4"
    spec = TINY_LLAMA if form == "llama" else TINY_GPT_OSS
    state = (random_dense_state(spec, seed=3) if form == "llama"
             else random_gpt_oss_state(spec, seed=3, mxfp4=mxfp4))
    ckpt = SafetensorsCheckpoint(write_checkpoint(state, tmp_path))
    for r in range(2):
        a, b = _prefill_model(spec, 2, r, mxfp4), _prefill_model(spec, 2, r, mxfp4)
        maps = a.checkpoint_mappings()
        sa = ckpt.load_sharded(0, 1, a, maps)
        sb = ckpt.load_sharded_pipelined(0, 1, b, maps, readers=2, depth=3)
        assert len(sa) == len(list(a.parameters()))
        assert_same_state(sa, sb, a, b)
        t = ckpt.last_load_timings
        assert t.readers == 2 and t.wall_s > 0 and t.read_s > 0 and t.place_s > 0


def test_reader_runs_ahead_of_placing(ckpt_dir, monkeypatch):  # noqa: F811
    """While parameter i is being placed, a reader must be able to read parameter i + 1: placing waits for
    that read. A sequential loader cannot do it (the wait times out and the flag records it)."""
    ckpt = SafetensorsCheckpoint(ckpt_dir)
    names = list(dict(Block(StaticGroup()).named_parameters()))
    read_events = {n: threading.Event() for n in names}
    overlapped: list[bool] = []
    wait_s = [10.0]  # generous: the reader is normally there within microseconds
    read_one, place = SafetensorsCheckpoint._read_one, SafetensorsCheckpoint._place

    def spy_read_one(self, h, rank, name, *a):
        item = read_one(self, h, rank, name, *a)
        read_events[name].set()
        return item

    def spy_place(*a):
        i = len(overlapped)
        last = i == len(names) - 1
        overlapped.append(last or read_events[names[i + 1]].wait(timeout=wait_s[0]))
        return place(*a)

    monkeypatch.setattr(SafetensorsCheckpoint, "_read_one", spy_read_one)
    monkeypatch.setattr(SafetensorsCheckpoint, "_place", staticmethod(spy_place))
    ckpt.load_sharded_pipelined(0, 1, Block(StaticGroup()), MAPPINGS, depth=2, readers=1)
    assert overlapped and all(overlapped), overlapped
    overlapped.clear()
    for e in read_events.values():
        e.clear()
    wait_s[0] = 0.0  # the sequential loader would only time out
    ckpt.load_sharded(0, 1, Block(StaticGroup()), MAPPINGS)
    assert not overlapped[0]  # the sequential loader places parameter 0 before reading parameter 1


def test_readers_read_concurrently(ckpt_dir, monkeypatch):  # noqa: F811
    """With two readers, two read stages are in progress at once: the first read blocks until a second one has
    started (with one reader it would wait forever; the timeout turns that into a failed flag)."""
    ckpt = SafetensorsCheckpoint(ckpt_dir)
    barrier = threading.Barrier(2, timeout=10.0)
    lock, calls, met = threading.Lock(), [0], []
    read_one = SafetensorsCheckpoint._read_one

    def spy_read_one(self, *a):
        with lock:
            calls[0] += 1
            first_two = calls[0] <= 2
        if first_two:
            try:
                barrier.wait()
                met.append(True)
            except threading.BrokenBarrierError:
                met.append(False)
        return read_one(self, *a)

    monkeypatch.setattr(SafetensorsCheckpoint, "_read_one", spy_read_one)
    ckpt.load_sharded_pipelined(0, 1, Block(StaticGroup()), MAPPINGS, depth=4, readers=2)
    assert met == [True, True]


def test_errors_of_either_stage_reach_the_caller(ckpt_dir):  # noqa: F811
    ckpt = SafetensorsCheckpoint(ckpt_dir)
    bad_key = dict(MAPPINGS, **{"up.weight": "model.nope.weight"})
    with pytest.raises(KeyError, match="no tensor 'model.nope.weight'"):  # read stage (reader thread)
        ckpt.load_sharded_pipelined(0, 1, Block(StaticGroup()), bad_key)
    bad_shape = dict(MAPPINGS, **{"up.weight": "model.down.weight"})
    with pytest.raises(ValueError, match="parameter 'up.weight'"):  # a shape error, whichever stage sees it
        ckpt.load_sharded_pipelined(0, 1, Block(StaticGroup()), bad_shape, depth=1)
    # Two failing parameters: the first in parameter order is raised, as by the sequential loader, whichever
    # reader finishes first.
    two_bad = dict(MAPPINGS, **{"up.weight": "model.nope1.weight", "norm.weight": "model.nope2.weight"})
    for load in (ckpt.load_sharded, functools.partial(ckpt.load_sharded_pipelined, readers=3)):
        with pytest.raises(KeyError, match="model.nope1.weight"):
            load(0, 1, Block(StaticGroup()), two_bad)
    for what in ("depth", "readers"):
        with pytest.raises(ValueError, match=f"{what} must be a positive integer"):
            ckpt.load_sharded_pipelined(0, 1, Block(StaticGroup()), MAPPINGS, **{what: 0})


def test_strict_false_skips_alike(ckpt_dir):  # noqa: F811
    ckpt = SafetensorsCheckpoint(ckpt_dir)
    missing = dict(MAPPINGS, **{"up.bias": "model.nope.bias", "down.bias": "model.nope2.bias"})
    msgs = []
    for load in (ckpt.load_sharded, ckpt.load_sharded_pipelined):
        with pytest.warns(UserWarning, match="2 parameter") as rec:
            state = load(0, 1, Block(StaticGroup()), missing, strict=False)
        assert "up.bias" not in state and "down.bias" not in state and "up.weight" in state
        msgs.append(str(rec[0].message))
    assert msgs[0] == msgs[1]


def test_a_reader_failing_outside_a_parameter_reaches_the_caller(ckpt_dir, monkeypatch):  # noqa: F811
    """A reader failing outside any parameter's read (here: opening the files) leaves no result behind: its error
    reaches the caller instead of placing waiting forever."""
    ckpt = SafetensorsCheckpoint(ckpt_dir)

    def broken_open(self):
        raise OSError("simulated: the checkpoint files cannot be opened")

    monkeypatch.setattr(SafetensorsCheckpoint, "open", broken_open)
    with pytest.raises(OSError, match="simulated: the checkpoint files cannot be opened"):
        ckpt.load_sharded_pipelined(0, 1, Block(StaticGroup()), MAPPINGS, readers=2)
