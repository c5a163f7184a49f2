"""nki.collectives across the ranks of a multi-rank launch (nkisim.world): exact vs NumPy at 2/4/8/16 ranks,
documented constraints (negative + positive twin), dead / diverging ranks reported without a hang, kernels mixing
compute with collectives, and the cost-model instruction."""

import time

import ml_dtypes
import numpy as np
import pytest

import nkisim
from nkisim.cost import analyze

nkisim.install()
import nki  # noqa: E402
import nki.collectives as ncc  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402
from nki.collectives import ReplicaGroup  # noqa: E402

RANKS = (2, 4, 8, 16)
F32 = np.float32


@pytest.fixture(autouse=True)
def _short_timeout(monkeypatch):
    # the last-resort timeout of a rendezvous; every failure mode tested here is detected long before it
    monkeypatch.setenv("NKISIM_COLLECTIVE_TIMEOUT_S", "30")


def rand(rng, shape, dtype=F32):
    return rng.standard_normal(shape).astype(dtype)


def groups(n):
    """Two strided rank-lists from 4 ranks on (exercises rank-list order != rank order), else one."""
    return ReplicaGroup.from_partition_op(n, ncc.rg_partition_op.mod, 2) if n >= 4 else ReplicaGroup([[0, 1]])


def launch(kernel, n, inputs, **kw):
    return nkisim.run_ranks(kernel, n, inputs, **kw).outputs


def _private(shape, dtype):
    return nl.ndarray(shape, dtype=dtype, buffer=nl.private_hbm)


def _out(t):
    out = nl.ndarray(t.shape, dtype=t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def _stage_v(x, meta, src, dst, md):
    """Operands of a *_v collective: x and the metadata loaded; dst zeroed, as the collective writes only the slots
    the metadata routes data to."""
    nisa.dma_copy(dst=src, src=x)
    nisa.dma_copy(dst=md, src=meta)
    zero = nl.ndarray(dst.shape, dtype=dst.dtype, buffer=nl.sbuf)
    nisa.memset(dst=zero, value=0.0)
    nisa.dma_copy(dst=dst, src=zero)


# ---- kernels (NKI 0.7: explicit dst, outputs in shared_hbm; collective operands in private HBM or SBUF) ------------

@nki.jit
def k_all_reduce(x, rg, op):
    src, dst = _private(x.shape, x.dtype), _private(x.shape, x.dtype)
    nisa.dma_copy(dst=src, src=x)
    ncc.all_reduce(srcs=[src], dsts=[dst], replica_group=rg, op=op)
    return _out(dst)


@nki.jit
def k_all_reduce_coalesced(x, y, rg):
    sx, sy = _private(x.shape, x.dtype), _private(y.shape, y.dtype)
    dx, dy = _private(x.shape, x.dtype), _private(y.shape, y.dtype)
    nisa.dma_copy(dst=sx, src=x)
    nisa.dma_copy(dst=sy, src=y)
    ncc.all_reduce(srcs=[sx, sy], dsts=[dx, dy], replica_group=rg, op=nl.add)
    return _out(dx), _out(dy)


@nki.jit
def k_all_gather(x, rg, n):
    src = _private(x.shape, x.dtype)
    dst = _private((x.shape[0] * n, x.shape[1]), x.dtype)
    nisa.dma_copy(dst=src, src=x)
    ncc.all_gather(srcs=[src], dsts=[dst], replica_group=rg, collective_dim=0)
    return _out(dst)


@nki.jit
def k_all_gather_sbuf(x, rg, n, dim):
    p, f = x.shape
    src = nl.ndarray((p, f), dtype=x.dtype, buffer=nl.sbuf)
    dst = nl.ndarray((p * n, f) if dim == 0 else (p, f * n), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=src, src=x)
    ncc.all_gather(srcs=[src], dsts=[dst], replica_group=rg, collective_dim=dim)
    return _out(dst)


@nki.jit
def k_reduce_scatter(x, rg, n):
    src = _private(x.shape, x.dtype)
    dst = _private((x.shape[0] // n, x.shape[1]), x.dtype)
    nisa.dma_copy(dst=src, src=x)
    ncc.reduce_scatter(srcs=[src], dsts=[dst], replica_group=rg, collective_dim=0, op=nl.add)
    return _out(dst)


@nki.jit
def k_all_to_all(x, rg):
    src, dst = _private(x.shape, x.dtype), _private(x.shape, x.dtype)
    nisa.dma_copy(dst=src, src=x)
    ncc.all_to_all(srcs=[src], dsts=[dst], replica_group=rg, collective_dim=0)
    return _out(dst)


@nki.jit
def k_all_to_all_v(x, meta, rg, split, has_rdispls):
    src = _private(x.shape, x.dtype)
    dst = _private(x.shape, x.dtype)
    md = _private(meta.shape, meta.dtype)
    _stage_v(x, meta, src, dst, md)
    if split:
        prep = ncc.all_to_all_v_prepare(srcs=[src], dsts=[dst], replica_group=rg, metadata_tensor=md,
                                        has_rdispls=has_rdispls)
        ncc.all_to_all_v_trigger(prep)
    else:
        ncc.all_to_all_v(srcs=[src], dsts=[dst], replica_group=rg, metadata_tensor=md, has_rdispls=has_rdispls)
    return _out(dst), _out(md)


@nki.jit
def k_all_gather_v(x, meta, rg, split):
    src = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    dst = nl.ndarray((4 * x.shape[0], x.shape[1]), dtype=x.dtype, buffer=nl.shared_hbm)
    md = nl.ndarray(meta.shape, dtype=meta.dtype, buffer=nl.shared_hbm)
    _stage_v(x, meta, src, dst, md)
    if split:
        ncc.all_gather_v_trigger(ncc.all_gather_v_prepare(srcs=[src], dsts=[dst], replica_group=rg,
                                                          metadata_tensor=md))
    else:
        ncc.all_gather_v(srcs=[src], dsts=[dst], replica_group=rg, metadata_tensor=md)
    return _out(dst), _out(md)


@nki.jit
def k_permute(x, pairs):
    src, dst = _private(x.shape, x.dtype), _private(x.shape, x.dtype)
    nisa.dma_copy(dst=src, src=x)
    nisa.dma_copy(dst=dst, src=x)       # ranks that are no target keep their own data
    ncc.collective_permute(srcs=[src], dsts=[dst], source_target_pairs=pairs)
    return _out(dst)


@nki.jit
def k_ring_all_gather(x, rg, n):
    """All-gather by n-1 implicit ring permutes; each received chunk is placed at the row block of the rank
    collective_permute_implicit_current_processing_rank_id names (a register used as a dynamic offset)."""
    m, f = x.shape
    bufs = [_private((m, f), x.dtype), _private((m, f), x.dtype)]
    out = nl.ndarray((n, m, f), dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=bufs[0], src=x)
    for it in range(n):
        who = ncc.collective_permute_implicit_current_processing_rank_id(iteration_id=it, replica_group=rg)
        nisa.dma_copy(dst=out.ap(pattern=[[f, m], [1, f]], scalar_offset=who, indirect_dim=0), src=bufs[it % 2])
        if it < n - 1:
            ncc.collective_permute_implicit(srcs_by_channel=[[bufs[it % 2]]], dsts_by_channel=[[bufs[1 - it % 2]]],
                                            replica_group=rg)
    return out


@nki.jit
def k_ring_reduce(a, b, rg, channels):
    srcs0, srcs1, dsts = [], [], []
    for _ in range(channels):
        s0, s1, d = _private(a.shape, a.dtype), _private(a.shape, a.dtype), _private(a.shape, a.dtype)
        nisa.dma_copy(dst=s0, src=a)
        nisa.dma_copy(dst=s1, src=b)
        srcs0.append([s0])
        srcs1.append([s1])
        dsts.append([d])
    ncc.collective_permute_implicit_reduce(srcs0_by_channel=srcs0, srcs1_by_channel=srcs1, dsts_by_channel=dsts,
                                           replica_group=rg, op=nl.maximum, channel_ids=list(range(channels)))
    return _out(dsts[-1][0])


@nki.jit
def k_rank_id(table):
    _, h, w = table.shape
    out = nl.ndarray((h, w), dtype=table.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=table.ap(pattern=[[w, h], [1, w]], scalar_offset=ncc.rank_id(), indirect_dim=0))
    return out


def seq_reduce(arrays, fn=np.add):
    acc = arrays[0].astype(F32)
    for a in arrays[1:]:
        acc = fn(acc, a.astype(F32))
    return acc


# ---- every collective at 2, 4, 8, 16 ranks, exact ------------------------------------------------------------------

@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("op,fn", [(nl.add, np.add), (nl.maximum, np.maximum), (nl.minimum, np.minimum)],
                         ids=["add", "max", "min"])
def test_all_reduce_exact(n, op, fn):
    rng = np.random.default_rng(n)
    xs = [rand(rng, (4, 8)) for _ in range(n)]
    rg = groups(n)
    outs = launch(k_all_reduce, n, lambda r: {"x": xs[r], "rg": rg, "op": op})
    for r in range(n):
        g = rg.rank_list_of(r)
        np.testing.assert_array_equal(outs[r], seq_reduce([xs[q] for q in g], fn))


def test_all_reduce_bf16_rounds_once_and_int_exact():
    rng = np.random.default_rng(0)
    xs = [rand(rng, (4, 8), ml_dtypes.bfloat16) for _ in range(4)]
    outs = launch(k_all_reduce, 4, lambda r: {"x": xs[r], "rg": ReplicaGroup([[0, 1, 2, 3]]), "op": nl.add})
    ref = seq_reduce(xs).astype(ml_dtypes.bfloat16)
    for o in outs:
        np.testing.assert_array_equal(o.view(np.uint16), ref.view(np.uint16))
    ints = [rng.integers(-1000, 1000, (4, 8)).astype(np.int32) for _ in range(4)]
    outs = launch(k_all_reduce, 4, lambda r: {"x": ints[r], "rg": ReplicaGroup([[0, 1, 2, 3]]), "op": nl.add})
    assert outs[2].dtype == np.int32
    np.testing.assert_array_equal(outs[2], sum(ints))


def test_all_reduce_coalesced_hbm():
    rng = np.random.default_rng(1)
    xs, ys = [rand(rng, (2, 4)) for _ in range(4)], [rand(rng, (3, 5)) for _ in range(4)]
    outs = launch(k_all_reduce_coalesced, 4, lambda r: {"x": xs[r], "y": ys[r], "rg": ReplicaGroup([[0, 1, 2, 3]])})
    np.testing.assert_array_equal(outs[1][0], seq_reduce(xs))
    np.testing.assert_array_equal(outs[1][1], seq_reduce(ys))


@pytest.mark.parametrize("n", RANKS)
def test_all_gather_exact(n):
    rng = np.random.default_rng(n)
    xs = [rand(rng, (2, 8)) for _ in range(n)]
    rg = groups(n)
    outs = launch(k_all_gather, n, lambda r: {"x": xs[r], "rg": rg, "n": len(rg.rank_list_of(r))})
    for r in range(n):
        np.testing.assert_array_equal(outs[r], np.concatenate([xs[q] for q in rg.rank_list_of(r)], axis=0))


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("dim", [0, 1])
def test_all_gather_sbuf_exact(n, dim):
    rng = np.random.default_rng(n)
    xs = [rand(rng, (4, 6)) for _ in range(n)]
    rg = ReplicaGroup([list(range(n))])
    outs = launch(k_all_gather_sbuf, n, lambda r: {"x": xs[r], "rg": rg, "n": n, "dim": dim})
    np.testing.assert_array_equal(outs[n - 1], np.concatenate(xs, axis=dim))


@pytest.mark.parametrize("n", RANKS)
def test_reduce_scatter_exact(n):
    rng = np.random.default_rng(n)
    rg = groups(n)
    m = len(rg.rank_lists[0])
    xs = [rand(rng, (2 * m, 4)) for _ in range(n)]
    outs = launch(k_reduce_scatter, n, lambda r: {"x": xs[r], "rg": rg, "n": m})
    for r in range(n):
        g = rg.rank_list_of(r)
        p = g.index(r)
        np.testing.assert_array_equal(outs[r], seq_reduce([xs[q] for q in g])[2 * p:2 * p + 2])


@pytest.mark.parametrize("n", RANKS)
def test_all_to_all_exact(n):
    rng = np.random.default_rng(n)
    rg = groups(n)
    m = len(rg.rank_lists[0])
    xs = [rand(rng, (m, 3)) for _ in range(n)]
    outs = launch(k_all_to_all, n, lambda r: {"x": xs[r], "rg": rg})
    for r in range(n):
        g = rg.rank_list_of(r)
        p = g.index(r)
        np.testing.assert_array_equal(outs[r], np.stack([xs[q][p] for q in g]))


def _a2av_case(n, rng, slot, rdispls=False):
    """Random per-destination counts (<= slot) and displacements; returns xs, metas and the NumPy reference."""
    size = n * slot
    counts = rng.integers(0, slot + 1, (n, n))          # counts[p, q]: rank p sends to rank q
    xs = [rand(rng, (n, slot)) for _ in range(n)]
    metas, refs = [], [np.zeros(size, F32) for _ in range(n)]
    rdisp = [rng.permutation(n) * slot for _ in range(n)] if rdispls else None
    for p in range(n):
        sd = rng.integers(0, size - slot + 1, n)       # any send displacement that keeps the chunk inside src
        rows = [counts[p], sd, np.zeros(n, int)] + ([rdisp[p]] if rdispls else [])
        metas.append(np.array(rows, dtype=np.uint32))
    for q in range(n):
        for p in range(n):
            c, d = counts[p, q], metas[p][1, q]
            off = rdisp[q][p] if rdispls else slot * p
            refs[q][off:off + c] = xs[p].reshape(-1)[d:d + c]
    return xs, metas, refs, counts


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("split", [False, True], ids=["plain", "prepare_trigger"])
def test_all_to_all_v_exact(n, split):
    rng = np.random.default_rng(n)
    xs, metas, refs, counts = _a2av_case(n, rng, slot=3)
    rg = ReplicaGroup([list(range(n))])
    outs = launch(k_all_to_all_v, n, lambda r: {"x": xs[r], "meta": metas[r], "rg": rg, "split": split,
                                                "has_rdispls": False})
    for q in range(n):
        np.testing.assert_array_equal(outs[q][0].reshape(-1), refs[q])
        np.testing.assert_array_equal(outs[q][1][2], counts[:, q])       # row 2 written: received counts
        np.testing.assert_array_equal(outs[q][1][:2], metas[q][:2])


def test_all_to_all_v_rdispls_inter_node_on_trn2():
    """Positive twin of the intra-node rejection: ranks 0 and 128 are rank 0 of two trn2.48xlarge nodes at LNC=1
    (16 chips x 8 cores); the 127 other ranks of the 129-rank launch are in no rank-list and move nothing."""
    rng = np.random.default_rng(11)
    xs, metas, refs, _ = _a2av_case(2, rng, slot=2, rdispls=True)
    rg = ReplicaGroup([[0, 128]])
    idle = np.zeros((4, 1), np.uint32)

    def inputs(r):
        i = {0: 0, 128: 1}.get(r)
        return {"x": xs[i] if i is not None else xs[0], "meta": metas[i] if i is not None else idle, "rg": rg,
                "split": False, "has_rdispls": True}

    outs = launch(k_all_to_all_v, 129, inputs, target="trn2")
    np.testing.assert_array_equal(outs[0][0].reshape(-1), refs[0])
    np.testing.assert_array_equal(outs[128][0].reshape(-1), refs[1])
    np.testing.assert_array_equal(outs[5][0], np.zeros_like(xs[0]))


def test_all_to_all_v_rdispls_on_trn3():
    rng = np.random.default_rng(7)
    xs, metas, refs, _ = _a2av_case(4, rng, slot=2, rdispls=True)
    outs = launch(k_all_to_all_v, 4, lambda r: {"x": xs[r], "meta": metas[r], "rg": ReplicaGroup([[0, 1, 2, 3]]),
                                                "split": False, "has_rdispls": True}, target="trn3")
    for q in range(4):
        np.testing.assert_array_equal(outs[q][0].reshape(-1), refs[q])


@pytest.mark.parametrize("n", [4, 8, 16])
@pytest.mark.parametrize("split", [False, True], ids=["plain", "prepare_trigger"])
def test_all_gather_v_exact(n, split):
    rng = np.random.default_rng(n)
    rg = ReplicaGroup.from_partition_op(n, ncc.rg_partition_op.div, 4)
    xs = [rand(rng, (2, 4)) for _ in range(n)]
    counts = rng.integers(0, 9, n)
    displs = [rng.integers(0, 8 - c + 1) for c in counts]
    metas = [np.array([[counts[r]] * 4, [displs[r]] * 4, [0] * 4], dtype=np.uint32) for r in range(n)]
    outs = launch(k_all_gather_v[2], n, lambda r: {"x": xs[r], "meta": metas[r], "rg": rg, "split": split})
    for r in range(n):
        g = rg.rank_list_of(r)
        ref = np.zeros(32, F32)
        for s, q in enumerate(g):
            ref[8 * s:8 * s + counts[q]] = xs[q].reshape(-1)[displs[q]:displs[q] + counts[q]]
        np.testing.assert_array_equal(outs[r][0].reshape(-1), ref)
        np.testing.assert_array_equal(outs[r][1][2], counts[g])


@pytest.mark.parametrize("n", RANKS)
def test_collective_permute_exact(n):
    rng = np.random.default_rng(n)
    xs = [rand(rng, (2, 3)) for _ in range(n)]
    pairs = [(r, (r + 1) % n) for r in range(0, n, 2)]     # even ranks send to the next; even ranks keep theirs
    outs = launch(k_permute, n, lambda r: {"x": xs[r], "pairs": tuple(pairs)})
    for r in range(n):
        np.testing.assert_array_equal(outs[r], xs[r - 1] if r % 2 else xs[r])


@pytest.mark.parametrize("n", RANKS)
def test_ring_all_gather_with_processing_rank_id(n):
    rng = np.random.default_rng(n)
    xs = [rand(rng, (2, 4)) for _ in range(n)]
    rg = ReplicaGroup([list(range(n))])
    outs = launch(k_ring_all_gather, n, lambda r: {"x": xs[r], "rg": rg, "n": n})
    for r in range(n):
        np.testing.assert_array_equal(outs[r], np.stack(xs))


@pytest.mark.parametrize("n", RANKS)
def test_permute_implicit_reduce_exact(n):
    rng = np.random.default_rng(n)
    a, b = [rand(rng, (2, 4)) for _ in range(n)], [rand(rng, (2, 4)) for _ in range(n)]
    rg = groups(n)
    outs = launch(k_ring_reduce, n, lambda r: {"a": a[r], "b": b[r], "rg": rg, "channels": 2})
    for r in range(n):
        g = rg.rank_list_of(r)
        pred = g[(g.index(r) - 1) % len(g)]
        np.testing.assert_array_equal(outs[r], np.maximum(a[pred], b[pred]))


@pytest.mark.parametrize("n", RANKS)
def test_rank_id_selects_per_rank_slice(n):
    table = rand(np.random.default_rng(n), (n, 2, 3))
    outs = launch(k_rank_id, n, lambda r: {"table": table})
    for r in range(n):
        np.testing.assert_array_equal(outs[r], table[r])


def test_simulate_collective_api_and_lnc2_ranks():
    """simulate_collective with per_rank arguments; LNC=2 x 4 ranks (8 threads) gives the same result."""
    rng = np.random.default_rng(3)
    xs = [rand(rng, (4, 8)) for _ in range(4)]
    rg = ReplicaGroup([[0, 1, 2, 3]])
    for kernel in (k_all_reduce, k_all_reduce[2]):
        outs = nkisim.simulate_collective(kernel, 4)(nkisim.per_rank(xs), rg, nl.add)
        assert len(outs) == 4
        for o in outs:
            np.testing.assert_array_equal(o, seq_reduce(xs))


@nki.jit
def k_sbuf_all_reduce_lnc(x, rg):
    """Each core of an LNC=2 rank all-reduces its own SBUF half across ranks (core c with core c)."""
    p, f = x.shape
    half = f // nl.num_programs(axes=0)
    c = nl.program_id(0)
    src = nl.ndarray((p, half), dtype=x.dtype, buffer=nl.sbuf)
    dst = nl.ndarray((p, half), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=src, src=x[:, c * half:(c + 1) * half])
    ncc.all_reduce(srcs=[src], dsts=[dst], replica_group=rg, op=nl.add)
    out = nl.ndarray((p, f), dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[:, c * half:(c + 1) * half], src=dst)
    return out


def test_lnc2_sbuf_collective_pairs_cores_by_index():
    rng = np.random.default_rng(4)
    xs = [rand(rng, (4, 8)) for _ in range(2)]
    outs = launch(k_sbuf_all_reduce_lnc[2], 2, lambda r: {"x": xs[r], "rg": ReplicaGroup([[0, 1]])})
    np.testing.assert_array_equal(outs[0], xs[0] + xs[1])
    np.testing.assert_array_equal(outs[1], xs[0] + xs[1])


def test_single_rank_launch_with_nki_simulate():
    """A plain nki.simulate call is a one-rank world: rank_id 0, an all_reduce over [[0]] copies."""
    table = rand(np.random.default_rng(5), (3, 2, 3))
    np.testing.assert_array_equal(nki.simulate(k_rank_id)(table), table[0])
    x = rand(np.random.default_rng(6), (2, 2))
    np.testing.assert_array_equal(nki.simulate(k_all_reduce)(x, ReplicaGroup([[0]]), nl.add), x)


# ---- kernels mixing compute with collectives -----------------------------------------------------------------------

@nki.jit
def k_row_parallel_matmul(xT, w, rg):
    """y = x @ W with the contraction dim split over ranks: local partial product on TensorE, then all_reduce."""
    k, m = xT.shape
    _, nn = w.shape
    xs = nl.ndarray((k, m), dtype=xT.dtype, buffer=nl.sbuf)
    ws = nl.ndarray((k, nn), dtype=w.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xs, src=xT)
    nisa.dma_copy(dst=ws, src=w)
    acc = nl.ndarray((m, nn), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc, stationary=xs, moving=ws)
    part = nl.ndarray((m, nn), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=part, src=acc)
    partial = _private((m, nn), nl.float32)
    total = _private((m, nn), nl.float32)
    nisa.dma_copy(dst=partial, src=part)
    ncc.all_reduce(srcs=[partial], dsts=[total], replica_group=rg, op=nl.add)
    return _out(total)


@pytest.mark.parametrize("n", RANKS)
def test_row_parallel_matmul_all_reduce(n):
    rng = np.random.default_rng(n)
    kk, m, nn = 4, 8, 16
    # small integers: every product and partial sum is exact in fp32, so any summation order gives the same bits
    x = rng.integers(-3, 4, (m, kk * n)).astype(F32)
    w = rng.integers(-3, 4, (kk * n, nn)).astype(F32)
    rg = ReplicaGroup([list(range(n))])
    outs = launch(k_row_parallel_matmul, n, lambda r: {"xT": np.ascontiguousarray(x[:, r * kk:(r + 1) * kk].T),
                                                       "w": w[r * kk:(r + 1) * kk], "rg": rg})
    for o in outs:
        np.testing.assert_array_equal(o, x @ w)


@nki.jit
def k_head_swap(q, rg, scale):
    """Ulysses-style swap: [heads, seq_local*d] -> all_to_all -> [heads_local x ranks, ...]; compute on both sides."""
    h, f = q.shape
    t = nl.ndarray((h, f), dtype=q.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=q)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=scale)
    src, dst = _private((h, f), q.dtype), _private((h, f), q.dtype)
    nisa.dma_copy(dst=src, src=t)
    ncc.all_to_all(srcs=[src], dsts=[dst], replica_group=rg, collective_dim=0)
    back = nl.ndarray((h, f), dtype=q.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=back, src=dst)
    nisa.activation(dst=back, op=nl.exp, data=back)
    return _out(back)


@pytest.mark.parametrize("n", RANKS)
def test_all_to_all_head_swap(n):
    rng = np.random.default_rng(n)
    hl, s, d = 2, 2, 4                       # heads per rank, sequence per rank, head dim
    qs = [rand(rng, (hl * n, s * d)) for _ in range(n)]      # rank r: all heads, its sequence shard
    rg = ReplicaGroup([list(range(n))])
    outs = launch(k_head_swap, n, lambda r: {"q": qs[r], "rg": rg, "scale": 0.5})
    for r in range(n):
        # rank r receives head block r from every rank: [rank p's seq shard of heads r*hl:(r+1)*hl] stacked by p
        got = np.concatenate([(qs[p] * F32(0.5))[r * hl:(r + 1) * hl] for p in range(n)])
        np.testing.assert_allclose(outs[r], np.exp(got), rtol=1e-6)


# ---- documented constraints: negative and positive twin ------------------------------------------------------------

@nki.jit
def k_configurable(x, what):
    """One collective call whose operands a test picks by name (each negative below has its positive twin)."""
    p, f = x.shape
    rg = ReplicaGroup([[0, 1]])
    hb_src, hb_dst = _private((p, f), x.dtype), _private((p, f), x.dtype)
    sb_src = nl.ndarray((p, f), dtype=x.dtype, buffer=nl.sbuf)
    sb_dst = nl.ndarray((p, f), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=hb_src, src=x)
    nisa.dma_copy(dst=sb_src, src=x)
    if what == "a2a_sbuf":
        ncc.all_to_all(srcs=[sb_src], dsts=[sb_dst], replica_group=rg, collective_dim=0)
    elif what == "a2a_hbm":
        ncc.all_to_all(srcs=[hb_src], dsts=[hb_dst], replica_group=rg, collective_dim=0)
    elif what == "ar_multiply":
        ncc.all_reduce(srcs=[hb_src], dsts=[hb_dst], replica_group=rg, op=nl.multiply)
    elif what == "ar_mixed":
        ncc.all_reduce(srcs=[sb_src], dsts=[hb_dst], replica_group=rg, op=nl.add)
    elif what == "ar_sbuf":
        ncc.all_reduce(srcs=[sb_src], dsts=[sb_dst], replica_group=rg, op=nl.add)
    elif what == "ar_sbuf_coalesced":
        ncc.all_reduce(srcs=[sb_src, sb_src], dsts=[sb_dst, sb_dst], replica_group=rg, op=nl.add)
    elif what == "ar_shared_src":
        sh = nl.ndarray((p, f), dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=sh, src=x)
        ncc.all_reduce(srcs=[sh], dsts=[hb_dst], replica_group=rg, op=nl.add)
    elif what == "ar_shared_dst":
        sh = nl.ndarray((p, f), dtype=x.dtype, buffer=nl.shared_hbm)
        ncc.all_reduce(srcs=[hb_src], dsts=[sh], replica_group=rg, op=nl.add)
        return _out(sh)
    elif what == "ag_hbm_dim1":
        wide = _private((p, 2 * f), x.dtype)
        ncc.all_gather(srcs=[hb_src], dsts=[wide], replica_group=rg, collective_dim=1)
    elif what == "rs_dim1":
        half = _private((p, f // 2), x.dtype)
        ncc.reduce_scatter(srcs=[hb_src], dsts=[half], replica_group=rg, collective_dim=1, op=nl.add)
    elif what == "priority":
        ncc.all_reduce(srcs=[hb_src], dsts=[hb_dst], replica_group=rg, op=nl.add, priority=1)
    elif what == "rank_outside":
        ncc.all_reduce(srcs=[hb_src], dsts=[hb_dst], replica_group=ReplicaGroup([[0, 2]]), op=nl.add)
    elif what == "permute_dup_target":
        ncc.collective_permute(srcs=[hb_src], dsts=[hb_dst], source_target_pairs=[(0, 1), (1, 1)])
    elif what in ("channels_gap", "channels_3", "channels_2"):
        ids = {"channels_gap": [0, 2], "channels_3": [0, 1, 2], "channels_2": [0, 1]}[what]
        bufs = [(_private((p, f), x.dtype), _private((p, f), x.dtype)) for _ in ids]
        for s, _ in bufs:
            nisa.dma_copy(dst=s, src=x)
        ncc.collective_permute_implicit(srcs_by_channel=[[s] for s, _ in bufs], dsts_by_channel=[[d] for _, d in bufs],
                                        replica_group=rg, channel_ids=ids)
        return _out(bufs[-1][1])
    else:
        raise AssertionError(what)
    return _out(hb_dst) if what not in ("a2a_sbuf", "ar_sbuf") else _out(sb_dst)


def run2(what, target=None):
    xs = [np.full((2, 4), r + 1, F32) for r in range(2)]
    return launch(k_configurable, 2, lambda r: {"x": xs[r], "what": what}, target=target)


@pytest.mark.parametrize("bad,good,message", [
    ("a2a_sbuf", "a2a_hbm", "all_to_all: tensors must reside on HBM; SBUF is not currently supported"),
    ("ar_multiply", "ar_sbuf", r"all_reduce: op=nl.multiply is not supported"),
    ("ar_mixed", "ar_sbuf", "all_reduce: tensors can reside on either HBM or SBUF, but not a mix"),
    ("ar_sbuf_coalesced", "ar_sbuf", "only supported when tensors are on HBM"),
    ("ar_shared_src", "ar_sbuf", "with LNC degree 1 the srcs must be on private_hbm"),
    ("ar_shared_dst", "ar_sbuf", "NKI_LNC1_SHARED_HBM=1"),
    ("ag_hbm_dim1", "a2a_hbm", r"all_gather: collective_dim=1: only 0 is supported"),
    ("rs_dim1", "ar_sbuf", r"reduce_scatter: collective_dim=1: only 0 is supported"),
    ("rank_outside", "ar_sbuf", "replica_group rank 2 is outside the launch's 2 ranks"),
    ("permute_dup_target", "a2a_hbm", "rank 1 is the target of more than one pair"),
    ("channels_gap", "channels_2", r"channel_ids=\[0, 2\] must currently be consecutive integers starting from 0"),
    ("channels_3", "channels_2", "3 channels requested; the maximum is 4 .* and 2 for other replica groups"),
])
def test_constraint_negative_and_positive_twin(bad, good, message):
    with pytest.raises(nkisim.NkiValidationError, match=message):
        run2(bad)
    outs = run2(good)
    assert len(outs) == 2 and np.isfinite(outs[0]).all()


def test_priority_is_nc_v4_only(monkeypatch):
    with pytest.raises(nkisim.NkiValidationError, match="all_reduce: priority is NeuronCore-v4\\+ only"):
        run2("priority", target="trn2")
    outs = run2("priority", target="trn3")
    np.testing.assert_array_equal(outs[0], np.full((2, 4), 3, F32))


def test_lnc1_shared_dst_allowed_with_env(monkeypatch):
    monkeypatch.setenv("NKI_LNC1_SHARED_HBM", "1")
    outs = run2("ar_shared_dst")
    np.testing.assert_array_equal(outs[1], np.full((2, 4), 3, F32))


def test_replica_group_checks():
    with pytest.raises(nkisim.NkiValidationError, match="ReplicaGroup: rank 1 appears in more than one rank-list"):
        ReplicaGroup([[0, 1], [1, 2]])
    assert ReplicaGroup([[0, 1], [2, 3]]).rank_lists == [[0, 1], [2, 3]]
    assert ReplicaGroup.from_partition_op(8, ncc.rg_partition_op.bitwise_and, 0).rank_lists == [list(range(8))]
    assert ReplicaGroup.from_partition_op(8, ncc.rg_partition_op.div, 4).rank_lists == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ReplicaGroup.from_partition_op(8, ncc.rg_partition_op.mod, 4).rank_lists == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_all_to_all_v_constraints():
    rng = np.random.default_rng(9)
    xs, metas, _, _ = _a2av_case(2, rng, slot=2, rdispls=True)
    rg = ReplicaGroup([[0, 1]])

    def run(meta_of, **kw):
        args = {"split": False, "has_rdispls": False, **kw}
        return launch(k_all_to_all_v, 2, lambda r: {"x": xs[r], "meta": meta_of(r), "rg": rg, **args})

    with pytest.raises(nkisim.NkiValidationError, match=r"has_rdispls=True on trn2 is currently only supported on "
                                                        r"inter-node replica groups: rank-list \[0, 1\]"):
        run(lambda r: metas[r], has_rdispls=True)
    with pytest.raises(nkisim.NkiValidationError, match="metadata_tensor is int32; it must be uint32"):
        run(lambda r: metas[r].astype(np.int32))
    with pytest.raises(nkisim.NkiValidationError, match=r"metadata_tensor has shape \(2, 2\)"):
        run(lambda r: metas[r][:2])
    big = [m.copy() for m in metas]
    big[1][0, 0], big[1][1, 0] = 3, 0                 # rank 1 sends 3 elements (from offset 0) into a slot of 2
    with pytest.raises(nkisim.NkiValidationError, match="rank 1 sends 3 elements to rank 0, more than its "
                                                        "equally-spaced slot of 2"):
        run(lambda r: big[r])
    outs = run(lambda r: metas[r])                    # positive twin: the same metadata (row 3 ignored)
    assert outs[0][0].shape == xs[0].shape


@nki.jit
def k_prepare_misuse(x, meta, rg, how):
    src, dst, md = _private(x.shape, x.dtype), _private(x.shape, x.dtype), _private(meta.shape, meta.dtype)
    nisa.dma_copy(dst=src, src=x)
    nisa.dma_copy(dst=md, src=meta)
    p = ncc.all_to_all_v_prepare(srcs=[src], dsts=[dst], replica_group=rg, metadata_tensor=md)
    if how == "twice":
        ncc.all_to_all_v_prepare(srcs=[src], dsts=[dst], replica_group=rg, metadata_tensor=md)
    if how != "never":
        ncc.all_to_all_v_trigger(p)
    if how == "retrigger":
        ncc.all_to_all_v_trigger(p)
    return _out(dst)


@pytest.mark.parametrize("how,message", [
    ("twice", "prepares share a single slot, so an intervening prepare of any kind is rejected"),
    ("retrigger", "was already triggered; each prepare is followed by exactly one trigger"),
    ("never", "prepared at .* but never triggered"),
])
def test_prepare_trigger_pairing(how, message):
    rng = np.random.default_rng(2)
    xs, metas, refs, _ = _a2av_case(2, rng, slot=2)
    rg = ReplicaGroup([[0, 1]])
    with pytest.raises(nkisim.NkiValidationError, match=message):
        launch(k_prepare_misuse, 2, lambda r: {"x": xs[r], "meta": metas[r], "rg": rg, "how": how})
    outs = launch(k_prepare_misuse, 2, lambda r: {"x": xs[r], "meta": metas[r], "rg": rg, "how": "once"})
    np.testing.assert_array_equal(outs[0].reshape(-1)[:refs[0].size][refs[0] != 0], refs[0][refs[0] != 0])


def test_all_gather_v_limitations():
    x = np.zeros((2, 4), F32)
    meta = np.array([[1, 1], [0, 0], [0, 0]], dtype=np.uint32)
    with pytest.raises(nkisim.NkiValidationError, match=r"all_gather_v: only LNC=2 is supported"):
        launch(k_all_gather_v, 2, lambda r: {"x": x, "meta": meta, "rg": ReplicaGroup([[0, 1]]), "split": False})
    with pytest.raises(nkisim.NkiValidationError, match=r"rank-list \[0, 1\] has 2 ranks; each rank-list must have "
                                                        "exactly 4 ranks"):
        launch(k_all_gather_v[2], 2, lambda r: {"x": x, "meta": meta, "rg": ReplicaGroup([[0, 1]]), "split": False})


# ---- dead ranks and diverging ranks: a clear error, never a hang ---------------------------------------------------

@nki.jit
def k_faulty(x, rg, role):
    src, dst = _private(x.shape, x.dtype), _private(x.shape, x.dtype)
    nisa.dma_copy(dst=src, src=x)
    if role == "die":
        raise ValueError("boom on this rank")
    if role == "gather":
        wide = _private((len(rg.rank_lists[0]) * x.shape[0], x.shape[1]), x.dtype)
        ncc.all_gather(srcs=[src], dsts=[wide], replica_group=rg, collective_dim=0)
    elif role == "skip":
        pass
    elif role == "shape":
        small = _private((1, x.shape[1]), x.dtype)
        ncc.all_reduce(srcs=[small], dsts=[small], replica_group=rg, op=nl.add)
    else:
        ncc.all_reduce(srcs=[src], dsts=[dst], replica_group=rg, op=nl.add)
    ncc.all_reduce(srcs=[dst], dsts=[src], replica_group=rg, op=nl.add)
    return _out(src)


def _faulty(n, odd_rank, role):
    rg = ReplicaGroup([list(range(n))])
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        launch(k_faulty, n, lambda r: {"x": np.ones((2, 4), F32), "rg": rg,
                                       "role": role if r == odd_rank else "ok"})
    assert time.monotonic() - start < 20, "the failure must be reported promptly, not by a timeout"
    return info


@pytest.mark.parametrize("n", [2, 16])
def test_dead_rank_is_reported_on_all_ranks(n):
    info = _faulty(n, n - 1, "die")
    assert info.type is ValueError and "boom" in str(info.value)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert f"raised on rank {n - 1} core 0 of a {n}-rank launch" in notes
    assert "also stopped: rank 0 core 0" in notes       # the other ranks were released, not left hanging


@pytest.mark.parametrize("role,message", [
    ("gather", r"ranks diverge at the same collective: rank \d+ core 0: all_\w+ at .*test_collectives.py:\d+ vs"),
    ("skip", r"ranks diverge: rank \d+ core 0 waits in collective #1 .* but rank 1 core 0 finished the kernel after 1"),
    ("shape", r"all_reduce: ranks diverge at the same collective: .*srcs \[\(\(2, 4\).* != \[\(\(1, 4\)"),
])
def test_diverging_ranks_are_reported(role, message):
    info = _faulty(4, 1, role)
    assert info.type is nkisim.NkiCollectiveError
    assert len(__import__("re").findall(message, str(info.value))) == 1, str(info.value)


# ---- cost model ---------------------------------------------------------------------------------------------------

def test_collective_instruction_cost_alpha_beta():
    from nkisim.cost.collective import collective_time
    from nkisim.hardware import COLLECTIVE_BUSBW, hardware
    hw = hardware("trn2")
    res = nkisim.run_ranks(k_row_parallel_matmul, 4, lambda r: {"xT": np.ones((4, 8), F32),
                                                                "w": np.ones((4, 16), F32),
                                                                "rg": ReplicaGroup([[0, 1, 2, 3]])})
    rep = analyze(res.ranks[0])
    cc = [e for e in rep.events if e.engine == "cc"]
    assert [e.op for e in cc] == ["all_reduce"] and cc[0].cost.note == "Mesh"
    nbytes = 8 * 16 * 4
    # Mesh inside one chip: 2 steps for an all-reduce; busbw factor 2(n-1)/n
    expect = (hw.collective.base_latency_s + 2 * hw.collective.hop_latency_s
              + 1.5 * nbytes / COLLECTIVE_BUSBW["trn2"]["Mesh"])
    assert cc[0].duration == pytest.approx(expect)
    assert rep.latency_s >= cc[0].end
    # bands: RDH above the mesh limit, KangaRing above the RDH limit; a prepare moves the base latency out
    assert collective_time("all_gather", 8, 2 << 20, hw)[1] == "RDH"
    assert collective_time("all_gather", 8, 100 << 20, hw)[1] == "KangaRing"
    assert collective_time("all_to_all_v", 8, 1 << 30, hw)[1] == "Mesh"
    t_plain = collective_time("all_to_all_v", 8, 4096, hw)[0]
    t_trig = collective_time("all_to_all_v", 8, 4096, hw, setup=False)[0]
    assert t_plain - t_trig == pytest.approx(hw.collective.base_latency_s)


@nki.jit
def k_ring_sbuf_channels(x, rg):
    """Two channels of SBUF tiles in one implicit permute (one tensor per channel: not a coalesced collective)."""
    p, f = x.shape
    srcs, dsts = [], []
    for c in range(2):
        s = nl.ndarray((p, f // 2), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=s, src=x[:, c * (f // 2):(c + 1) * (f // 2)])
        srcs.append([s])
        dsts.append([nl.ndarray((p, f // 2), dtype=x.dtype, buffer=nl.sbuf)])
    ncc.collective_permute_implicit(srcs_by_channel=srcs, dsts_by_channel=dsts, replica_group=rg, channel_ids=[0, 1])
    out = nl.ndarray((p, f), dtype=x.dtype, buffer=nl.shared_hbm)
    for c in range(2):
        nisa.dma_copy(dst=out[:, c * (f // 2):(c + 1) * (f // 2)], src=dsts[c][0])
    return out


def test_ring_permute_sbuf_two_channels():
    rng = np.random.default_rng(8)
    xs = [rand(rng, (4, 8)) for _ in range(4)]
    outs = launch(k_ring_sbuf_channels, 4, lambda r: {"x": xs[r], "rg": ReplicaGroup([[0, 1, 2, 3]])})
    for r in range(4):
        np.testing.assert_array_equal(outs[r], xs[r - 1])


def test_plain_lnc2_launch_reports_a_core_that_skips_a_collective():
    """nki.simulate(kernel[2]) is a one-rank world of two cores: core 1 finishing without the all_reduce core 0
    waits in is reported at once."""
    @nki.jit
    def lopsided(x):
        src, dst = _private(x.shape, x.dtype), _private(x.shape, x.dtype)
        nisa.dma_copy(dst=src, src=x)
        if nl.program_id(0) == 0:
            ncc.all_reduce(srcs=[src], dsts=[dst], replica_group=ReplicaGroup([[0]]), op=nl.add)
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=src)
        return out

    start = time.monotonic()
    with pytest.raises(nkisim.NkiCollectiveError, match="rank 0 core 1 finished the kernel after 0 collective"):
        nki.simulate(lopsided[2])(np.ones((2, 4), F32))
    assert time.monotonic() - start < 20
    np.testing.assert_array_equal(nki.simulate(k_all_reduce[2])(np.ones((2, 4), F32), ReplicaGroup([[0]]), nl.add),
                                  np.ones((2, 4), F32))


@nki.jit
def k_prepare_then_edit_metadata(x, meta, rg):
    """The prepare reads the metadata; zeroing it before the trigger must not change what moves."""
    src, dst, md = _private(x.shape, x.dtype), _private(x.shape, x.dtype), _private(meta.shape, meta.dtype)
    _stage_v(x, meta, src, dst, md)
    prep = ncc.all_to_all_v_prepare(srcs=[src], dsts=[dst], replica_group=rg, metadata_tensor=md,
                                    recv_counts_known=True)
    blank = nl.ndarray(meta.shape, dtype=meta.dtype, buffer=nl.sbuf)
    nisa.memset(dst=blank, value=0)
    nisa.dma_copy(dst=md, src=blank)
    ncc.all_to_all_v_trigger(prep)
    return _out(dst)


def test_prepare_reads_the_metadata():
    rng = np.random.default_rng(12)
    xs, metas, refs, _ = _a2av_case(4, rng, slot=2)
    outs = launch(k_prepare_then_edit_metadata, 4, lambda r: {"x": xs[r], "meta": metas[r],
                                                              "rg": ReplicaGroup([[0, 1, 2, 3]])})
    for q in range(4):
        np.testing.assert_array_equal(outs[q].reshape(-1), refs[q])


@nki.jit
def k_processing_rank_from_register(x, rg, it):
    reg = nisa.register_alloc(it)
    who = ncc.collective_permute_implicit_current_processing_rank_id(iteration_id=reg, replica_group=rg)
    out = nl.ndarray((1, x.shape[1]), dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=x.ap(pattern=[[x.shape[1], 1], [1, x.shape[1]]], scalar_offset=who, indirect_dim=0))
    return out


def test_processing_rank_id_with_a_register_iteration():
    table = np.arange(8 * 3, dtype=F32).reshape(8, 3)
    rg = groups(8)
    res = nkisim.run_ranks(k_processing_rank_from_register, 8, lambda r: {"x": table, "rg": rg, "it": 3})
    for r in range(8):
        g = rg.rank_list_of(r)
        np.testing.assert_array_equal(res.outputs[r][0], table[g[(g.index(r) - 3) % len(g)]])
    ins = [i for i in res.ranks[0].traces[0] if i.op.startswith("collective_permute_implicit_current")]
    assert len(ins) == 1 and ins[0].reads and ins[0].reads[0].buffer == "reg"   # depends on the iteration register


@nki.jit
def k_ring_all_gather_fori(x, rg, n):
    """The ring all-gather written with nl.fori_loop (NKI 0.7): the loop value is an NkiScalar iteration id."""
    m, f = x.shape
    cur, nxt = _private((m, f), x.dtype), _private((m, f), x.dtype)
    out = nl.ndarray((n, m, f), dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=cur, src=x)

    def step(i):
        who = ncc.collective_permute_implicit_current_processing_rank_id(iteration_id=i, replica_group=rg)
        nisa.dma_copy(dst=out.ap(pattern=[[f, m], [1, f]], scalar_offset=who, indirect_dim=0), src=cur)
        ncc.collective_permute_implicit(srcs_by_channel=[[cur]], dsts_by_channel=[[nxt]], replica_group=rg)
        nisa.dma_copy(dst=cur, src=nxt)

    nl.fori_loop(0, n, step)
    return out


@pytest.mark.parametrize("n", [2, 8])
def test_ring_all_gather_in_fori_loop(n):
    rng = np.random.default_rng(n)
    xs = [rand(rng, (2, 4)) for _ in range(n)]
    outs = launch(k_ring_all_gather_fori, n, lambda r: {"x": xs[r], "rg": ReplicaGroup([list(range(n))]), "n": n})
    for r in range(n):
        np.testing.assert_array_equal(outs[r], np.stack(xs))
