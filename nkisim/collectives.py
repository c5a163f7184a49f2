"""`nki.collectives` (import nki.collectives as ncc): collectives across the ranks of a multi-rank launch.

Signatures and constraints follow AWS's API stub `nki/api/nki/collectives/__init__.py` (Neuron 2.32, NKI 0.6) and
the NKI 0.7 pages (Neuron 2.33: `all_*_v_prepare` / `_trigger`, `ReplicaGroup.from_partition_op`, shared/private
HBM rules, NkiInstruction results). Ranks meet in `nkisim.world` (one rendezvous per call, SPMD agreement
checked); the data movement is exact NumPy: moves copy storage values, reductions accumulate in fp32 (int64 for
integer dtypes) in rank-list order and round once to the destination dtype.

Rank model: a rank is a logical core. Under LNC=2 both physical cores of a rank issue each collective; core c of
every rank exchanges with core c of the others (SBUF operands are per core, as nki-library's SBUF all-reduce plus
`sendrecv` relies on); identical shared_hbm operands of the two cores give the same result twice.

Every collective records one instruction on the "cc" engine for the cost model (nkisim.cost.collective).
"""

import enum
import os
from dataclasses import dataclass

import numpy as np

from . import dtypes as dt
from . import ops
from .errors import NkiValidationError
from .language import NKIObject
from .memory import hbm, private_hbm, sbuf, shared_hbm
from .runtime import current
from .tensor import NkiTensor, VirtualRegister, read, write
from .world import CallRecord, NkiCollectiveError, World, call_site, check_agreement

__all__ = ["ReplicaGroup", "rg_partition_op", "NkiInstruction", "all_reduce", "all_gather", "all_gather_v",
           "all_gather_v_prepare", "all_gather_v_trigger", "reduce_scatter", "all_to_all", "all_to_all_v",
           "all_to_all_v_prepare", "all_to_all_v_trigger", "collective_permute", "collective_permute_implicit",
           "collective_permute_implicit_reduce", "collective_permute_implicit_current_processing_rank_id",
           "rank_id", "NkiCollectiveError"]

_REDUCE_OPS = ("add", "minimum", "maximum")
_MAX_CHANNELS_NODE, _MAX_CHANNELS_OTHER = 4, 2


def _fail(op, msg):
    raise NkiValidationError(f"{op}: {msg}")


# ---- ReplicaGroup --------------------------------------------------------------------------------------------------

class rg_partition_op(enum.Enum):  # noqa: N801 - AWS's name
    """Partition operator of `ReplicaGroup.from_partition_op`: rank_list_id = op(rank, operand)."""
    bitwise_and = "bitwise_and"
    div = "div"
    mod = "mod"


@dataclass
class ReplicaGroup(NKIObject):
    """The set of ranks a collective runs on, as a list of rank-lists; the collective runs independently within each
    rank-list and every rank appears in at most one rank-list (e.g. [[0, 1, 2, 3], [4, 5, 6, 7]])."""

    rank_lists: list

    def __post_init__(self):
        what = "ReplicaGroup"
        try:
            lists = [list(g) for g in self.rank_lists]
        except TypeError:
            _fail(what, f"expects a list of rank-lists, got {self.rank_lists!r}")
        if not lists:
            _fail(what, "needs at least one rank-list")
        seen = set()
        for g in lists:
            if not g:
                _fail(what, f"rank-list {g} is empty")
            for r in g:
                if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0:
                    _fail(what, f"rank {r!r} in {g} must be a non-negative int")
                if int(r) in seen:
                    _fail(what, f"rank {r} appears in more than one rank-list; each rank participates in only one")
                seen.add(int(r))
        self.rank_lists = [[int(r) for r in g] for g in lists]

    @staticmethod
    def from_partition_op(world_size, op, operand):
        """Ranks [0, world_size) with equal op(rank, operand) form one rank-list (ordered by first rank)."""
        if not isinstance(op, rg_partition_op):
            _fail("ReplicaGroup.from_partition_op", f"op={op!r} must be an rg_partition_op")
        if op is not rg_partition_op.bitwise_and and int(operand) == 0:
            _fail("ReplicaGroup.from_partition_op", f"operand=0 divides by zero for {op.name}")
        fn = {rg_partition_op.bitwise_and: lambda r: r & operand, rg_partition_op.div: lambda r: r // operand,
              rg_partition_op.mod: lambda r: r % operand}[op]
        lists = {}
        for r in range(int(world_size)):
            lists.setdefault(fn(r), []).append(r)
        return ReplicaGroup(list(lists.values()))

    def rank_list_of(self, rank):
        for g in self.rank_lists:
            if rank in g:
                return g
        return None

    def __repr__(self):
        return f"ReplicaGroup({self.rank_lists})"


class NkiInstruction:
    """What a collective returns (NKI 0.7): a handle naming the instruction; prepares hand it to their trigger."""

    def __init__(self, op, name=None, prepared=None):
        self.op, self.name, self._prepared = op, name, prepared

    def __repr__(self):
        return f"NkiInstruction({self.op}{', ' + repr(self.name) if self.name else ''})"


# ---- argument checks -----------------------------------------------------------------------------------------------

def _group(op, rg, world):
    if not isinstance(rg, ReplicaGroup):
        _fail(op, f"replica_group must be an nki.collectives.ReplicaGroup, got {type(rg).__name__}")
    for g in rg.rank_lists:
        for r in g:
            if r >= world.size:
                _fail(op, f"replica_group rank {r} is outside the launch's {world.size} ranks (0..{world.size - 1})")
    return rg


def _tensor_list(op, name, xs, exactly_one=False):
    if isinstance(xs, NkiTensor) or not isinstance(xs, (list, tuple)):
        _fail(op, f"{name} must be a list of tensors, got {type(xs).__name__}")
    if not xs:
        _fail(op, f"{name} is empty")
    for i, t in enumerate(xs):
        if not isinstance(t, NkiTensor):
            _fail(op, f"{name}[{i}] must be an NkiTensor, got {type(t).__name__}")
    if exactly_one and len(xs) != 1:
        _fail(op, f"{name} has {len(xs)} tensors; coalesced collective communication is not supported, each list "
                  "must contain exactly one tensor")
    return list(xs)


def _paired_lists(op, srcs, dsts):
    """srcs / dsts of the coalesced collectives: lists of tensors that pair up by index."""
    srcs, dsts = _tensor_list(op, "srcs", srcs), _tensor_list(op, "dsts", dsts)
    if len(srcs) != len(dsts):
        _fail(op, f"{len(srcs)} srcs but {len(dsts)} dsts; they pair up by index")
    return srcs, dsts


def _memory(op, srcs, dsts, ctx, sbuf_ok=True, coalesced=True, hbm_kinds=False):
    """Placement rules of the collectives pages (NKI 0.6 stub; NKI 0.7 pages). `coalesced`: several srcs are several
    tensors of one collective (False for the per-channel tensors of a ring permute). `hbm_kinds`: the private/shared
    HBM rules the 0.7 all_reduce and all_gather pages state (the other pages do not)."""
    everything = [("srcs", t) for t in srcs] + [("dsts", t) for t in dsts]
    for name, t in everything:
        if t.buffer not in (sbuf, hbm, private_hbm, shared_hbm):
            _fail(op, f"{name} tensor '{t.name}' is in {t.buffer.name}; collectives take HBM or SBUF tensors")
    on_sbuf = [t.buffer is sbuf for _, t in everything]
    if any(on_sbuf) and not sbuf_ok:
        _fail(op, f"tensors must reside on HBM; SBUF is not currently supported for {op}")
    if any(on_sbuf) and not all(on_sbuf):
        _fail(op, "tensors can reside on either HBM or SBUF, but not a mix of the two")
    if all(on_sbuf):
        if coalesced and (len(srcs) > 1 or len(dsts) > 1):
            _fail(op, f"{len(srcs)} srcs / {len(dsts)} dsts on SBUF: coalesced collective communication (multiple "
                      "tensors) is only supported when tensors are on HBM")
        for name, t in everything:
            if t.ndim != 2:
                _fail(op, f"{name} tensor '{t.name}' has shape {t.shape}: SBUF collectives operate on 2D tensors "
                          "with a single free dimension")
        return "sbuf"
    if not hbm_kinds:
        return "hbm"
    for name, ts in (("srcs", srcs), ("dsts", dsts)):
        kinds = {"shared_hbm" if t.buffer is shared_hbm else "private_hbm" for t in ts}
        if len(kinds) > 1:
            _fail(op, f"the tensors within {name} must be either all private_hbm or all shared_hbm")
    if ctx.num_programs == 1:
        if any(t.buffer is shared_hbm for t in srcs):
            _fail(op, "with LNC degree 1 the srcs must be on private_hbm (a shared_hbm src needs LNC=2)")
        if any(t.buffer is shared_hbm for t in dsts) and os.environ.get("NKI_LNC1_SHARED_HBM") != "1":
            _fail(op, "with LNC degree 1 a dst may be on shared_hbm only when NKI_LNC1_SHARED_HBM=1 is set")
    return "hbm"


def _priority(op, priority, ctx):
    if priority is None:
        return
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)) or not 0 <= int(priority) <= 3:
        _fail(op, f"priority={priority!r} must be a DMA QoS level 0-3 (lower is higher priority)")
    if ctx.target.nc_version < 4:
        _fail(op, f"priority is NeuronCore-v4+ only (target {ctx.target.name} is v{ctx.target.nc_version})")


def _reduce_op(op, fn):
    name = ops.op_name(fn, f"{op}: op")
    if name not in _REDUCE_OPS:
        _fail(op, f"op=nl.{name} is not supported; the reduction must be nl.add, nl.minimum or nl.maximum")
    return name


def _dim(op, collective_dim, allowed):
    if isinstance(collective_dim, bool) or not isinstance(collective_dim, (int, np.integer)) or \
            int(collective_dim) not in allowed:
        _fail(op, f"collective_dim={collective_dim!r}: only {' or '.join(map(str, allowed))} is supported here")
    return int(collective_dim)


def _same_dtype(op, a_name, a, b_name, b):
    if a.dtype is not b.dtype:
        _fail(op, f"{a_name} is {a.dtype.name} but {b_name} is {b.dtype.name}; collectives move data without "
                  "converting it (nkisim rule: the pages do not define a conversion)")


def _sig(t):
    return (tuple(t.shape), t.dtype.name, t.buffer.name)


# ---- world access --------------------------------------------------------------------------------------------------

def _world(ctx):
    """The launch's world. Every launch sets it (run_ranks; jit's LNC=2 path via world.one_rank_world); only a lone
    LNC=1 core (kernel(...), a default core outside a kernel) gets a one-rank world of its own here."""
    if ctx.world is None:
        ctx.world = World(1, 1, ctx.target)
    return ctx.world


def _vals(t, op):
    return np.array(read(t, op), copy=True)


def _acc(values, dtype):
    return values.astype(np.int64) if dtype.kind in ("int", "bool") else dt.to_fp32(values).astype(np.float32)


def _store(t, values, op):
    write(t, dt.cast(values, t.dtype, t.alloc.flat(t.dtype).dtype).reshape(t.shape), op)


def _by_list(records, rg):
    """[(core, rank_list, [record per rank of the list])] for every rank-list and core index."""
    cores = sorted({c for _, c in records})
    return [(c, g, [records[(r, c)] for r in g]) for c in cores for g in rg.rank_lists]


def _agree(records):
    ops_ = {rec.op for rec in records.values()}
    if len(ops_) > 1:
        by_op = {}
        for key in sorted(records):
            by_op.setdefault(records[key].op, records[key])
        a, b = list(by_op.values())[:2]
        raise NkiCollectiveError(f"{a.op}: ranks diverge at the same collective: {a.describe()} vs {b.describe()}")
    check_agreement(records, group_of=lambda rec: rec.core)


def _run(ctx, op, signature, payload, execute, rank_list_size, nbytes, reads, writes, **meta):
    """Rendezvous with the other ranks, run `execute` once for all, record this thread's instruction."""
    world = _world(ctx)
    rec = CallRecord(op, ctx.rank, ctx.program_id, call_site(), signature, payload)

    def run_all(records):
        _agree(records)
        pending = []        # (tensor, values): every source is read before any destination is written
        execute(records, pending)
        for t, v in pending:
            _store(t, v, op)

    world.rendezvous(ctx, rec, run_all)
    ctx.emit(op, "cc", reads, writes, sync=True, collective=op, ranks=rank_list_size, nbytes=int(nbytes),
             lnc=ctx.num_programs, **meta)


def _nbytes(ts):
    return sum(t.size * t.dtype.itemsize for t in ts)


def _rank_list_size(rg, rank):
    g = rg.rank_list_of(rank)
    return len(g) if g else 1


# ---- all_reduce / all_gather / reduce_scatter / all_to_all ---------------------------------------------------------

def _reduce(name, arrays):
    fn = ops.ALU_ARITH[name][0]
    acc = arrays[0]
    for a in arrays[1:]:
        acc = fn(acc, a)
    return acc


def all_reduce(srcs, dsts, replica_group, op, priority=None, name=None):
    """Every rank of a rank-list receives op(srcs of all ranks of the list) in its dsts (coalesced: per index)."""
    cop = "all_reduce"
    ctx = current()
    world = _world(ctx)
    srcs, dsts = _paired_lists(cop, srcs, dsts)
    _memory(cop, srcs, dsts, ctx, hbm_kinds=True)
    _priority(cop, priority, ctx)
    rg = _group(cop, replica_group, world)
    rname = _reduce_op(cop, op)
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        _same_dtype(cop, f"srcs[{i}]", s, f"dsts[{i}]", d)
        if s.size != d.size:
            _fail(cop, f"srcs[{i}] has {s.size} elements but dsts[{i}] has {d.size}")

    def execute(records, pending):
        for _, _, recs in _by_list(records, rg):
            for i in range(len(srcs)):
                ins = [rec.payload[0][i] for rec in recs]
                total = _reduce(rname, [_acc(_vals(t, cop), t.dtype) for t in ins])
                pending.extend((rec.payload[1][i], total) for rec in recs)

    sig = {"op": rname, "group": rg.rank_lists, "srcs": [_sig(t) for t in srcs], "dsts": [_sig(t) for t in dsts]}
    _run(ctx, cop, sig, (srcs, dsts), execute, _rank_list_size(rg, ctx.rank), _nbytes(srcs), srcs, dsts,
         reduce=rname)
    return NkiInstruction(cop, name)


def _concat_shape_check(op, src, dst, dim, n, i, what):
    expect = list(src.shape)
    expect[dim] *= n
    if tuple(expect) != tuple(dst.shape):
        _fail(op, f"dsts[{i}] has shape {dst.shape}; {what} of srcs[{i}] {src.shape} over {n} ranks along "
                  f"collective_dim={dim} needs {tuple(expect)}")


def all_gather(srcs, dsts, replica_group, collective_dim, priority=None, name=None):
    """dst = concatenation of the srcs of the rank-list's ranks (in rank-list order) along collective_dim."""
    cop = "all_gather"
    ctx = current()
    world = _world(ctx)
    srcs, dsts = _paired_lists(cop, srcs, dsts)
    where = _memory(cop, srcs, dsts, ctx, hbm_kinds=True)
    # collective_dim: only 0 on HBM; 0 or 1 on SBUF (2D tensors) [SDK stub all_gather]
    dim = _dim(cop, collective_dim, (0, 1) if where == "sbuf" else (0,))
    _priority(cop, priority, ctx)
    rg = _group(cop, replica_group, world)
    n = _rank_list_size(rg, ctx.rank)
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        _same_dtype(cop, f"srcs[{i}]", s, f"dsts[{i}]", d)
        _concat_shape_check(cop, s, d, dim, n, i, "the gather")
    if where == "sbuf" and dsts[0].shape[0] > 128:
        _fail(cop, f"dsts[0] would need {dsts[0].shape[0]} partitions (max 128)")

    def execute(records, pending):
        for _, _, recs in _by_list(records, rg):
            for i in range(len(srcs)):
                whole = np.concatenate([_vals(rec.payload[0][i], cop) for rec in recs], axis=dim)
                pending.extend((rec.payload[1][i], whole) for rec in recs)

    sig = {"dim": dim, "group": rg.rank_lists, "srcs": [_sig(t) for t in srcs], "dsts": [_sig(t) for t in dsts]}
    _run(ctx, cop, sig, (srcs, dsts), execute, n, _nbytes(dsts), srcs, dsts)
    return NkiInstruction(cop, name)


def reduce_scatter(srcs, dsts, replica_group, collective_dim, op, priority=None, name=None):
    """op-reduce the srcs of a rank-list; the rank at position p of the list receives chunk p (split on dim 0)."""
    cop = "reduce_scatter"
    ctx = current()
    world = _world(ctx)
    srcs, dsts = _paired_lists(cop, srcs, dsts)
    _memory(cop, srcs, dsts, ctx)
    dim = _dim(cop, collective_dim, (0,))     # only 0 for HBM and SBUF [SDK stub reduce_scatter]
    _priority(cop, priority, ctx)
    rg = _group(cop, replica_group, world)
    rname = _reduce_op(cop, op)
    n = _rank_list_size(rg, ctx.rank)
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        _same_dtype(cop, f"srcs[{i}]", s, f"dsts[{i}]", d)
        _concat_shape_check(cop, d, s, dim, n, i, "the scatter")

    def execute(records, pending):
        for _, _, recs in _by_list(records, rg):
            for i in range(len(srcs)):
                total = _reduce(rname, [_acc(_vals(rec.payload[0][i], cop), rec.payload[0][i].dtype)
                                        for rec in recs])
                for p, chunk in enumerate(np.split(total, len(recs), axis=dim)):
                    pending.append((recs[p].payload[1][i], chunk))

    sig = {"op": rname, "group": rg.rank_lists, "srcs": [_sig(t) for t in srcs], "dsts": [_sig(t) for t in dsts]}
    _run(ctx, cop, sig, (srcs, dsts), execute, n, _nbytes(srcs), srcs, dsts, reduce=rname)
    return NkiInstruction(cop, name)


def all_to_all(srcs, dsts, replica_group, collective_dim, priority=None, name=None):
    """srcs split on dim 0 into one chunk per rank of the list: chunk q of the rank at position p goes to chunk p of
    the rank at position q."""
    cop = "all_to_all"
    ctx = current()
    world = _world(ctx)
    srcs, dsts = _paired_lists(cop, srcs, dsts)
    _memory(cop, srcs, dsts, ctx, sbuf_ok=False)    # HBM only [SDK stub all_to_all]
    _dim(cop, collective_dim, (0,))
    _priority(cop, priority, ctx)
    rg = _group(cop, replica_group, world)
    n = _rank_list_size(rg, ctx.rank)
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        _same_dtype(cop, f"srcs[{i}]", s, f"dsts[{i}]", d)
        if s.shape != d.shape:
            _fail(cop, f"srcs[{i}] {s.shape} and dsts[{i}] {d.shape} must have the same shape")
        if s.shape[0] % n:
            _fail(cop, f"srcs[{i}] dim 0 ({s.shape[0]}) is not divisible by the {n} ranks of the rank-list")

    def execute(records, pending):
        for _, _, recs in _by_list(records, rg):
            for i in range(len(srcs)):
                chunks = [np.split(_vals(rec.payload[0][i], cop), len(recs), axis=0) for rec in recs]
                for q, rec in enumerate(recs):
                    pending.append((rec.payload[1][i], np.concatenate([chunks[p][q] for p in range(len(recs))])))

    sig = {"group": rg.rank_lists, "srcs": [_sig(t) for t in srcs], "dsts": [_sig(t) for t in dsts]}
    _run(ctx, cop, sig, (srcs, dsts), execute, n, _nbytes(srcs), srcs, dsts)
    return NkiInstruction(cop, name)


# ---- variable-length collectives (metadata tensor) -----------------------------------------------------------------

class _Prepared:
    def __init__(self, op, site, args, meta_values):
        self.op, self.site, self.args, self.meta_values = op, site, args, meta_values
        self.triggered = False


def _metadata(op, meta, n, has_rdispls):
    """uint32, (rows, n) on HBM or (1, rows, n) on SBUF; rows = 3, or 4 with has_rdispls (row 3 may be present)."""
    if not isinstance(meta, NkiTensor):
        _fail(op, f"metadata_tensor must be an NkiTensor, got {type(meta).__name__}")
    if meta.dtype is not dt.uint32:
        _fail(op, f"metadata_tensor is {meta.dtype.name}; it must be uint32")
    rows_ok = (4,) if has_rdispls else (3, 4)
    if meta.buffer is sbuf:
        ok = meta.ndim == 3 and meta.shape[0] == 1 and meta.shape[1] in rows_ok and meta.shape[2] == n
        want = f"(1, {'4' if has_rdispls else '3'}, {n})"
    elif meta.buffer.is_hbm:
        ok = meta.ndim == 2 and meta.shape[0] in rows_ok and meta.shape[1] == n
        want = f"({'4' if has_rdispls else '3'}, {n})"
    else:
        _fail(op, f"metadata_tensor is in {meta.buffer.name}; it must be on HBM or SBUF")
    if not ok:
        _fail(op, f"metadata_tensor has shape {meta.shape}; with has_rdispls={has_rdispls} and a rank-list of {n} "
                  f"it must be {want} on {'SBUF' if meta.buffer is sbuf else 'HBM'}")
    return _vals(meta, op).reshape(-1, n).astype(np.int64)


def _check_v(op, srcs, dsts, replica_group, metadata_tensor, recv_counts_known, has_rdispls, priority, ctx):
    world = _world(ctx)
    srcs = _tensor_list(op, "srcs", srcs, exactly_one=True)
    dsts = _tensor_list(op, "dsts", dsts, exactly_one=True)
    _memory(op, srcs, dsts, ctx, sbuf_ok=False)       # srcs / dsts must be HBM-backed
    _priority(op, priority, ctx)
    rg = _group(op, replica_group, world)
    _same_dtype(op, "srcs[0]", srcs[0], "dsts[0]", dsts[0])
    for flag, v in (("recv_counts_known", recv_counts_known), ("has_rdispls", has_rdispls)):
        if not isinstance(v, (bool, np.bool_)):
            _fail(op, f"{flag}={v!r} must be a bool")
    n = _rank_list_size(rg, ctx.rank)
    meta = _metadata(op, metadata_tensor, n, bool(has_rdispls))
    return srcs[0], dsts[0], rg, n, meta


def _v_signature(src, dst, rg, recv_counts_known, has_rdispls):
    return {"group": rg.rank_lists, "src": _sig(src), "dst": _sig(dst), "recv_counts_known": bool(recv_counts_known),
            "has_rdispls": bool(has_rdispls)}


def _copy_of(copies, t, op):
    """A NumPy copy of `t`'s values, read once per collective execution (`copies`: tensor id -> (t, values))."""
    got = copies.get(id(t))
    if got is None:
        got = copies[id(t)] = (t, _vals(t, op))
    return got[1]


def _a2av_route(op, g, p, q, ssrc, meta_p, meta_q, rdispls, slot, n):
    """all_to_all_v: rank p sends send_counts[q] elements from send_displs[q] to rank q, at recv_displs[p] with
    has_rdispls, else at p's equally-spaced slot."""
    count, displ = int(meta_p[0, q]), int(meta_p[1, q])
    if displ < 0 or displ + count > ssrc.size:
        raise NkiValidationError(
            f"{op}: rank {g[p]} sends {count} elements from offset {displ} to rank {g[q]} but its src "
            f"'{ssrc.name}' has {ssrc.size} (send_counts / send_displs rows of the metadata)")
    if rdispls:
        return count, displ, int(meta_q[3, p])
    if count > slot:
        raise NkiValidationError(
            f"{op}: rank {g[p]} sends {count} elements to rank {g[q]}, more than its equally-spaced slot "
            f"of {slot} = dst elements / {n} (pass has_rdispls=True with recv displacements)")
    return count, displ, slot * p


def _agv_route(op, g, p, q, ssrc, meta_p, meta_q, rdispls, slot, n):
    """all_gather_v: rank p broadcasts its send_count elements from send_displ (rows 0/1: only the first column is
    read) into slot p of every rank."""
    count, displ = int(meta_p[0, 0]), int(meta_p[1, 0])
    if displ < 0 or displ + count > ssrc.size:
        raise NkiValidationError(
            f"{op}: rank {g[p]} broadcasts {count} elements from offset {displ} but its src "
            f"'{ssrc.name}' has {ssrc.size} (send_count / send_displ of the metadata)")
    if count > slot:
        raise NkiValidationError(f"{op}: rank {g[p]} broadcasts {count} elements, more than the slot of "
                                 f"{slot} = dst elements / {n}")
    return count, displ, slot * p


def _v_execute(op, rg, records, pending, route):
    """Data movement of the *_v collectives: for every sender p and receiver q of a rank-list, `route` reads the
    metadata into (count, displ, offset) (checked at execution time) and src[displ:+count] lands at dst[offset:];
    row 2 of the receiver's metadata gets the count unless recv_counts_known."""
    srcs, dsts, metas = {}, {}, {}      # each tensor read once; the dsts' and metadata's copies are written back
    for _, g, recs in _by_list(records, rg):
        n = len(recs)
        for q, recv in enumerate(recs):
            _, dst, meta_t, known, rdispls, meta_q = recv.payload
            slot = dst.size // n
            for p, send in enumerate(recs):
                ssrc, meta_p = send.payload[0], send.payload[5]
                count, displ, offset = route(op, g, p, q, ssrc, meta_p, meta_q, rdispls, slot, n)
                if offset < 0 or offset + count > dst.size:
                    raise NkiValidationError(
                        f"{op}: rank {g[p]} -> rank {g[q]}: chunk of {count} elements at offset {offset} overflows "
                        f"dst '{dst.name}' of {dst.size} elements (metadata validated at execution time)")
                chunk = _copy_of(srcs, ssrc, op).reshape(-1)[displ:displ + count]
                _copy_of(dsts, dst, op).reshape(-1)[offset:offset + count] = chunk
                if not known:
                    _copy_of(metas, meta_t, op).reshape(-1, n)[2, p] = count
    pending.extend(dsts.values())
    pending.extend(metas.values())


def _v_collective(kind, ctx, args, meta_values, prepared_at=None):
    src, dst, rg, n, metadata_tensor, known, rdispls = args
    sig = _v_signature(src, dst, rg, known, rdispls)
    payload = (src, dst, metadata_tensor, bool(known), bool(rdispls), meta_values)
    route = _a2av_route if kind == "all_to_all_v" else _agv_route

    def execute(recs, pend):
        _v_execute(kind, rg, recs, pend, route)

    writes = (dst,) if known else (dst, metadata_tensor)
    _run(ctx, kind, sig, payload, execute, n, src.size * src.dtype.itemsize, (src, metadata_tensor), writes,
         split=prepared_at is not None)


def _v_call(op, check, srcs, dsts, replica_group, metadata_tensor, recv_counts_known, has_rdispls, priority, name):
    """An unsplit *_v collective: check (the op's own limits included), then run at once."""
    ctx = current()
    args, meta = check(op, ctx, srcs, dsts, replica_group, metadata_tensor, recv_counts_known, has_rdispls, priority)
    _v_collective(op, ctx, args, meta)
    return NkiInstruction(op, name)


def all_to_all_v(srcs, dsts, replica_group, metadata_tensor, recv_counts_known=False, has_rdispls=False,
                 priority=None, name=None):
    """All-to-all of per-destination element counts given at execution time by a uint32 metadata tensor: rows
    send_counts, send_displs, recv_counts (written unless recv_counts_known), recv_displs (with has_rdispls)."""
    return _v_call("all_to_all_v", _check_a2av, srcs, dsts, replica_group, metadata_tensor, recv_counts_known,
                   has_rdispls, priority, name)


def _check_a2av(op, ctx, srcs, dsts, replica_group, metadata_tensor, recv_counts_known, has_rdispls, priority):
    src, dst, rg, n, meta = _check_v(op, srcs, dsts, replica_group, metadata_tensor, recv_counts_known,
                                     has_rdispls, priority, ctx)
    if has_rdispls and ctx.target.nc_version < 4:
        # NKI 0.7 page: off NeuronSwitch (trn3), has_rdispls=True only for inter-node replica groups (each rank-list
        # holds same-indexed ranks of different nodes)
        per_node = _ranks_per_node(ctx)
        for g in rg.rank_lists:
            if len({r // per_node for r in g}) != len(g) or len({r % per_node for r in g}) != 1:
                _fail(op, f"has_rdispls=True on {ctx.target.name} is currently only supported on inter-node replica "
                          f"groups: rank-list {g} must hold same-indexed ranks of different nodes ({per_node} ranks "
                          f"per node at LNC={ctx.num_programs})")
    return (src, dst, rg, n, metadata_tensor, recv_counts_known, has_rdispls), meta


def _check_agv(op, ctx, srcs, dsts, replica_group, metadata_tensor, recv_counts_known, has_rdispls, priority):
    # Current limitations of all_gather_v [SDK stub all_gather_v]
    if ctx.num_programs != 2:
        _fail(op, f"only LNC=2 is supported (this launch has LNC={ctx.num_programs})")
    if has_rdispls:
        _fail(op, "has_rdispls=True is not supported")
    src, dst, rg, n, meta = _check_v(op, srcs, dsts, replica_group, metadata_tensor, recv_counts_known,
                                     has_rdispls, priority, ctx)
    for g in rg.rank_lists:
        if len(g) != 4:
            _fail(op, f"rank-list {g} has {len(g)} ranks; each rank-list must have exactly 4 ranks (intra-chip)")
    return (src, dst, rg, n, metadata_tensor, recv_counts_known, has_rdispls), meta


def all_gather_v(srcs, dsts, replica_group, metadata_tensor, recv_counts_known=False, has_rdispls=False,
                 priority=None, name=None):
    """Each rank broadcasts src[send_displ : send_displ + send_count] (metadata rows 0/1, first column) into slot s
    of every rank's dst (slot = dst elements / rank-list size); row 2 receives the per-sender counts."""
    return _v_call("all_gather_v", _check_agv, srcs, dsts, replica_group, metadata_tensor, recv_counts_known,
                   has_rdispls, priority, name)


def _prepare(op, kind, check, ctx, srcs, dsts, replica_group, metadata_tensor, recv_counts_known, has_rdispls,
             priority, name):
    pending = ctx.cc_prepared
    if pending is not None:
        _fail(op, f"a {pending.op} (at {pending.site}) is still waiting for its trigger; prepares share a single "
                  "slot, so an intervening prepare of any kind is rejected")
    args, meta = check(op, ctx, srcs, dsts, replica_group, metadata_tensor, recv_counts_known, has_rdispls,
                       priority)
    # prepare reads metadata_tensor now (it must already hold valid data); srcs / dsts are read by the trigger
    prep = _Prepared(op, call_site(), args, meta)
    ctx.cc_prepared = prep
    ctx.emit(op, "cc", (metadata_tensor,), (), collective=op, ranks=args[3], nbytes=0, lnc=ctx.num_programs,
             setup=True)
    return NkiInstruction(op, name, prepared=(kind, prep))


def _trigger(op, kind, ctx, prepare_instr):
    prepared = getattr(prepare_instr, "_prepared", None)
    if not isinstance(prepare_instr, NkiInstruction) or prepared is None or prepared[0] != kind:
        _fail(op, f"prepare_instr must be the NkiInstruction returned by {kind}_prepare, got {prepare_instr!r}")
    prep = prepared[1]
    if prep.triggered:
        _fail(op, f"the {kind}_prepare at {prep.site} was already triggered; each prepare is followed by exactly "
                  "one trigger")
    if ctx.cc_prepared is not prep:
        _fail(op, f"the {kind}_prepare at {prep.site} is not the pending prepare of this core")
    prep.triggered = True
    ctx.cc_prepared = None
    _v_collective(kind, ctx, prep.args, prep.meta_values, prepared_at=prep.site)


def all_to_all_v_prepare(srcs, dsts, replica_group, metadata_tensor, recv_counts_known=False, has_rdispls=False,
                         priority=None, name=None):
    """First half of a split all_to_all_v: reads the metadata now; returns the instruction for the trigger."""
    ctx = current()
    return _prepare("all_to_all_v_prepare", "all_to_all_v", _check_a2av, ctx, srcs, dsts, replica_group,
                    metadata_tensor, recv_counts_known, has_rdispls, priority, name)


def all_to_all_v_trigger(prepare_instr, name=None):
    """Second half: moves the data with the operands and metadata captured by the paired prepare."""
    _trigger("all_to_all_v_trigger", "all_to_all_v", current(), prepare_instr)
    return NkiInstruction("all_to_all_v_trigger", name)


def all_gather_v_prepare(srcs, dsts, replica_group, metadata_tensor, recv_counts_known=False, has_rdispls=False,
                         priority=None, name=None):
    """First half of a split all_gather_v (see all_to_all_v_prepare)."""
    ctx = current()
    return _prepare("all_gather_v_prepare", "all_gather_v", _check_agv, ctx, srcs, dsts, replica_group,
                    metadata_tensor, recv_counts_known, has_rdispls, priority, name)


def all_gather_v_trigger(prepare_instr, name=None):
    """Second half of a split all_gather_v."""
    _trigger("all_gather_v_trigger", "all_gather_v", current(), prepare_instr)
    return NkiInstruction("all_gather_v_trigger", name)


# ---- point to point: collective_permute and the implicit ring ------------------------------------------------------

def collective_permute(srcs, dsts, source_target_pairs, priority=None, name=None):
    """For every (source, target) pair, dst of rank `target` receives src of rank `source`; other dsts unchanged."""
    cop = "collective_permute"
    ctx = current()
    world = _world(ctx)
    srcs = _tensor_list(cop, "srcs", srcs, exactly_one=True)
    dsts = _tensor_list(cop, "dsts", dsts, exactly_one=True)
    _memory(cop, srcs, dsts, ctx, sbuf_ok=False)     # HBM only [SDK stub collective_permute]
    _priority(cop, priority, ctx)
    _same_dtype(cop, "srcs[0]", srcs[0], "dsts[0]", dsts[0])
    if srcs[0].size != dsts[0].size:
        _fail(cop, f"srcs[0] has {srcs[0].size} elements but dsts[0] has {dsts[0].size}")
    try:
        pairs = [(int(s), int(t)) for s, t in source_target_pairs]
    except (TypeError, ValueError):
        _fail(cop, f"source_target_pairs={source_target_pairs!r} must be a list of (source, target) rank pairs")
    targets = set()
    for s, t in pairs:
        for r in (s, t):
            if not 0 <= r < world.size:
                _fail(cop, f"pair ({s}, {t}): rank {r} is outside the launch's {world.size} ranks")
        if t in targets:
            _fail(cop, f"rank {t} is the target of more than one pair; each rank receives from at most one source")
        targets.add(t)

    def execute(records, pending):
        for c in sorted({c for _, c in records}):
            for s, t in pairs:
                pending.append((records[(t, c)].payload[1], _vals(records[(s, c)].payload[0], cop)))

    sig = {"pairs": pairs, "src": _sig(srcs[0]), "dst": _sig(dsts[0])}
    _run(ctx, cop, sig, (srcs[0], dsts[0]), execute, 2, _nbytes(srcs), srcs, dsts)
    return NkiInstruction(cop, name)


def _channels(op, srcs_by_channel, dsts_by_channel, channel_ids, rg, ctx, extra=()):
    lists = [("srcs_by_channel", srcs_by_channel), ("dsts_by_channel", dsts_by_channel)] + list(extra)
    for what, xs in lists:
        if not isinstance(xs, (list, tuple)) or not xs:
            _fail(op, f"{what} must be a non-empty list (one inner list per channel)")
    try:
        ids = [int(c) for c in channel_ids]
    except (TypeError, ValueError):
        _fail(op, f"channel_ids={channel_ids!r} must be a list of ints")
    if ids != list(range(len(ids))):
        _fail(op, f"channel_ids={ids} must currently be consecutive integers starting from 0")
    for what, xs in lists:
        if len(xs) != len(ids):
            _fail(op, f"{what} has {len(xs)} channels but channel_ids has {len(ids)}")
    limit = _max_channels(rg, ctx)
    if len(ids) > limit:
        _fail(op, f"{len(ids)} channels requested; the maximum is 4 for replica groups containing all devices "
                  f"inside a node and 2 for other replica groups (this group: {limit})")
    return [[_tensor_list(op, f"{what}[{c}]", xs[c], exactly_one=True)[0] for c in range(len(ids))]
            for what, xs in lists]


def _ranks_per_node(ctx):
    """Ranks of one node (instance): chips x cores per chip / LNC (nkisim.hardware); ranks are numbered node-major."""
    from .hardware import hardware
    hw = hardware(ctx.target.name)
    chips = hw.instance.chips if hw.instance is not None else 1
    return max(1, chips * hw.chip.cores // max(ctx.num_programs, 1))


def _max_channels(rg, ctx):
    """4 when a rank-list spans every device of a node, else 2."""
    g = rg.rank_list_of(ctx.rank) or []
    return _MAX_CHANNELS_NODE if len(g) >= _ranks_per_node(ctx) else _MAX_CHANNELS_OTHER


def _ring(ctx, op, rg, reduce_name, channels, priority, name):
    """The ring step of both implicit permutes; `rg` and `channels` already checked by the caller."""
    _priority(op, priority, ctx)
    srcs, dsts = channels[0], channels[-1]
    srcs1 = channels[1] if reduce_name else None
    _memory(op, srcs + (srcs1 or []), dsts, ctx, coalesced=False)
    for c, (s, d) in enumerate(zip(srcs, dsts)):
        _same_dtype(op, f"srcs[{c}]", s, f"dsts[{c}]", d)
        if s.size != d.size:
            _fail(op, f"channel {c}: src has {s.size} elements but dst has {d.size}")
        if srcs1 is not None and srcs1[c].size != s.size:
            _fail(op, f"channel {c}: srcs1 has {srcs1[c].size} elements but srcs0 has {s.size}")

    def execute(records, pending):
        for _, _, recs in _by_list(records, rg):
            n = len(recs)
            for p, rec in enumerate(recs):
                succ = recs[(p + 1) % n]
                for ch in range(len(srcs)):
                    if reduce_name:
                        a, b = rec.payload[0][ch], rec.payload[1][ch]
                        v = _reduce(reduce_name, [_acc(_vals(a, op), a.dtype), _acc(_vals(b, op), b.dtype)])
                    else:
                        v = _vals(rec.payload[0][ch], op)
                    pending.append((succ.payload[-1][ch], v))

    payload = (srcs, srcs1, dsts) if reduce_name else (srcs, dsts)
    sig = {"group": rg.rank_lists, "channels": len(srcs), "op": reduce_name,
           "srcs": [_sig(t) for t in srcs], "dsts": [_sig(t) for t in dsts]}
    reads = tuple(srcs) + tuple(srcs1 or ())
    _run(ctx, op, sig, payload, execute, _rank_list_size(rg, ctx.rank), _nbytes(srcs), reads, dsts,
         channels=len(srcs), reduce=reduce_name or "")
    return NkiInstruction(op, name)


def collective_permute_implicit(srcs_by_channel, dsts_by_channel, replica_group, channel_ids=(0,), priority=None,
                                name=None):
    """Ring step: each rank sends srcs_by_channel[c][0] to its successor in its rank-list and receives its
    predecessor's into dsts_by_channel[c][0]."""
    op = "collective_permute_implicit"
    ctx = current()
    rg = _group(op, replica_group, _world(ctx))
    channels = _channels(op, srcs_by_channel, dsts_by_channel, channel_ids, rg, ctx)
    return _ring(ctx, op, rg, None, channels, priority, name)


def collective_permute_implicit_reduce(srcs0_by_channel, srcs1_by_channel, dsts_by_channel, replica_group, op,
                                       channel_ids=(0,), priority=None, name=None):
    """Ring step with reduction: each rank sends op(srcs0[c], srcs1[c]) to its successor; dsts receive the
    predecessor's reduced result."""
    cop = "collective_permute_implicit_reduce"
    ctx = current()
    rg = _group(cop, replica_group, _world(ctx))
    rname = _reduce_op(cop, op)
    s0, d, s1 = _channels(cop, srcs0_by_channel, dsts_by_channel, channel_ids, rg, ctx,
                          extra=[("srcs1_by_channel", srcs1_by_channel)])
    return _ring(ctx, cop, rg, rname, [s0, s1, d], priority, name)


def _scalar_int(op, what, v):
    if isinstance(v, VirtualRegister):
        return v.value
    try:
        return int(v)
    except (TypeError, ValueError):
        _fail(op, f"{what}={v!r} must be an int")


def _register(ctx, op, value, name, reads=()):
    reg = VirtualRegister(value, name=name)
    reg.writer = ctx.seq
    ctx.emit(op, "sync", tuple(r for r in reads if isinstance(r, VirtualRegister)), (reg,))
    return reg


def collective_permute_implicit_current_processing_rank_id(iteration_id, replica_group, channel_id=0, name=None):
    """Register holding the rank whose data a ring iteration processes: the own rank at iteration 0, then the
    predecessors' (rank-list[(position - iteration_id) mod size]), consistent with collective_permute_implicit."""
    op = "collective_permute_implicit_current_processing_rank_id"
    ctx = current()
    rg = _group(op, replica_group, _world(ctx))
    it = _scalar_int(op, "iteration_id", iteration_id)
    ch = _scalar_int(op, "channel_id", channel_id)
    if not 0 <= ch < _max_channels(rg, ctx):
        _fail(op, f"channel_id={ch} must be in 0..{_max_channels(rg, ctx) - 1} (0 to num_channels-1)")
    g = rg.rank_list_of(ctx.rank)
    if g is None:
        _fail(op, f"rank {ctx.rank} is in no rank-list of {rg}")
    # a register iteration (a loop's NkiScalar) is read: the result depends on its last writer
    return _register(ctx, op, g[(g.index(ctx.rank) - it) % len(g)], name, reads=(iteration_id,))


def rank_id(name=None):
    """Register holding this rank's id in the launch (a VirtualRegister, as NKI 0.7 documents)."""
    ctx = current()
    _world(ctx)
    return _register(ctx, "rank_id", ctx.rank, name)
