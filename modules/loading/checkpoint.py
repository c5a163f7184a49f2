"""SafetensorsCheckpoint: sharded loading that reads only each rank's slices (safe_open + get_slice)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from modules.loading.loaders import get_weight_loader

# param name → checkpoint key, or role → checkpoint key (fused parameters, e.g. {"q": ..., "k": ..., "v": ...})
Mappings = Mapping[str, str | Mapping[str, str]]


PAGE_BYTES = 4096


def _fault_in(t: torch.Tensor) -> torch.Tensor:
    """Make the bytes of t resident and return t. safetensors slices are views of the memory-mapped file: nothing is
    read from the disk until the bytes are touched. Reading one byte per page (a strided torch reduction, which
    releases the GIL) pulls the pages into the page cache, so the read stage really reads and the place stage copies
    from memory. Loader outputs that are already copies (padding, concatenation, non-contiguous slices made
    contiguous) are resident: touching them costs one load per page."""
    if t.numel() and t.is_contiguous() and t.device.type == "cpu":
        flat = t.reshape(-1).view(torch.uint8)
        flat[::PAGE_BYTES].sum()
    return t


@dataclass
class LoadTimings:
    """Measured host times of the last load (seconds). read_s: the read stage summed over parameters (with several
    readers it runs concurrently, so it can exceed wall_s); place_s: the placing; wait_s: how long placing waited
    for a read (pipelined only). readers=0 is the sequential loader."""

    readers: int
    wall_s: float = 0.0
    read_s: float = 0.0
    place_s: float = 0.0
    wait_s: float = 0.0


@dataclass(frozen=True)
class _Skipped:
    why: str


_COUNT_LOCK = threading.Lock()  # readers of two parameters can read the same tensor (tied embeddings)


class _CountingSlice:
    """A PySafeSlice that records how many bytes each read returned (to prove sharded reads are partial)."""

    def __init__(self, key: str, inner: Any, counter: dict[str, int]) -> None:
        self.key, self.inner, self.counter = key, inner, counter

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        out = self.inner[index]
        with _COUNT_LOCK:
            self.counter[self.key] = self.counter.get(self.key, 0) + out.numel() * out.element_size()
        return out


class SafetensorsCheckpoint:
    """A checkpoint of one ``.safetensors`` file, or a directory of them (with or without
    ``model.safetensors.index.json``). Tensors are opened lazily; nothing is read until a loader slices."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.is_file():
            files = [self.path]
        elif self.path.is_dir():
            files = sorted(self.path.glob("*.safetensors"))
        else:
            raise FileNotFoundError(f"checkpoint path {str(self.path)!r} does not exist")
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {str(self.path)!r}")
        self._file_of: dict[str, Path] = {}
        index = self.path / "model.safetensors.index.json" if self.path.is_dir() else None
        if index is not None and index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {k: self.path / f for k, f in weight_map.items()}
        else:
            for f in files:
                with safe_open(f, framework="pt") as h:
                    for k in h.keys():
                        if k in self._file_of:
                            raise ValueError(f"tensor {k!r} appears in both {self._file_of[k].name} and {f.name}")
                        self._file_of[k] = f
        self.bytes_read: dict[str, int] = {}
        self.last_load_timings: LoadTimings | None = None

    def keys(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, key: str) -> bool:
        return key in self._file_of

    @contextlib.contextmanager
    def open(self) -> Iterator[_Opened]:
        """Keep file handles open for a batch of slice reads."""
        with contextlib.ExitStack() as stack:
            yield _Opened(self, stack)

    def shape(self, key: str) -> tuple[int, ...]:
        with self.open() as h:
            return tuple(h.get_slice(key, "shape()").get_shape())

    def load_full(self, key: str) -> torch.Tensor:
        with self.open() as h:
            return h.get_slice(key, "load_full()")[:]

    def load_sharded(self, rank: int, world_size: int, model: torch.nn.Module, mappings: Mappings | None = None,
                     device: str | torch.device = "cpu", strict: bool = True) -> dict[str, torch.Tensor]:
        """Load every parameter of ``model`` through its weight loader as ``rank`` and copy it in, one parameter
        after the other (read its slices, then place them).

        rank/world_size are the model's TP rank and size (loaders of component layers override the rank).
        mappings: param name → checkpoint key (or role → key); unmapped params use their own name.
        strict=False skips parameters whose tensors are missing instead of raising (one warning names them all;
        they keep their initial values and are absent from the returned dict).
        Returns the rank's sharded state {param name: tensor}. ``last_load_timings`` then holds the measured stage
        times (see LoadTimings).
        """
        params = self._check_load_args(rank, world_size, model, mappings)
        mappings = dict(mappings or {})
        out: dict[str, torch.Tensor] = {}
        skipped: list[str] = []
        timings = LoadTimings(readers=0)
        t_start = time.perf_counter()
        with self.open() as h:
            for name, param in params.items():
                t0 = time.perf_counter()
                item = self._read_one(h, rank, name, param, mappings, strict)
                t1 = time.perf_counter()
                timings.read_s += t1 - t0
                if isinstance(item, _Skipped):
                    skipped.append(item.why)
                    continue
                out[name] = self._place(*item, device)
                timings.place_s += time.perf_counter() - t1
        timings.wall_s = time.perf_counter() - t_start
        self.last_load_timings = timings
        self._warn_skipped(skipped)
        return out

    def load_sharded_pipelined(self, rank: int, world_size: int, model: torch.nn.Module,
                               mappings: Mappings | None = None, device: str | torch.device = "cpu",
                               strict: bool = True, depth: int = 4, readers: int = 2) -> dict[str, torch.Tensor]:
        """``load_sharded`` as a pipeline: ``readers`` threads run the read stage of the next parameters (the
        weight loader: slice reads from the memory-mapped files, i.e. the page-ins, and the loader's CPU work:
        MXFP4 dequantisation, de-interleaving, transposes, padding) while this thread places the finished ones in
        parameter order (dtype conversion, host→device copy into the parameter).

        Why several readers: a read stage is both I/O (page faults of a cold file) and CPU (a loader's transforms);
        torch ops and page faults run without the GIL, so one reader's I/O overlaps another's compute, and the
        compute of two parameters spreads over two cores. ``depth`` bounds the memory: a parameter is read only
        when fewer than ``depth`` parameters are read (or being read) but not yet placed.
        Same arguments, results and errors as load_sharded (an error is raised when placing reaches the failing
        parameter, so it is the one the sequential loader raises)."""
        for what, v in (("depth", depth), ("readers", readers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"load_sharded_pipelined: {what} must be a positive integer, got {v!r}")
        params = self._check_load_args(rank, world_size, model, mappings)
        mappings = dict(mappings or {})
        jobs = list(params.items())
        out: dict[str, torch.Tensor] = {}
        skipped: list[str] = []
        timings = LoadTimings(readers=readers)
        ready: dict[int, Any] = {}              # job index → read item, _Skipped or the exception it raised
        cond = threading.Condition()
        state = {"next": 0, "placed": 0, "stop": False, "read_s": 0.0, "fatal": None}

        def reader() -> None:
            try:
                with self.open() as h:
                    while True:
                        with cond:
                            while not state["stop"] and state["next"] < len(jobs) and \
                                    state["next"] >= state["placed"] + depth:
                                cond.wait()
                            if state["stop"] or state["next"] >= len(jobs):
                                return
                            i = state["next"]
                            state["next"] += 1
                        t0 = time.perf_counter()
                        try:
                            item = self._read_one(h, rank, *jobs[i], mappings, strict)
                        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread, in order
                            item = e
                        with cond:
                            state["read_s"] += time.perf_counter() - t0
                            ready[i] = item
                            cond.notify_all()
            except BaseException as e:  # noqa: BLE001 - outside any parameter (opening the files): fatal
                with cond:
                    state["fatal"] = e
                    cond.notify_all()

        t_start = time.perf_counter()
        threads = [threading.Thread(target=reader, name=f"load_sharded_pipelined-reader{k}", daemon=True)
                   for k in range(readers)]
        for t in threads:
            t.start()
        try:
            for i in range(len(jobs)):
                t0 = time.perf_counter()
                with cond:
                    while i not in ready:
                        if state["fatal"] is not None:
                            raise state["fatal"]
                        if not cond.wait(timeout=1.0) and i not in ready and not any(t.is_alive() for t in threads):
                            raise RuntimeError(f"load_sharded_pipelined: every reader thread ended before parameter "
                                               f"{jobs[i][0]!r} was read")
                    item = ready.pop(i)
                t1 = time.perf_counter()
                timings.wait_s += t1 - t0
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, _Skipped):
                    skipped.append(item.why)
                else:
                    out[item[0]] = self._place(*item, device)
                timings.place_s += time.perf_counter() - t1
                with cond:
                    state["placed"] = i + 1
                    cond.notify_all()
        finally:
            with cond:
                state["stop"] = True
                cond.notify_all()
            for t in threads:
                t.join()
        timings.wall_s = time.perf_counter() - t_start
        timings.read_s = state["read_s"]
        self.last_load_timings = timings
        self._warn_skipped(skipped)
        return out

    # -- the two stages ----------------------------------------------------------------------------------------
    @staticmethod
    def _check_load_args(rank, world_size, model, mappings) -> dict[str, torch.nn.Parameter]:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} out of range for world_size={world_size}")
        params = dict(model.named_parameters())
        unknown = sorted(set(mappings or {}) - set(params))
        if unknown:
            raise KeyError(f"mappings name parameters the model does not have: {unknown}")
        return params

    def _read_one(self, h, rank, name, param, mappings, strict) -> tuple | _Skipped:
        """Read stage of one parameter: (name, param, target, tensor) with the rank's slices of its tensors passed
        through its weight loader and made resident, or _Skipped (strict=False, a tensor is missing)."""
        target = mappings.get(name, name)
        keys = {"": target} if isinstance(target, str) else dict(target)
        missing = [k for k in keys.values() if k not in self]
        if missing:
            if not strict:
                return _Skipped(f"{name} (no {missing[0]!r})")
            raise KeyError(f"checkpoint {str(self.path)!r} has no tensor {missing[0]!r} "
                           f"(needed by parameter {name!r})")
        sources = {role: h.get_slice(key, name) for role, key in keys.items()}
        if isinstance(target, str):
            sources = sources[""]
        try:
            tensor = get_weight_loader(param)(sources, rank)
        except ValueError as e:
            raise ValueError(f"parameter {name!r} from {target!r}: {e}") from e
        return name, param, target, _fault_in(tensor)

    @staticmethod
    def _place(name, param, target, tensor, device) -> torch.Tensor:
        """Place stage: check the shape, then one copy into the parameter (converting dtype, moving device).
        Returns the placed value."""
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"parameter {name!r}: loaded shape {tuple(tensor.shape)} from {target!r} "
                             f"!= parameter shape {tuple(param.shape)}")
        if param.device != torch.device(device):  # the caller asked for another device: convert, then copy in
            tensor = tensor.to(device=device, dtype=param.dtype)
            with torch.no_grad():
                param.copy_(tensor)
            return tensor
        with torch.no_grad():
            param.copy_(tensor)
        return param.detach()

    @staticmethod
    def _warn_skipped(skipped: list[str]) -> None:
        if skipped:
            warnings.warn(f"load_sharded(strict=False): {len(skipped)} parameter(s) not loaded, left at their "
                          f"initial values: {', '.join(skipped)}", stacklevel=3)


class _Opened:
    def __init__(self, ckpt: SafetensorsCheckpoint, stack: contextlib.ExitStack) -> None:
        self.ckpt, self.stack = ckpt, stack
        self._handles: dict[Path, Any] = {}

    def get_slice(self, key: str, needed_by: str = "") -> _CountingSlice:
        f = self.ckpt._file_of.get(key)
        if f is None:
            raise KeyError(f"checkpoint {str(self.ckpt.path)!r} has no tensor {key!r}"
                           + (f" (needed by {needed_by})" if needed_by else ""))
        if f not in self._handles:
            self._handles[f] = self.stack.enter_context(safe_open(f, framework="pt"))
        return _CountingSlice(key, self._handles[f].get_slice(key), self.ckpt.bytes_read)
