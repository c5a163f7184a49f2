"""core/utils cross_partition_copy, tp_broadcast and TensorView, driven as their library tests drive them:
test/integration/nkilib/core/utils/test_cross_partition_copy.py, test_tp_broadcast.py and test_tensor_view.py
(TestDynamicTensorView, the data-moving tests). The thin driver kernels and NumPy references are ours."""

import nki
import nki.isa as nisa
import nki.language as nl
import numpy as np

from bench.peers import nkilib

from .harness import Case

_SRC = "test/integration/nkilib/core/utils/"


# ---- cross_partition_copy --------------------------------------------------------------------------------------

@nki.jit
def cross_partition_copy(data, src_start, dst_start, count, free):
    """Load data into SBUF, copy partitions [src_start, +count) to dst_start of a zeroed tile, store it."""
    copy = nkilib.load("core.utils.cross_partition_copy:cross_partition_copy")
    src = nl.ndarray(data.shape, dtype=data.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=src, src=data)
    dst = nl.ndarray(data.shape, dtype=data.dtype, buffer=nl.sbuf)
    nisa.memset(dst=dst, value=0.0)
    copy(src=src, dst=dst, src_start_partition=src_start, dst_start_partition=dst_start,
         num_partitions_to_copy=count, free_dim_size=free)
    out = nl.ndarray(data.shape, dtype=data.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=dst)
    return out


def _partition_copy_ref(data, src_start, dst_start, count, free):
    out = np.zeros_like(data.numpy())
    out[dst_start:dst_start + count, :free] = data.numpy()[src_start:src_start + count, :free]
    return {"output": out}


def _cpc(src_start, dst_start, count, free, total, target="trn2"):
    def inputs():
        rng = np.random.default_rng(src_start * 997 + dst_start * 31 + count)
        return {"data": rng.standard_normal((total, free)).astype(np.float32), "src_start": src_start,
                "dst_start": dst_start, "count": count, "free": free}

    return Case(cross_partition_copy, _partition_copy_ref, f"ss{src_start}_ds{dst_start}_n{count}_f{free}_p{total}",
                inputs, atol=0.0, rtol=0.0, source=_SRC + "test_cross_partition_copy.py::test_cross_partition_copy",
                target=target, exact=("output",))


# ---- tp_broadcast --------------------------------------------------------------------------------------------

@nki.jit
def tp_broadcast(src_hbm, src_offset, count, select_index):
    """Broadcast column `src_offset` of an SBUF copy of src_hbm (a selected 2-D view of it when 3-D) to `count`
    partitions with the library's tp_broadcast."""
    broadcast = nkilib.load("core.utils.tp_broadcast:tp_broadcast")
    view_cls = nkilib.load("core.utils.tensor_view:TensorView")
    src = nl.ndarray(src_hbm.shape, dtype=src_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=src, src=src_hbm)
    dst = nl.ndarray((count, src_hbm.shape[0]), dtype=src_hbm.dtype, buffer=nl.sbuf)
    broadcast(src if select_index is None else view_cls(src).select(1, select_index), dst, src_offset)
    out = nl.ndarray(dst.shape, dtype=dst.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=dst)
    return out


def _tp_broadcast_ref(src_hbm, src_offset, count, select_index):
    x = src_hbm.numpy()
    if select_index is not None:
        x = x[:, select_index]
    return {"out": np.repeat(x.reshape(x.shape[0], -1)[None, :, src_offset], count, axis=0)}


def _tpb(shape, offset, count, select_index, target="trn2"):
    def inputs():
        rng = np.random.default_rng(sum(shape) + offset)
        return {"src_hbm": rng.random(shape, dtype=np.float32), "src_offset": offset, "count": count,
                "select_index": select_index}

    return Case(tp_broadcast, _tp_broadcast_ref, f"{'x'.join(map(str, shape))}_off{offset}_bc{count}_sel{select_index}",
                inputs, atol=0.0, rtol=0.0, source=_SRC + "test_tp_broadcast.py::test_tp_broadcast", target=target,
                exact=("out",))


# ---- TensorView (dynamic select / vector_select, data moved through SBUF) -----------------------------------

@nki.jit
def tensor_view(data, dyn_index, row_offsets, ops, out_shape):
    """Apply TensorView ops to the HBM input (dynamic selects read their index from SBUF) and copy the view out."""
    view = nkilib.load("core.utils.tensor_view:TensorView")(data)
    for name, args in ops:
        if name == "select_dynamic":
            idx = nl.ndarray((1, 1), dtype=dyn_index.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=idx, src=dyn_index)
            view = view.select(args[0], idx)
        elif name == "vector_select":
            offs = nl.ndarray(row_offsets.shape, dtype=row_offsets.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=offs, src=row_offsets)
            view = view.vector_select(args[0], offs)
        else:
            view = getattr(view, name)(*args)
    staged = nl.ndarray(out_shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=staged, src=view.get_view())
    out = nl.ndarray(out_shape, dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=staged)
    return out


def _np_ops(x, ops, dyn, rows):
    for name, args in ops:
        if name in ("select", "select_dynamic"):
            x = np.take(x, dyn if name == "select_dynamic" else args[1], axis=args[0])
        elif name == "vector_select":
            x = x[rows.reshape(-1)]
        elif name == "permute":
            x = np.transpose(x, args[0])
        elif name == "reshape_dim":
            x = x.reshape(x.shape[:args[0]] + tuple(args[1]) + x.shape[args[0] + 1:])
        elif name == "slice":
            dim, start, end, step = args
            x = x[(slice(None),) * dim + (slice(start, end, step),)]
        else:
            raise ValueError(name)
    return np.ascontiguousarray(x)


def _tensor_view_ref(data, dyn_index, row_offsets, ops, out_shape):
    return {"out": _np_ops(data.numpy(), ops, int(dyn_index.numpy()[0, 0]), row_offsets.numpy())}


def _tv(shape, ops, dyn=1, target="trn2"):
    def inputs():
        rng = np.random.default_rng(len(ops) * 1000 + sum(shape))
        data = rng.standard_normal(shape).astype(np.float32)
        rows = np.zeros((128, 1), np.int32)
        if any(name == "vector_select" for name, _ in ops):
            before = ops[:[name for name, _ in ops].index("vector_select")]
            rows = rng.integers(0, _np_ops(data, before, dyn, rows).shape[0], size=(128, 1)).astype(np.int32)
        out_shape = _np_ops(data, ops, dyn, rows).shape
        return {"data": data, "dyn_index": np.array([[dyn]], np.int32), "row_offsets": rows, "ops": ops,
                "out_shape": out_shape}

    tag = "_".join(name for name, _ in ops)
    return Case(tensor_view, _tensor_view_ref, f"{'x'.join(map(str, shape))}_{tag}", inputs, atol=0.0, rtol=0.0,
                source=_SRC + "test_tensor_view.py::TestDynamicTensorView::test_dynamic_select", target=target,
                exact=("out",))


CASES = [
    *(_cpc(*p) for p in [(0, 0, 32, 8, 128), (0, 64, 32, 8, 128), (0, 5, 10, 8, 128), (0, 28, 20, 8, 128),
                         (0, 1, 63, 8, 64), (33, 64, 16, 8, 128), (17, 0, 15, 8, 32), (3, 2, 4, 8, 32),
                         (10, 55, 30, 8, 96), (28, 64, 32, 8, 128), (25, 5, 20, 8, 64), (0, 28, 20, 128, 128)]),
    _cpc(5, 28, 20, 8, 128, target="trn3"), _cpc(0, 60, 10, 8, 96, target="trn3"),
    _tpb((5, 7), 0, 1, None), _tpb((3, 8, 11), 1, 2, 4), _tpb((8, 6), 5, 7, None), _tpb((13, 3, 13), 9, 12, 2),
    _tpb((13, 3, 13), 9, 12, 2, target="trn3"),
    _tv((4, 2, 8), (("select", (0, 0)),)),
    _tv((4, 2, 8), (("select_dynamic", (0,)),)),
    _tv((4, 2, 8), (("select_dynamic", (0,)), ("permute", ((1, 0),)))),
    _tv((4, 2, 8), (("permute", ((1, 0, 2),)), ("select_dynamic", (0,)))),
    _tv((4, 8), (("reshape_dim", (0, (2, 2))), ("select_dynamic", (0,)))),
    _tv((8, 2, 4), (("slice", (0, 0, 8, 2)), ("select_dynamic", (0,)))),
    _tv((256, 8), (("vector_select", (0,)),)),
    _tv((256, 2, 8), (("vector_select", (0,)),)),
    _tv((256, 8), (("reshape_dim", (0, (128, 2))), ("vector_select", (0,)))),
    _tv((512, 2, 4), (("slice", (0, 0, 512, 2)), ("vector_select", (0,)))),
    _tv((256, 2, 8), (("vector_select", (0,)), ("permute", ((0, 2, 1),)))),
    _tv((256, 2, 8), (("vector_select", (0,)), ("permute", ((0, 2, 1),))), target="trn3"),
]
