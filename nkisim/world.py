"""Multi-rank launches: N instances (ranks) of one kernel run in threads and meet in `nki.collectives` calls.

A rank is a logical NeuronCore: under LNC=2 it is two threads (its physical cores, sharing an `LncShared`), so a
launch of N ranks runs N x LNC threads. Every collective call is a rendezvous of all threads of the world: each
thread deposits a record of its call (op, operands, replica group, call site) under its per-thread collective
counter; the last one to arrive checks that the records agree (same op, group, shapes: SPMD), performs the data
movement of every rank at once (all sources are read before any destination is written) and wakes the others.

No hang: a rank that raises wakes every waiting thread with an error naming it; a thread that finishes the kernel
while others wait in a collective it never called is reported as divergence; as a last resort a rendezvous that
sees no arrival, finish or failure for `NKISIM_COLLECTIVE_TIMEOUT_S` seconds (default 600) names the missing ranks.
"""

import os
import sys
import threading

import numpy as np

from . import lint
from .errors import NkiValidationError
from .runtime import CoreContext, LncShared

_SRC_ROOT = os.path.dirname(os.path.abspath(__file__))


class NkiCollectiveError(NkiValidationError):
    """A collective could not complete: a rank failed, ranks diverged (different collectives / shapes), or timed out."""


def _timeout_s():
    return float(os.environ.get("NKISIM_COLLECTIVE_TIMEOUT_S", "600"))


def call_site():
    """file:line of the kernel code that called into nkisim (first frame outside the package)."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_SRC_ROOT):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "<unknown>"


class CallRecord:
    """One thread's side of one collective call."""

    def __init__(self, op, rank, core, site, signature, payload):
        self.op, self.rank, self.core, self.site = op, rank, core, site
        self.signature = signature      # what must agree across ranks (op, group, shapes, dtypes, options)
        self.payload = payload          # operands for the executor (tensors, metadata, ...)

    def describe(self):
        return f"rank {self.rank} core {self.core}: {self.op} at {self.site}"


class _Call:
    __slots__ = ("k", "records", "complete", "error", "results")

    def __init__(self, k):
        self.k = k
        self.records = {}
        self.complete = False
        self.error = None
        self.results = {}


class World:
    """The ranks of one collective launch and their rendezvous points."""

    def __init__(self, size, lnc, target):
        self.size, self.lnc, self.target = size, lnc, target
        self.cond = threading.Condition()
        self.calls = {}
        self.finished = {}       # (rank, core) -> number of collectives the thread issued
        self.failure = None      # (rank, core, exception) of the first thread that raised
        self.lnc_shared = []     # per-rank LncShared, aborted with the world
        self.events = 0          # arrivals + finishes + failures (progress, for the last-resort timeout)

    @property
    def participants(self):
        return self.size * self.lnc

    # ---- thread lifecycle ----------------------------------------------------------------------------------------
    def finish(self, rank, core, count):
        with self.cond:
            self.finished[(rank, core)] = count
            self.events += 1
            self.cond.notify_all()

    def fail(self, rank, core, exc):
        with self.cond:
            if self.failure is None:
                self.failure = (rank, core, exc)
            self.events += 1
            self.cond.notify_all()
        for sh in self.lnc_shared:
            sh.abort()

    # ---- rendezvous ---------------------------------------------------------------------------------------------
    def rendezvous(self, ctx, record, execute):
        """Deposit `record` as this thread's k-th collective; returns this thread's result once every thread of the
        world has arrived and the last arrival has run `execute(records)` (a dict keyed by (rank, core))."""
        k = ctx.cc_count
        ctx.cc_count += 1
        key = (record.rank, record.core)
        with self.cond:
            self._check(k, record)
            call = self.calls.get(k)
            if call is None:
                call = self.calls[k] = _Call(k)
            call.records[key] = record
            self.events += 1
            if len(call.records) == self.participants:
                try:
                    call.results = execute(call.records) or {}
                except Exception as e:  # noqa: BLE001 - delivered to every participant below
                    call.error = e
                call.complete = True
                self.calls.pop(k, None)
                self.cond.notify_all()
            else:
                self.cond.notify_all()
                seen, limit = self.events, _timeout_s()
                while not call.complete:
                    self._check(k, record)
                    if not self.cond.wait(timeout=limit) and self.events == seen and not call.complete:
                        missing = sorted(set(self._all_keys()) - set(call.records))
                        raise NkiCollectiveError(
                            f"{record.op}: collective #{k} ({record.site}) waited {limit:.0f} s without progress; "
                            f"missing: {_keys(missing)} (NKISIM_COLLECTIVE_TIMEOUT_S)")
                    seen = self.events
        if call.error is not None:
            raise _copy(call.error)
        return call.results.get(key)

    def _all_keys(self):
        return [(r, c) for r in range(self.size) for c in range(self.lnc)]

    def _check(self, k, record):
        """Raise when this rendezvous can never complete (a rank died, or finished without this collective)."""
        if self.failure is not None:
            r, c, exc = self.failure
            raise NkiCollectiveError(
                f"{record.op}: collective #{k} on rank {record.rank} core {record.core} ({record.site}) cannot "
                f"complete: rank {r} core {c} failed with {type(exc).__name__}: {exc}")
        for shared in self.lnc_shared:
            if shared.aborted:
                raise NkiCollectiveError(f"{record.op}: collective #{k} cannot complete: a core of an LNC=2 rank "
                                         "failed")
        gone = sorted(key for key, n in self.finished.items() if n <= k)
        if gone:
            r, c = gone[0]
            raise NkiCollectiveError(
                f"{record.op}: ranks diverge: rank {record.rank} core {record.core} waits in collective "
                f"#{k} ({record.site}) but rank {r} core {c} finished the kernel after {self.finished[(r, c)]} "
                f"collective(s); every rank must issue the same sequence of collectives")


def _keys(keys):
    return ", ".join(f"rank {r} core {c}" for r, c in keys) or "none"


def _copy(exc):
    """A fresh exception of the same type and message for each raising thread (tracebacks are per thread)."""
    try:
        new = type(exc)(*exc.args)
    except Exception:  # noqa: BLE001 - exotic constructor: fall back to a generic collective error
        new = NkiCollectiveError(str(exc))
    new.__cause__ = exc.__cause__
    return new


def check_agreement(records, group_of=None):
    """Divergence check: every record's signature equals the first one's (within its rank-list when `group_of`
    maps a record to a rank-list key). Raises NkiCollectiveError naming the two disagreeing calls."""
    first = {}
    for key in sorted(records):
        rec = records[key]
        g = group_of(rec) if group_of else None
        ref = first.setdefault(g, rec)
        if rec.signature != ref.signature:
            diff = _first_difference(ref.signature, rec.signature)
            raise NkiCollectiveError(
                f"{rec.op}: ranks diverge at the same collective: {ref.describe()} vs {rec.describe()}"
                f"{': ' + diff if diff else ''}")


def _first_difference(a, b):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if a.get(k) != b.get(k):
                return f"{k} {a.get(k)!r} != {b.get(k)!r}"
    return f"{a!r} != {b!r}"


# ---- launching N ranks ---------------------------------------------------------------------------------------------

class WorldResult:
    """Outputs of every rank (`outputs[r]`) and each rank's RunResult (`ranks[r]`: contexts / traces, target)."""

    def __init__(self, outputs, ranks, world):
        self.outputs = outputs
        self.ranks = ranks
        self.world = world


class PerRank:
    """A kernel argument that differs per rank: `per_rank([x0, x1, ...])` gives rank r the value `values[r]`."""

    def __init__(self, values):
        self.values = list(values)


def per_rank(values):
    return PerRank(values)


def simulate_collective(kernel, world_size):
    """`nkisim.simulate_collective(kernel, world_size=N)(*args, **kwargs)` -> list of N per-rank outputs.

    Arguments wrapped in `nkisim.per_rank([...])` (N values) differ per rank; every other argument is given to
    every rank (each rank gets its own copy of arrays). `kernel[2]` runs each rank as an LNC=2 pair."""
    def launch(*args, **kwargs):
        for v in list(args) + list(kwargs.values()):
            if isinstance(v, PerRank) and len(v.values) != world_size:
                raise NkiValidationError(f"per_rank argument has {len(v.values)} values for world_size={world_size}")

        def pick(v, r):
            return v.values[r] if isinstance(v, PerRank) else v

        def inputs(r):
            return tuple(pick(a, r) for a in args), {k: pick(v, r) for k, v in kwargs.items()}
        return run_ranks(kernel, world_size, inputs).outputs
    return launch


def run_ranks(kernel, world_size, rank_inputs, target=None, record=True):
    """Run `world_size` ranks of `kernel` (a jit Kernel or function; `kernel[2]` for LNC=2 ranks).

    rank_inputs(r) -> kwargs dict, or -> (args tuple, kwargs dict); a list of per-rank dicts also works.
    Returns a WorldResult. Raises the first failing rank's exception (with a note naming the rank), an
    NkiCollectiveError for divergence, or an NkiValidationError for a violated collective constraint."""
    from .jit import Kernel, RunResult, _Binding, _run_core
    from .memory import hbm, shared_hbm
    from .target import resolve_target

    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or int(world_size) < 1:
        raise NkiValidationError(f"run_ranks: world_size={world_size!r} must be a positive int")
    n = int(world_size)
    k = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
    tgt = resolve_target(target)
    lnc = k.lnc
    lint.raise_if_violations(list(lint.check_kernel(k.func)))
    world = World(n, lnc, tgt)
    bindings, contexts, calls = [], [], []
    for r in range(n):
        spec = rank_inputs[r] if isinstance(rank_inputs, (list, tuple)) else rank_inputs(r)
        args, kwargs = spec if isinstance(spec, tuple) else ((), dict(spec))
        lint.raise_if_violations(list(lint.check_call_args(k.func, args, kwargs)))
        b = _Binding(shared_hbm if lnc == 2 else hbm)
        targs = b.wrap(tuple(args), "args")
        tkwargs = {key: b.wrap(v, key) for key, v in kwargs.items()}
        shared = LncShared(lnc) if lnc == 2 else None
        if shared is not None:
            world.lnc_shared.append(shared)
        ctxs = [CoreContext(c, lnc, tgt, shared=shared, record=record) for c in range(lnc)]
        for c in ctxs:
            c.world, c.rank = world, r
        bindings.append(b)
        contexts.append(ctxs)
        calls.append((targs, tkwargs))

    results = [[None] * lnc for _ in range(n)]
    errors = {}

    def body(r, c):
        ctx = contexts[r][c]
        try:
            results[r][c] = _run_core(k.func, ctx, *calls[r])
            pending = getattr(ctx, "cc_prepared", None)
            if pending is not None:
                raise NkiValidationError(f"{pending.op}: prepared at {pending.site} but never triggered; each "
                                         f"prepare must be followed by exactly one {pending.op[:-8]}_trigger")
            world.finish(r, c, ctx.cc_count)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread below
            errors[(r, c)] = e
            world.fail(r, c, e)

    threads = [threading.Thread(target=body, args=(r, c), name=f"nkisim-rank{r}-core{c}")
               for r in range(n) for c in range(lnc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise first_failure(errors, world)
    outputs, runs = [], []
    for r in range(n):
        out = results[r][0]
        lint.raise_if_violations(lint.check_outputs(k.func, out))
        bindings[r].write_back()
        outputs.append(bindings[r].unwrap(out))
        runs.append(RunResult(outputs[-1], contexts[r], tgt))
    return WorldResult(outputs, runs, world)


def first_failure(errors, world):
    """The exception that explains the failure: the first rank's own error (not one caused by another rank)."""
    def secondary(e):
        if isinstance(e, RuntimeError) and "other core failed" in str(e):
            return True
        return isinstance(e, NkiCollectiveError) and "cannot complete" in str(e)

    keys = sorted(errors)
    primary = [key for key in keys if not secondary(errors[key])] or keys
    r, c = primary[0]
    exc = errors[(r, c)]
    others = [key for key in keys if key != (r, c)]
    if world.size > 1 or world.lnc > 1:
        note = f"nkisim: raised on rank {r} core {c} of a {world.size}-rank launch (LNC={world.lnc})"
        if others:
            note += f"; also stopped: {_keys(others)}"
        exc.add_note(note)
    return exc


def one_rank_world(shared, contexts):
    """The world of a plain (one-rank) launch, so that collectives and their failure reports work there too."""
    world = World(1, len(contexts), contexts[0].target)
    if shared is not None:
        world.lnc_shared.append(shared)
    for ctx in contexts:
        ctx.world = world
    return world


# ---- ranks in separate processes -----------------------------------------------------------------------------------

class _Detached:
    """A tensor's values sent to another process: rebuilt there as a fresh HBM tensor (collectives only read the
    sources of other ranks; what they write into another rank's rebuilt destination is dropped)."""

    def __init__(self, t, op):
        from .tensor import read
        self.values = np.array(read(t, op), copy=True)
        self.dtype, self.shape, self.name = t.dtype.name, tuple(t.shape), t.name

    def tensor(self):
        from . import dtypes as dt
        from .memory import Allocation, hbm
        from .tensor import NkiTensor
        d = dt.as_dtype(self.dtype)
        storage = self.values.reshape(-1).astype(dt.storage_dtype(d), copy=True)
        alloc = Allocation(self.shape, d, hbm, name=f"remote:{self.name}", storage=storage)
        strides = [1] * len(self.shape)
        for i in range(len(self.shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * self.shape[i + 1]
        alloc.written = True
        return NkiTensor(alloc, self.shape, strides, 0, d)


def _portable(x, op):
    from .tensor import NkiTensor
    if isinstance(x, NkiTensor):
        return _Detached(x, op)
    if isinstance(x, (list, tuple)):
        return type(x)(_portable(v, op) for v in x)
    return x


def _rebuilt(x):
    if isinstance(x, _Detached):
        return x.tensor()
    if isinstance(x, (list, tuple)):
        return type(x)(_rebuilt(v) for v in x)
    return x


class ProcessWorld(World):
    """A world whose ranks are separate processes (e.g. torch.distributed workers): this process runs rank `rank`
    of `size` at LNC=1, and every process launches the same kernels in the same order (SPMD). At each collective,
    `exchange(obj)` -- an all-gather of picklable objects over all `size` processes, returning the list in rank
    order (e.g. torch.distributed.all_gather_object) -- carries every rank's call record with its source values;
    each process then runs the same exact data movement and keeps its own destinations."""

    def __init__(self, rank, size, exchange, target):
        super().__init__(size, 1, target)
        if not 0 <= rank < size:
            raise NkiValidationError(f"process_world: rank={rank} must be in 0..{size - 1}")
        self.rank, self.exchange = int(rank), exchange

    def rendezvous(self, ctx, record, execute):
        k = ctx.cc_count
        ctx.cc_count += 1
        mine = CallRecord(record.op, record.rank, record.core, record.site, record.signature,
                          _portable(record.payload, record.op))
        gathered = self.exchange((k, mine))
        records = {}
        for r, (kr, rec) in enumerate(gathered):
            if kr != k or rec.op != record.op:
                raise NkiCollectiveError(f"{record.op}: ranks diverge: rank {self.rank} is at collective #{k} "
                                         f"({record.site}) but rank {r} at #{kr} ({rec.op} at {rec.site})")
            records[(r, 0)] = record if r == self.rank else CallRecord(
                rec.op, rec.rank, rec.core, rec.site, rec.signature, _rebuilt(rec.payload))
        return (execute(records) or {}).get((self.rank, 0))


_AMBIENT = threading.local()


class process_world:  # noqa: N801 - used as a context manager, like a function
    """`with nkisim.process_world(rank, size, exchange): kernel(...)`: the LNC=1 launches made inside by this
    thread are rank `rank` of a `size`-rank world spread over processes (see ProcessWorld)."""

    def __init__(self, rank, size, exchange, target=None):
        from .target import resolve_target
        self.world = ProcessWorld(rank, size, exchange, resolve_target(target))

    def __enter__(self):
        self.prev = getattr(_AMBIENT, "world", None)
        _AMBIENT.world = self.world
        return self.world

    def __exit__(self, *exc):
        _AMBIENT.world = self.prev
        return False


def ambient_world():
    """The ProcessWorld of an enclosing `process_world` block of this thread, or None."""
    return getattr(_AMBIENT, "world", None)
