"""Execution state of a running kernel: one `CoreContext` per NeuronCore (thread), and the instruction record.

Every ISA op appends one `Instruction` to its core's trace: what engine ran it, which byte ranges of which
allocations it read and wrote, and op-specific sizes. The cost model schedules that trace; nothing in it keeps a
tensor alive (only allocation ids), so recording never changes capacity accounting.

Address dependencies: an operand's `Access.deps` lists what computing its address reads — the index tensor of an
indirect (vector_offset / vector_select) view, and the registers or 1-element tensors of a dynamic offset (nl.ds,
`.ap(scalar_offset=...)`, a register index). A `VirtualRegister` is a pseudo-allocation of buffer "reg" (alloc_id
-id): register ops write it, views built from it read it. `Instruction.deps` holds control dependencies: inside a
loop whose bounds / condition come from registers (nl.fori_loop, nl.while_loop) every instruction depends on them.
"""

import math
import os
import threading
import warnings

from . import _blas, _env
from .memory import MemoryPool
from .target import resolve_target
from .tensor import VirtualRegister


class Access:
    """One operand's footprint: allocation, buffer, byte range, bytes, partitions, contiguous bytes per run."""

    __slots__ = ("alloc_id", "buffer", "lo", "hi", "nbytes", "partitions", "run_bytes", "box", "deps",
                 "stride_bytes")

    def __init__(self, alloc_id, buffer, lo, hi, nbytes, partitions, run_bytes, box=None, deps=(), stride_bytes=0):
        self.alloc_id, self.buffer, self.lo, self.hi = alloc_id, buffer, lo, hi
        self.nbytes, self.partitions, self.run_bytes = nbytes, partitions, run_bytes
        # (row_bytes, row_lo, row_hi, col_lo, col_hi): footprint as a box over [dim0, rest] of the allocation
        # (rows inclusive, byte columns half-open), or None when the view does not fit one; the cost model's
        # dependency tracking uses it so that disjoint column slices of one tile do not look overlapping.
        self.box = box
        # Accesses read to compute this operand's address (index tensor, offset registers/tensors): the instruction
        # depends on their producers, but they are not data the instruction moves or computes on.
        self.deps = deps
        # |stride| in bytes of the innermost free dim with more than one element (itemsize when there is none):
        # SBUF engine access runs at half bandwidth above 16 B (nki-api.md §8.4).
        self.stride_bytes = stride_bytes

    def __repr__(self):
        return f"Access({self.buffer}#{self.alloc_id} [{self.lo},{self.hi}) {self.nbytes}B)"


def access_of(t):
    a = t._access
    if a is None:
        a = t._access = _access_of(t)
    return a


def _access_of(t):
    if isinstance(t, VirtualRegister):   # also nisa.NkiScalar (a subclass)
        return Access(-t.id, "reg", 0, 4, 4, 1, 4, None, (), 4)
    isz = t.dtype.itemsize
    lo = hi = t.offset
    for n, s in zip(t.shape, t.strides):
        if n > 1:
            if s < 0:
                lo += (n - 1) * s
            else:
                hi += (n - 1) * s
    run = 1
    for n, s in zip(reversed(t.shape), reversed(t.strides)):
        if n == 1:
            continue
        if s == run:
            run *= n
        else:
            break
    on_chip = t.alloc.buffer.on_chip
    inner = 1
    for j in range(len(t.shape) - 1, 0 if on_chip else -1, -1):   # free dims only on chip
        if t.shape[j] > 1:
            inner = abs(t.strides[j])
            break
    deps = ()
    if t.gather is not None:
        lo, hi = 0, t.alloc.storage.size * t.alloc.dtype.itemsize // isz
        ia = access_of(t.gather.index)
        deps = (ia,) + ia.deps
    if t._regs:
        for r in t._regs:
            ra = access_of(r)
            deps += (ra,) + ra.deps
    nbytes = math.prod(t.shape) * isz
    return Access(t.alloc.id, t.alloc.buffer.name, lo * isz, (hi + 1) * isz, nbytes,
                  t.shape[0] if on_chip else 1, run * isz, _box(t, lo, hi, isz), deps, inner * isz)


def _box(t, lo, hi, isz):
    """The view's footprint as a box over [dim0, rest] of its allocation, in bytes (see Access.box), or None. A view
    of another dtype than the allocation's (a bitcast such as bf16 data ANDed as int32 pairs) is boxed in bytes too:
    its offset and strides count its own elements, the allocation's rows are bytes either way."""
    ashape = t.alloc.shape
    row = math.prod(ashape[1:]) * t.alloc.dtype.itemsize if len(ashape) > 1 else 0     # bytes per dim-0 row
    if row <= 0 or t.gather is not None:
        return None
    c0, ext = t.offset * isz % row, 0
    for n, s in zip(t.shape, t.strides):
        if n > 1 and s * isz % row:
            if s < 0:
                return None
            ext += (n - 1) * s * isz
    if c0 + ext + isz > row:
        return None
    return (row, lo * isz // row, hi * isz // row, c0, c0 + ext + isz)


class Instruction:
    """One executed ISA instruction, as the cost model sees it."""

    __slots__ = ("seq", "core", "op", "engine", "reads", "writes", "meta", "deps")

    def __init__(self, seq, core, op, engine, reads, writes, meta, deps=()):
        self.seq, self.core, self.op, self.engine = seq, core, op, engine
        self.reads, self.writes, self.meta = reads, writes, meta
        self.deps = deps    # control dependencies (registers of enclosing dynamic loops); RAW only

    def __repr__(self):
        return f"Instruction({self.seq}, core={self.core}, {self.op}@{self.engine}, {self.meta})"


class LncShared:
    """What the two cores of an LNC=2 launch share: a barrier and the sendrecv pipes."""

    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n)
        self.cond = threading.Condition()
        self.pipes = {}       # (src_core, dst_core, pipe_id) -> list of payloads
        self.aborted = False
        # Both cores run the same program, so the k-th shared_hbm allocation of each core is one tensor.
        self.shared_allocs = []
        self.lock = threading.Lock()

    def abort(self):
        self.aborted = True
        self.barrier.abort()
        with self.cond:
            self.cond.notify_all()


def _refuse_data_dependent(opname, reads, writes):
    """A trace-only run is valid only if no address or control flow depends on tensor values."""
    from .errors import NkiValidationError
    if opname in ("register_load", "scalar_load"):
        raise NkiValidationError(f"trace-only run: {opname} reads tensor data into a register, so later addresses "
                                 "or loop bounds depend on values that are not computed; run with numerics")
    for t in tuple(reads) + tuple(writes):
        for d in access_of(t).deps:
            if d.buffer != "reg":
                raise NkiValidationError(f"trace-only run: an operand of {opname} is addressed by index/offset "
                                         "tensor data (indirect or dynamic offset), which is not computed; run "
                                         "with numerics")


class CoreContext:
    def __init__(self, program_id=0, num_programs=1, target=None, shared=None, record=True):
        self.program_id = program_id
        self.num_programs = num_programs
        self.target = target if target is not None else resolve_target()
        self.pool = MemoryPool(self.target)
        self.trace = []
        self.record = record
        self.shared = shared
        self.in_kernel = False
        self.no_reorder_depth = 0
        self.warned = set()
        self.seq = 0
        self.shared_alloc_count = 0
        self.is_default = False
        self.env_target = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
        self.ctrl = ()        # Accesses every instruction depends on (registers bounding enclosing dynamic loops)
        self.numerics = True  # False: trace-only run (nkisim.run(numerics=False)); TensorE products are skipped
        self.matmul_scratch = {}   # (M, N) -> this core's reusable fp32 GEMM product (nkisim/isa/tensor_engine.py)
        # Multi-rank launches (nkisim.world): the world this core's rank belongs to, the rank id, the number of
        # collectives issued so far (the rendezvous key) and a pending all_*_v_prepare (its single slot).
        self.world = None
        self.rank = 0
        self.cc_count = 0
        self.cc_prepared = None
        # nl.fori_loop / nl.while_loop bodies: allocations made by the running iteration (innermost last), and the
        # allocations of finished iterations, which no instruction may touch any more (alloc id -> loop name).
        self.loop_scopes = []
        self.dead_allocs = {}

    def defer_liveness(self):
        """Inside a kernel: on-chip allocations live until their last use in the trace (MemoryPool docstring)."""
        self.pool.clock = lambda: self.seq
        self.pool.deferred = True

    def emit(self, opname, engine, reads=(), writes=(), **meta):
        """Record one instruction. `reads`/`writes` are NkiTensors or VirtualRegisters."""
        self.emit_accesses(opname, engine, reads, writes, None, None, meta)

    def emit_accesses(self, opname, engine, reads, writes, read_acc, write_acc, meta):
        """`emit` with the op's meta as a dict and the operands' footprints (tuples of `access_of`, or None): the ISA
        ops' hot path."""
        if self.dead_allocs:
            _check_in_scope(self.dead_allocs, opname, reads, writes)
        if not self.numerics:
            _refuse_data_dependent(opname, reads, writes)
        if self.pool.deferred:
            seq = self.seq
            for t in (*reads, *writes):
                a = getattr(t, "alloc", None)
                if a is None:
                    continue
                rec = a.rec
                if rec is not None:
                    if not rec[8]:
                        rec[0], rec[8] = seq, True
                    rec[1] = seq
                if t.gather is not None and t.gather.index.alloc.rec is not None:
                    t.gather.index.alloc.rec[1] = seq
                if t._regs:
                    for r in t._regs:
                        ra = getattr(r, "alloc", None)
                        if ra is not None and ra.rec is not None:
                            ra.rec[1] = seq
        if self.record:
            if read_acc is None:
                read_acc = tuple([t._access or access_of(t) for t in reads])
                write_acc = tuple([t._access or access_of(t) for t in writes])
            self.trace.append(Instruction(self.seq, self.program_id, opname, engine, read_acc, write_acc, meta,
                                          self.ctrl))
        self.seq += 1

    def warn_once(self, key, message, category):
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, category, stacklevel=4)


def _check_in_scope(dead, opname, reads, writes):
    """A tensor allocated inside a fori_loop / while_loop body exists only in that iteration (NKI traces the body
    once; tensors created inside it are not visible outside it)."""
    for t in (*reads, *writes):
        alloc = getattr(t, "alloc", None)
        if alloc is not None and alloc.id in dead:
            from .errors import NkiValidationError
            raise NkiValidationError(
                f"{opname}: tensor '{alloc.name}' was allocated at {alloc.site[0]}:{alloc.site[1]} inside the body of "
                f"{dead[alloc.id]} and is used after that iteration ended; tensors allocated inside a fori_loop / "
                "while_loop body are not usable after it -- allocate it before the loop and keep state across "
                "iterations in SBUF/HBM")


_local = threading.local()


_TARGET_VAR = "NEURON_PLATFORM_TARGET_OVERRIDE"


def _env_target():
    """os.environ.get(_TARGET_VAR) through nkisim._env (once per ISA op outside kernels)."""
    return _env.get(_TARGET_VAR)


def current() -> CoreContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is not None and (ctx.in_kernel or not ctx.is_default):
        return ctx
    if ctx is None or ctx.env_target != _env_target():
        # Ops called outside a kernel (unit tests, notebooks) run on a default core of their own, which follows
        # NEURON_PLATFORM_TARGET_OVERRIDE when it changes.
        ctx = _local.ctx = CoreContext()
        ctx.is_default = True
    return ctx


def reset_default_core():
    """Drop the default core (its live allocations, trace and accumulators) — e.g. between unit tests."""
    if getattr(_local, "ctx", None) is not None and _local.ctx.is_default:
        _local.ctx = None


def set_current(ctx):
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    if _blas._deferred and (ctx is None or not ctx.in_kernel):   # a kernel ended: BLAS threads back (_blas.py)
        _blas.restore()
    return prev
