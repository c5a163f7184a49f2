"""Buffers, allocations and on-chip capacity accounting.

Every `nl.ndarray` is one `Allocation`: a flat NumPy storage array (filled with the NaN / 4 sentinel) that tensor
views address by element offset and strides. Beyond the official simulator, each core's `MemoryPool` accounts the
live on-chip allocations: SBUF bytes per partition against the target's usable size, and PSUM tiles placed first-fit
into the 8 banks of 2 KiB. An allocation is live while any Python object (a view) still references it, which is how
a kernel's tiles go out of scope under NKI's own rules (they die at the end of their loop iteration / block).
"""

import itertools
import math
import sys

import numpy as np

from . import dtypes as dt
from .errors import NkiCapacityError, NkiValidationError


class Buffer:
    """A memory region: `nl.sbuf`, `nl.psum`, `nl.hbm`, `nl.private_hbm`, `nl.shared_hbm`."""

    __slots__ = ("name", "on_chip")

    def __init__(self, name, on_chip):
        self.name = name
        self.on_chip = on_chip

    def __repr__(self):
        return f"nl.{self.name}"

    @property
    def is_hbm(self):
        return not self.on_chip


sbuf = Buffer("sbuf", True)
psum = Buffer("psum", True)
hbm = Buffer("hbm", False)
private_hbm = Buffer("private_hbm", False)
shared_hbm = Buffer("shared_hbm", False)
BUFFERS = {b.name: b for b in (sbuf, psum, hbm, private_hbm, shared_hbm)}


def check_buffer(buffer, what="buffer"):
    if isinstance(buffer, Buffer):
        return buffer
    raise NkiValidationError(
        f"{what}={buffer!r} is not a buffer object; use one of nl.sbuf, nl.psum, nl.hbm, nl.private_hbm, "
        "nl.shared_hbm (string buffer names are rejected since NKI 0.3.0)"
    )


_ids = itertools.count(1)
_SRC_ROOT = __file__.rsplit("/", 1)[0]


def _caller_site():
    # First frame outside nkisim: where the kernel allocated the tensor (reported by the linter and by errors).
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_SRC_ROOT):
        f = f.f_back
    return (f.f_code.co_filename, f.f_lineno) if f is not None else ("<unknown>", 0)


class Allocation:
    """Backing storage of one allocated tensor (all its views share it)."""

    __slots__ = ("id", "dtype", "buffer", "shape", "name", "storage", "pool", "bytes_pp", "psum_addr",
                 "psum_state", "written", "site", "_flat_views", "__weakref__")

    def __init__(self, shape, dtype, buffer, name="", pool=None, storage=None, address=None):
        self.id = next(_ids)
        self.dtype = dtype
        self.buffer = buffer
        self.shape = tuple(shape)
        self.name = name or f"{buffer.name}_{self.id}"
        self.written = False
        self.psum_state = None
        self.psum_addr = None
        self._flat_views = None
        self.site = _caller_site()
        n = math.prod(self.shape)
        if storage is None:
            storage = np.full(n, dt.sentinel(dtype), dtype=dt.storage_dtype(dtype))
        self.storage = storage
        self.bytes_pp = (n // self.shape[0] if self.shape[0] else 0) * dtype.itemsize if buffer.on_chip else 0
        if buffer is psum:
            # 0 = never written, 1 = written by a matmul, 2 = written by another engine (nki-api.md C16)
            self.psum_state = np.zeros(n, dtype=np.int8)
        self.pool = None
        if pool is not None and buffer.on_chip:
            pool.acquire(self, address)
            self.pool = pool

    def flat(self, dtype):
        """The storage as a flat array of `dtype` elements (a byte reinterpretation for `.view(dtype)`)."""
        if dtype is self.dtype:
            return self.storage
        if self._flat_views is None:
            self._flat_views = {}
        v = self._flat_views.get(dtype.name)
        if v is None:
            if self.storage.dtype.itemsize != self.dtype.itemsize:
                raise NkiValidationError(
                    f"view({dtype.name}) of a {self.dtype.name} tensor needs byte-exact storage; it is unavailable "
                    "with NKI_PRECISE_FP=0 (low-precision floats stored as fp32)"
                )
            v = self.storage.view(dt.storage_dtype(dtype) if dtype.kind != "packed" else dtype.storage)
            self._flat_views[dtype.name] = v
        return v

    def __del__(self):
        pool = self.pool
        if pool is not None:
            self.pool = None
            pool.release(self)


class MemoryPool:
    """Live on-chip allocations of one NeuronCore, checked against the target's SBUF and PSUM capacity."""

    def __init__(self, target):
        self.target = target
        self.sbuf_live = {}   # alloc id -> (name, bytes per partition, site)
        self.sbuf_used = 0
        self.sbuf_peak = 0
        self.banks = [[] for _ in range(target.psum_num_banks)]  # per bank: [(start, end, alloc id)]
        self.psum_live = {}   # alloc id -> (name, bytes per partition, site)

    def acquire(self, alloc, address=None):
        if alloc.shape[0] > self.target.pmax:
            raise NkiValidationError(
                f"nl.ndarray: {alloc.buffer.name} tensor '{alloc.name}' partition dimension {alloc.shape[0]} exceeds "
                f"maximum {self.target.pmax} (C1)"
            )
        if alloc.buffer is sbuf:
            self._acquire_sbuf(alloc)
        else:
            self._acquire_psum(alloc, address)

    def _acquire_sbuf(self, alloc):
        limit = self.target.sbuf_usable_bytes
        if self.sbuf_used + alloc.bytes_pp > limit:
            top = sorted(self.sbuf_live.values(), key=lambda v: -v[1])[:5]
            listing = ", ".join(f"{n} {b} B at {s[0].rsplit('/', 1)[-1]}:{s[1]}" for n, b, s in top)
            raise NkiCapacityError(
                f"SBUF capacity exceeded allocating '{alloc.name}' ({alloc.bytes_pp} B/partition at "
                f"{alloc.site[0]}:{alloc.site[1]}): live {self.sbuf_used} B + {alloc.bytes_pp} B > usable {limit} "
                f"B per partition on {self.target.name} (C7); largest live: {listing}"
            )
        self.sbuf_used += alloc.bytes_pp
        self.sbuf_peak = max(self.sbuf_peak, self.sbuf_used)
        self.sbuf_live[alloc.id] = (alloc.name, alloc.bytes_pp, alloc.site)

    def _acquire_psum(self, alloc, address):
        size, bank_bytes = alloc.bytes_pp, self.target.psum_bank_bytes
        if size > self.target.psum_bytes:
            raise NkiCapacityError(
                f"PSUM tensor '{alloc.name}' needs {size} B/partition > PSUM size {self.target.psum_bytes} B (C6)"
            )
        if address is not None:
            start = int(address[1])
            if start % bank_bytes:
                raise NkiValidationError(
                    f"nl.ndarray: PSUM address free_byte_offset={start} must be a multiple of the bank size "
                    f"{bank_bytes} B (C6)"
                )
            placed = self._place_at(start, size, alloc.id)
        else:
            placed = self._place(size, alloc.id)
        if placed is None:
            live = ", ".join(f"{n} ({b} B)" for n, b, _ in self.psum_live.values())
            raise NkiCapacityError(
                f"PSUM banks exhausted allocating '{alloc.name}' ({size} B/partition at {alloc.site[0]}:"
                f"{alloc.site[1]}): all {self.target.psum_num_banks} banks of {bank_bytes} B are taken (C6); "
                f"live PSUM tensors: {live}"
            )
        alloc.psum_addr = placed
        self.psum_live[alloc.id] = (alloc.name, size, alloc.site)

    def _place(self, size, aid):
        bb = self.target.psum_bank_bytes
        if size <= bb:
            for b, spans in enumerate(self.banks):
                cursor = 0
                for s, e, _ in sorted(spans):
                    if s - cursor >= size:
                        break
                    cursor = max(cursor, e)
                if bb - cursor >= size:
                    spans.append((cursor, cursor + size, aid))
                    return b * bb + cursor
            return None
        need = -(-size // bb)
        for b in range(len(self.banks) - need + 1):
            if all(not self.banks[b + i] for i in range(need)):
                return self._place_at(b * bb, size, aid)
        return None

    def _place_at(self, start, size, aid):
        bb = self.target.psum_bank_bytes
        end = start + size
        if end > self.target.psum_bytes:
            return None
        for b in range(start // bb, -(-end // bb)):
            lo, hi = max(start, b * bb) - b * bb, min(end, (b + 1) * bb) - b * bb
            if any(s < hi and lo < e for s, e, _ in self.banks[b]):
                return None
        for b in range(start // bb, -(-end // bb)):
            lo, hi = max(start, b * bb) - b * bb, min(end, (b + 1) * bb) - b * bb
            self.banks[b].append((lo, hi, aid))
        return start

    def release(self, alloc):
        if alloc.buffer is sbuf:
            if self.sbuf_live.pop(alloc.id, None) is not None:
                self.sbuf_used -= alloc.bytes_pp
        elif self.psum_live.pop(alloc.id, None) is not None:
            for spans in self.banks:
                spans[:] = [sp for sp in spans if sp[2] != alloc.id]
