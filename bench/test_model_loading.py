"""Checkpoint loading of one rank's prefill graph: `load_sharded` (read, then place, parameter by parameter) against
`load_sharded_pipelined` (a reader thread slices the next parameters while the caller places the previous ones).

MEASURED host wall time (not modelled): a Llama-shaped checkpoint of ~330 MB written as fp32 HF safetensors, placed
into bf16 parameters (placing = dtype conversion + copy), TP 1, one CPU thread for torch ops. The file is read
through the page cache ("warm": both stages are memory-bound copies) or from the disk ("cold": the file's pages are
dropped with posix_fadvise before every round, so reading waits on I/O that placing can overlap). The pipeline can
hide at most the shorter stage: on this CPU path placing (one converting copy per parameter) is a small share of the
time, reading (page-in plus the loaders' slice copies) the large one; on a device placing is a host-to-device DMA.
On a shared machine the figures move with the other processes' load. No speed is asserted.
"""

from __future__ import annotations

import os
import statistics
import time
import types

import pytest
import torch

from modules.config import NeuronConfig
from modules.loading import SafetensorsCheckpoint
from modules.model_specs import TextModelSpec
from modules.models import PrefillModel, llama_mlp, llama_mlp_mappings
from modules.models.hf_layout import random_dense_state, write_checkpoint
from modules.parallel.coordinator import StaticGroup

# Llama-shaped, sized for a few hundred MB (not a published model: the loader's cost depends on bytes and tensors).
LOAD_SPEC = TextModelSpec("load-bench", layers=4, hidden=1024, intermediate=4096, heads=16, kv_heads=4, head_dim=64,
                          vocab=16000)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = write_checkpoint(random_dense_state(LOAD_SPEC, seed=0, dtype=torch.float32),
                            tmp_path_factory.mktemp("load_bench"))
    return SafetensorsCheckpoint(path), path.stat().st_size


def _model():
    state = types.SimpleNamespace(tp=StaticGroup(), config=NeuronConfig(prefill_buckets=(16,), decode_buckets=(1,)))
    return PrefillModel(LOAD_SPEC, state, llama_mlp, llama_mlp_mappings, dtype=torch.bfloat16)


def _evict(path) -> None:
    """Drop the file's clean pages from the page cache (os.posix_fadvise DONTNEED; no privileges needed), so the
    next load reads from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.benchmark(group="checkpoint-loading")
@pytest.mark.parametrize("cache", ["warm", "cold"])
@pytest.mark.parametrize("loader", ["load_sharded", "load_sharded_pipelined"])
def test_load_rank_slices(benchmark, checkpoint, loader, cache):
    if cache == "cold" and not hasattr(os, "posix_fadvise"):
        pytest.skip("cold-cache rounds need os.posix_fadvise (Linux)")
    ckpt, nbytes = checkpoint
    model = _model()
    fn = getattr(ckpt, loader)
    mappings = model.checkpoint_mappings()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        setup = (lambda: _evict(ckpt.path)) if cache == "cold" else None
        benchmark.pedantic(fn, args=(0, 1, model, mappings), setup=setup, rounds=7, iterations=1,
                           warmup_rounds=0 if setup else 1)
    finally:
        torch.set_num_threads(threads)
    benchmark.extra_info.update(measured="host wall time", checkpoint_mb=round(nbytes / 1e6, 1),
                                placed_mb=round(sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6, 1))


@pytest.mark.benchmark(group="checkpoint-loading")
@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_pipelined_over_sequential_interleaved(benchmark, checkpoint, cache):
    """The two loaders alternate round by round (so a burst of load from other processes hits both alike); the
    medians and their ratio go to extra_info (measured; < 1 means the pipeline is faster)."""
    if cache == "cold" and not hasattr(os, "posix_fadvise"):
        pytest.skip("cold-cache rounds need os.posix_fadvise (Linux)")
    ckpt, _ = checkpoint
    model = _model()
    mappings = model.checkpoint_mappings()
    times = {"load_sharded": [], "load_sharded_pipelined": []}

    def rounds():
        for _ in range(5):
            for name, ts in times.items():
                if cache == "cold":
                    _evict(ckpt.path)
                t0 = time.perf_counter()
                getattr(ckpt, name)(0, 1, model, mappings)
                ts.append(time.perf_counter() - t0)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        benchmark.pedantic(rounds, rounds=1, iterations=1)
    finally:
        torch.set_num_threads(threads)
    seq, pipe = (statistics.median(times[k]) for k in ("load_sharded", "load_sharded_pipelined"))
    benchmark.extra_info.update(measured="host wall time", sequential_median_s=round(seq, 4),
                                pipelined_median_s=round(pipe, 4), pipelined_over_sequential=round(pipe / seq, 3))
