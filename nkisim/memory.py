"""Buffers, allocations and on-chip capacity accounting.

Every `nl.ndarray` is one `Allocation`: a flat NumPy storage array (filled with the NaN / 4 sentinel) that tensor
views address by element offset and strides. Beyond the official simulator, each core's `MemoryPool` accounts the
live on-chip allocations: SBUF bytes per partition against the target's usable size, and PSUM tiles placed first-fit
into the 8 banks of 2 KiB.

Liveness. Inside a kernel the pool is *deferred*: like the compiler's allocator, which assigns addresses to the
whole traced program (nki.compiler.sbuf/psum.auto_alloc: "automatically allocated by compiler"), an allocation is
live from the first to the last instruction that touches it, whatever Python still references. The trace is
checked after the kernel returns (`check_liveness`), and a capacity error still names the allocation site. Outside
a kernel (unit tests, notebooks) there is no program to look ahead in, so an allocation is live while a Python view
references it and the limit is checked at once.

SBUF accounting. SBUF is two-dimensional (partition x free byte) and the compiler places a tile in both: the
direct-allocation API hands an allocation function the tile's `pdim_size` and takes back a start partition and a
byte address (nki.compiler.sbuf.alloc), `nl.ndarray(address=(partition_offset, free_offset))` does the same, and
the engines accept operands starting at partition 32/64/96 (a 32 < P <= 64 tile at 0 or 64, P <= 32 at any
quadrant; NeuronCore-v2 architecture guide). So in a kernel a tile on fewer than 128 partitions occupies only the
quadrants it needs and two 64-partition tiles can share a byte range (AWS's RoPE at B=64, 8 heads, S=128 only fits
trn2 that way). Outside a kernel the eager check stays conservative: every tile blocks its bytes on all partitions.

PSUM addresses. Tiles placed with an explicit `address=` are the memory at that address: two of them at the same
address with the same layout share one storage (re-using an address is how rotating-bank kernels work), they never
conflict with each other, and automatically placed tiles avoid their banks.
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
                 "psum_state", "written", "site", "_flat_views", "rec", "__weakref__")

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
        self.rec = None       # liveness record in a deferred pool: [birth seq, last-use seq, ...]
        self.site = _caller_site()
        n = math.prod(self.shape)
        if storage is None and buffer is psum and address is not None and pool is not None:
            storage = pool.psum_alias(address, self.shape, dtype, n)
        if storage is None:
            storage = dt.filled(n, dtype)
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

    def __init__(self, target, clock=None):
        self.target = target
        self.sbuf_live = {}   # alloc id -> (name, bytes per partition, site)
        self.sbuf_used = 0
        self.sbuf_peak = 0
        self.banks = [[] for _ in range(target.psum_num_banks)]  # per bank: [(start, end, alloc id)]
        self.psum_live = {}   # alloc id -> (name, bytes per partition, site)
        self.explicit = set()  # ids of PSUM allocations placed with address=
        self._aliases = {}    # (partition offset, byte offset, partitions, bytes/partition, storage dtype) -> storage
        # Deferred (in-kernel) liveness: `clock()` is the core's instruction counter; one record per allocation.
        self.clock = clock
        self.deferred = clock is not None
        self.records = []     # [birth, last use, buffer, bytes/partition, name, site, explicit span or None]
        self.rec_by_id = {}   # PSUM alloc id -> its record (to place over the least recently used bank)

    def psum_alias(self, address, shape, dtype, n):
        """The storage an explicitly placed PSUM tile shares with earlier tiles at the same address and layout."""
        key = (int(address[0]), int(address[1]), shape[0], n, dt.storage_dtype(dtype))
        storage = self._aliases.get(key)
        if storage is None:
            storage = self._aliases[key] = dt.filled(n, dtype)
        return storage

    def _record(self, alloc, span=None):
        seq = self.clock()
        # birth is moved to the first instruction touching the tile (CoreContext.emit): a tile is live from its
        # first definition to its last use, as a compiler's liveness sees it.
        alloc.rec = [seq, seq, alloc.buffer, alloc.bytes_pp, alloc.name, alloc.site, span, alloc.shape[0], False]
        self.records.append(alloc.rec)
        if alloc.buffer is psum:
            self.rec_by_id[alloc.id] = alloc.rec

    def acquire(self, alloc, address=None):
        if alloc.shape[0] > self.target.pmax:
            raise NkiValidationError(
                f"nl.ndarray: {alloc.buffer.name} tensor '{alloc.name}' partition dimension {alloc.shape[0]} exceeds "
                f"maximum {self.target.pmax} (C1)"
            )
        if alloc.buffer is sbuf:
            self._acquire_sbuf(alloc, address)
        else:
            self._acquire_psum(alloc, address)

    def _acquire_sbuf(self, alloc, address=None):
        limit = self.target.sbuf_usable_bytes
        if self.deferred and alloc.bytes_pp <= limit:
            start = None if address is None else int(address[1])
            self._record(alloc, None if start is None else (start, start + alloc.bytes_pp))
        elif self.sbuf_used + alloc.bytes_pp > limit:
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
            if start + size > self.target.psum_bytes:
                raise NkiCapacityError(
                    f"nl.ndarray: PSUM tensor '{alloc.name}' at free_byte_offset={start} needs {size} B/partition: "
                    f"ends at {start + size} B > PSUM size {self.target.psum_bytes} B (C6)"
                )
            # An explicit address is the storage at that address: it may re-use (alias) any explicitly placed tile.
            placed = self._place_at(start, size, alloc.id, ignore_explicit=True, force=True)
            self.explicit.add(alloc.id)
            if self.deferred:
                self._record(alloc, (start, start + size))
        else:
            placed = self._place(size, alloc.id)
            if placed is None and self.deferred:
                # Tiles Python still references may be dead in the program: place over the bank whose occupants
                # were used least recently; the trace check (check_liveness) decides whether PSUM really overflowed.
                placed = self._place_over(size, alloc.id)
            if self.deferred:
                self._record(alloc)
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

    def _place_over(self, size, aid):
        bb = self.target.psum_bank_bytes
        need = -(-size // bb)

        def last_use(b):
            return max((self.rec_by_id[i][1] if i in self.rec_by_id else -1
                        for bank in self.banks[b:b + need] for _, _, i in bank), default=-1)

        b = min(range(len(self.banks) - need + 1), key=last_use)
        return self._place_at(b * bb, size, aid, force=True)

    def _place_at(self, start, size, aid, ignore_explicit=False, force=False):
        bb = self.target.psum_bank_bytes
        end = start + size
        if end > self.target.psum_bytes:
            return None
        for b in range(start // bb, -(-end // bb)):
            lo, hi = max(start, b * bb) - b * bb, min(end, (b + 1) * bb) - b * bb
            if not force and any(s < hi and lo < e and not (ignore_explicit and i in self.explicit)
                                 for s, e, i in self.banks[b]):
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
            self.explicit.discard(alloc.id)
            self.rec_by_id.pop(alloc.id, None)
            for spans in self.banks:
                spans[:] = [sp for sp in spans if sp[2] != alloc.id]

    def check_liveness(self):
        """After a kernel's trace: every allocation is live from its first to its last use; raise
        NkiCapacityError at the first allocation that makes the live SBUF or PSUM bytes exceed the capacity."""
        if not self.deferred:
            return
        self._check(sbuf, self.target.sbuf_usable_bytes, "SBUF capacity exceeded", "usable", "C7")
        self._check(psum, self.target.psum_bytes, "PSUM capacity exceeded", "PSUM size", "C6")

    def _check(self, buffer, limit, title, what, cid):
        import heapq
        recs = sorted((r for r in self.records if r[2] is buffer), key=lambda r: r[0])
        if sum(r[3] for r in recs) <= limit:
            return
        quads = buffer is sbuf     # SBUF tiles pack by partition quadrant (module docstring); PSUM tiles do not
        usage = [0, 0, 0, 0]
        live, heap, where = {}, [], {}
        for k, r in enumerate(recs):
            while heap and heap[0][0] < r[0]:
                _, j = heapq.heappop(heap)
                dead = live.pop(j)
                for q in where.pop(j, ()):
                    usage[q] -= dead[3]
            live[k] = r
            heapq.heappush(heap, (r[1], k))
            if r[6] is None:
                where[k] = _quadrants(usage, r[7], r[3]) if quads else (0,)
                for q in where[k]:
                    usage[q] += r[3]
            used = max(usage) + _union(v[6] for v in live.values() if v[6] is not None)
            if used > limit:
                top = sorted(live.values(), key=lambda v: -v[3])[:5]
                listing = ", ".join(f"{v[4]} {v[3]} B on {v[7]} partitions at {v[5][0].rsplit('/', 1)[-1]}:{v[5][1]}"
                                    for v in top)
                raise NkiCapacityError(
                    f"{title} allocating '{r[4]}' ({r[3]} B/partition at {r[5][0]}:{r[5][1]}): {used} B/partition "
                    f"live (from first to last use in the program) > {what} {limit} B per partition on "
                    f"{self.target.name} ({cid}); largest live: {listing}"
                )


def _quadrants(usage, partitions, nbytes):
    """Where the allocator can put a tile of `partitions` rows: a compute-engine access must start at partition 0
    when P > 64, at 0 or 64 when 32 < P <= 64, at 0/32/64/96 when P <= 32 (NeuronCore-v2 architecture guide,
    "Accessing SBUF/PSUM tensors using compute engines"), so such tiles share partitions with others. The least
    loaded legal placement (quadrant indices) is taken."""
    n = -(-partitions // 32)
    if n > 2:
        return tuple(range(n))
    starts = (0, 2) if n == 2 else (0, 1, 2, 3)
    best = min(starts, key=lambda s: max(usage[q] for q in range(s, s + n)))
    return tuple(range(best, best + n))


def _union(spans):
    """Bytes covered by a set of [start, end) spans."""
    total, cursor = 0, None
    for s, e in sorted(spans):
        if cursor is None or s >= cursor:
            total += e - s
            cursor = e
        elif e > cursor:
            total += e - cursor
            cursor = e
    return total
