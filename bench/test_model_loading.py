"""Checkpoint loading of one rank's prefill graph: `load_sharded` (read, then place, parameter by parameter) against
`load_sharded_pipelined` (reader threads run the next parameters' read stage while the caller places the finished
ones in order).

MEASURED host wall time (not modelled), the two loaders alternating round by round so that a burst of load from
other processes hits both alike; the medians, their ratio and the stage times (`LoadTimings`) go to extra_info, with
the machine's load average before and after, and the process CPU time of each load (every thread: on a 2-core
machine a load cannot take less wall time than half its CPU time, whatever the load average). Two checkpoints of a
few hundred MB written as HF safetensors:
- Llama-shaped, fp32 tensors placed into bf16 parameters: the read stage is the loaders' slice copies out of the
  memory-mapped file (page-ins when cold), placing the dtype-converting copy.
- GPT-OSS-shaped with MXFP4 experts (uint8 blocks/scales, the published form): the read stage also dequantises the
  experts (8 fp32 values a byte) into the kernels' layout, the CPU-heavy part of loading.
"warm": the file is in the page cache. "cold": its pages are dropped with posix_fadvise(DONTNEED) before every load
(no privileges needed; only this file's clean pages go), so reading waits on the disk.
torch intra-op threads: 1 (the pipeline against no pipeline: its readers are the only parallelism) and the default
(the sequential loader's big ops then use every core too; on an oversubscribed machine OpenMP's waiting threads
also burn CPU). The pipeline can only win what one loader thread leaves idle: I/O waits (cold), Python and
single-threaded stretches, and placing. On a machine shared with other jobs the figures move with their load, and
a loaded scheduler gives a process a share per runnable thread, which flatters the threaded loader: read the
speed-up with the load average next to it (and the CPU times). No speed is asserted.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
import types

import pytest
import torch

from modules.config import NeuronConfig
from modules.loading import SafetensorsCheckpoint
from modules.model_specs import TextModelSpec
from modules.models import PrefillModel, gpt_oss_mlp, gpt_oss_mlp_mappings, llama_mlp, llama_mlp_mappings
from modules.models.hf_layout import random_dense_state, random_gpt_oss_state, write_checkpoint
from modules.parallel.coordinator import StaticGroup

# Sized for a few hundred MB (not published models: a loader's cost depends on bytes, tensors and transforms).
LLAMA_LOAD = TextModelSpec("load-bench-llama", layers=4, hidden=1024, intermediate=4096, heads=16, kv_heads=4,
                           head_dim=64, vocab=16000)
GPT_OSS_LOAD = TextModelSpec("load-bench-gpt-oss", layers=4, hidden=1024, intermediate=1024, heads=16, kv_heads=4,
                             head_dim=64, vocab=16000, experts=8, top_k=2, sliding_window=128, attention_bias=True)
ROUNDS = {"llama": 4, "gpt_oss_mxfp4": 2}
READERS = 2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("load_bench")
    return {"llama": write_checkpoint(random_dense_state(LLAMA_LOAD, seed=0, dtype=torch.float32), root / "llama"),
            "gpt_oss_mxfp4": write_checkpoint(random_gpt_oss_state(GPT_OSS_LOAD, seed=0, mxfp4=True),
                                              root / "gpt_oss")}


def _model(kind: str) -> PrefillModel:
    state = types.SimpleNamespace(tp=StaticGroup(), config=NeuronConfig(prefill_buckets=(16,), decode_buckets=(1,)))
    if kind == "llama":
        return PrefillModel(LLAMA_LOAD, state, llama_mlp, llama_mlp_mappings, dtype=torch.bfloat16)
    return PrefillModel(GPT_OSS_LOAD, state, gpt_oss_mlp, functools.partial(gpt_oss_mlp_mappings, mxfp4=True),
                        dtype=torch.bfloat16)


def _evict(path) -> None:
    """Drop the file's clean pages from the page cache, so the next load reads from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.benchmark(group="checkpoint-loading")
@pytest.mark.parametrize(("cache", "torch_threads"), [("warm", 1), ("cold", 1), ("warm", "default")])
@pytest.mark.parametrize("checkpoint", ["llama", "gpt_oss_mxfp4"])
def test_pipelined_against_sequential(benchmark, checkpoints, checkpoint, cache, torch_threads):
    if cache == "cold" and not hasattr(os, "posix_fadvise"):
        pytest.skip("cold-cache rounds need os.posix_fadvise (Linux)")
    path = checkpoints[checkpoint]
    ckpt = SafetensorsCheckpoint(path)
    model = _model(checkpoint)
    mappings = model.checkpoint_mappings()
    loaders = {"sequential": ckpt.load_sharded,
               "pipelined": functools.partial(ckpt.load_sharded_pipelined, readers=READERS)}
    wall = {k: [] for k in loaders}
    cpu = {k: [] for k in loaders}
    stages = {k: [] for k in loaders}

    def rounds():
        for _ in range(ROUNDS[checkpoint]):
            for name, load in loaders.items():
                if cache == "cold":
                    _evict(ckpt.path)
                t0, c0 = time.perf_counter(), time.process_time()
                load(0, 1, model, mappings)
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                stages[name].append(ckpt.last_load_timings)

    if cache == "warm":
        ckpt.load_sharded(0, 1, model, mappings)  # page the file in
    load_before = os.getloadavg()[0]
    default_threads = torch.get_num_threads()
    torch.set_num_threads(default_threads if torch_threads == "default" else torch_threads)
    try:
        threads = torch.get_num_threads()
        benchmark.pedantic(rounds, rounds=1, iterations=1)
    finally:
        torch.set_num_threads(default_threads)
    seq, pipe = (statistics.median(wall[k]) for k in loaders)

    def med(name, field):
        return round(statistics.median(getattr(t, field) for t in stages[name]), 4)

    benchmark.extra_info.update(
        measured="host wall time, medians of interleaved rounds", cache=cache, rounds=ROUNDS[checkpoint],
        checkpoint_mb=round(path.stat().st_size / 1e6, 1),
        placed_mb=round(sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6, 1),
        torch_threads=threads, readers=READERS,
        sequential_s=round(seq, 4), pipelined_s=round(pipe, 4), speedup=round(seq / pipe, 3),
        sequential_cpu_s=round(statistics.median(cpu["sequential"]), 4),
        pipelined_cpu_s=round(statistics.median(cpu["pipelined"]), 4),
        sequential_read_s=med("sequential", "read_s"), sequential_place_s=med("sequential", "place_s"),
        pipelined_read_s=med("pipelined", "read_s"), pipelined_place_s=med("pipelined", "place_s"),
        pipelined_wait_s=med("pipelined", "wait_s"),
        loadavg_before=round(load_before, 2), loadavg_after=round(os.getloadavg()[0], 2))
