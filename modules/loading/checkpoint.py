"""SafetensorsCheckpoint: sharded loading that reads only each rank's slices (safe_open + get_slice)."""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import warnings
from collections.abc import Iterator, Mapping
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


class _CountingSlice:
    """A PySafeSlice that records how many bytes each read returned (to prove sharded reads are partial)."""

    def __init__(self, key: str, inner: Any, counter: dict[str, int]) -> None:
        self.key, self.inner, self.counter = key, inner, counter

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        out = self.inner[index]
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
        Returns the rank's sharded state {param name: tensor}.
        """
        params = self._check_load_args(rank, world_size, model, mappings)
        out: dict[str, torch.Tensor] = {}
        skipped: list[str] = []
        with self.open() as h:
            for item in self._read_all(h, rank, params, dict(mappings or {}), strict, skipped):
                out[item[0]] = self._place(*item, device)
        self._warn_skipped(skipped)
        return out

    def load_sharded_pipelined(self, rank: int, world_size: int, model: torch.nn.Module,
                               mappings: Mappings | None = None, device: str | torch.device = "cpu",
                               strict: bool = True, depth: int = 4) -> dict[str, torch.Tensor]:
        """``load_sharded`` as a two-stage pipeline: a reader thread reads the rank's slices of the next parameters
        (safetensors slicing, up to ``depth`` parameters ahead) while this thread places the previous ones (dtype
        conversion, host→device copy into the parameter). Same arguments, results and errors as load_sharded."""
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"load_sharded_pipelined: depth must be a positive integer, got {depth!r}")
        params = self._check_load_args(rank, world_size, model, mappings)
        out: dict[str, torch.Tensor] = {}
        skipped: list[str] = []
        ready: queue.Queue = queue.Queue(maxsize=depth)
        stop = threading.Event()
        done = object()

        def put(item) -> bool:
            while not stop.is_set():  # the placing side may have failed: never block forever on a full queue
                try:
                    ready.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        def reader() -> None:
            try:
                with self.open() as h:
                    for item in self._read_all(h, rank, params, dict(mappings or {}), strict, skipped):
                        if not put(item):
                            return
                put(done)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                put(e)

        thread = threading.Thread(target=reader, name="load_sharded_pipelined-reader", daemon=True)
        thread.start()
        try:
            while (item := ready.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                out[item[0]] = self._place(*item, device)
        finally:
            stop.set()
            thread.join()
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

    def _read_all(self, h, rank, params, mappings, strict, skipped) -> Iterator[tuple]:
        """Read stage: yield (name, param, target, tensor) with the rank's slices of each parameter's tensors."""
        for name, param in params.items():
            target = mappings.get(name, name)
            keys = {"": target} if isinstance(target, str) else dict(target)
            missing = [k for k in keys.values() if k not in self]
            if missing:
                if not strict:
                    skipped.append(f"{name} (no {missing[0]!r})")
                    continue
                raise KeyError(f"checkpoint {str(self.path)!r} has no tensor {missing[0]!r} "
                               f"(needed by parameter {name!r})")
            sources = {role: h.get_slice(key, name) for role, key in keys.items()}
            if isinstance(target, str):
                sources = sources[""]
            try:
                tensor = get_weight_loader(param)(sources, rank)
            except ValueError as e:
                raise ValueError(f"parameter {name!r} from {target!r}: {e}") from e
            yield name, param, target, _fault_in(tensor)

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
