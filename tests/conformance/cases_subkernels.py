"""core/subkernels find_nonzero_indices and indexed_flatten: shapes of the library's
test/integration/nkilib/core/subkernels/test_find_nonzero_indices.py and test_indexed_flatten.py (all "fast"
params, LNC=2 as those tests run them), exact comparison (atol = rtol = 0) as the tests require."""

import numpy as np

from .harness import Case

_FNZ = "test/integration/nkilib/core/subkernels/test_find_nonzero_indices.py"
_IF = "test/integration/nkilib/core/subkernels/test_indexed_flatten.py"


def _sparse(T, E, top_k, dtype, seed):
    """[T, E] with T*top_k//E nonzeros per column at random places (ones for int32, 0.1 for float32)."""
    rng = np.random.default_rng(seed)
    k = T * top_k // E
    cols = np.zeros((E, T), dtype=dtype)
    for e in range(E):
        cols[e, rng.choice(T, size=k, replace=False)] = 1 if dtype == np.int32 else 0.1
    return np.ascontiguousarray(cols.T)


def _fnz(T, E, top_k, chunk, dtype, offset=None, local=None, target="trn2"):
    def inputs():
        kw = {"input_tensor": _sparse(T, E, top_k, dtype, seed=T + E + top_k), "chunk_size": chunk}
        if offset is not None:
            kw.update(col_start_id=np.array([offset], np.int32), n_cols=local)
        return kw

    sub = "" if offset is None else f"_off{offset}_n{local}"
    return Case("core.subkernels.find_nonzero_indices:find_nonzero_indices",
                "core.subkernels.find_nonzero_indices_torch:find_nonzero_indices_torch_ref",
                f"T{T}_E{E}_k{top_k}_c{chunk}_{np.dtype(dtype).name}{sub}", inputs, atol=0.0, rtol=0.0,
                source=f"{_FNZ}::test_find_nonzero_indices{'_fast' if offset is None else '_with_col_start_fast'}",
                target=target, lnc=2, exact=("indices", "nonzero_counts"))


def _flatten(T, E, f_len, n_rows=None, start=None, target="trn2"):
    def inputs():
        rows = n_rows if n_rows is not None else E
        out_len = -(-(rows * T + 1024) // 128) * 128
        return {"input_tensor": np.arange(E * T, dtype=np.int32).reshape(E, T), "f_len": f_len,
                "output_len": out_len, "row_offsets": (np.arange(rows, dtype=np.int32) * (T // f_len)),
                "row_offsets_start": None if start is None else np.array([start], np.int32), "padding_val": -1}

    sub = "" if start is None else f"_N{n_rows}_start{start}"
    return Case("core.subkernels.indexed_flatten:indexed_flatten",
                "core.subkernels.indexed_flatten_torch:indexed_flatten_torch_ref",
                f"T{T}_E{E}_f{f_len}{sub}", inputs, atol=0.0, rtol=0.0,
                source=f"{_IF}::test_indexed_flatten{'_fast' if start is None else '_row_offsets_start'}",
                target=target, lnc=2, exact=("flattened_array",))


CASES = [
    _fnz(4096, 128, 8, 4096, np.int32), _fnz(4096, 128, 8, 4096, np.float32),
    _fnz(10240, 128, 4, 10240, np.float32),  # (65536, full) dropped: 8 s; its subset twin below runs
    _fnz(4096, 128, 8, 4096, np.float32, 0, 4), _fnz(10240, 128, 4, 10240, np.int32, 16, 16),
    _fnz(65536, 128, 4, 16384, np.float32, 32, 16), _fnz(10240, 128, 4, 10240, np.float32, 120, 8),
    _fnz(4096, 128, 8, 4096, np.int32, target="trn3"),
    _flatten(4096, 1, 128), _flatten(4096, 2, 256), _flatten(4096, 3, 128), _flatten(10240, 17, 128),
    _flatten(65536, 4, 256), _flatten(4096, 256, 128), _flatten(4096, 2, 128, 4, 2), _flatten(4096, 3, 128, 5, 1),
    _flatten(10240, 8, 128, 16, 8), _flatten(4096, 2, 128, target="trn3"),
]
