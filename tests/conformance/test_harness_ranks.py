"""The harness's multi-rank path (Case.ranks > 1 -> nkisim.run_ranks) on a kernel of ours (runs without NKILIB_SRC)."""

import numpy as np

import nkisim

from . import harness

nkisim.install()
import nki  # noqa: E402
import nki.collectives as ncc  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

X = [np.arange(8, dtype=np.float32).reshape(2, 4) * (r + 1) for r in range(4)]


@nki.jit
def gather_rows(x, rg):
    src = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.private_hbm)
    dst = nl.ndarray((4 * x.shape[0], x.shape[1]), dtype=x.dtype, buffer=nl.private_hbm)
    out = nl.ndarray(dst.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=src, src=x)
    ncc.all_gather(srcs=[src], dsts=[dst], replica_group=rg, collective_dim=0)
    nisa.dma_copy(dst=out, src=dst)
    return out


def _case(golden, rank0_only=False):
    return harness.Case(gather_rows, golden, "tp4", lambda r: {"x": X[r], "rg": ncc.ReplicaGroup([[0, 1, 2, 3]])},
                        atol=0.0, rtol=0.0, source="ours", ranks=4, rank0_only=rank0_only)


def test_every_rank_is_compared_with_its_golden():
    assert harness.run_case(_case(lambda r: {"out": np.concatenate(X)})).passed
    # a golden right for rank 0 only fails unless the case says the library validates rank 0 only
    wrong_elsewhere = (lambda r: {"out": np.concatenate(X) + (r > 0)})
    assert not harness.run_case(_case(wrong_elsewhere)).passed
    assert harness.run_case(_case(wrong_elsewhere, rank0_only=True)).passed
