"""Alpha-beta collective cost model with Neuron's intra-node algorithm bands.

Conventions (parallel-and-perf-model.md §2.2, §2.3, Part 3):

* ``S`` is the nccl-tests / nccom-test "size": the full buffer for all-reduce, the total *output* for all-gather, the
  total *input* for reduce-scatter, the per-rank send buffer for all-to-all.
* busbw factors: all-reduce ``2(n-1)/n``; all-gather, reduce-scatter, all-to-all ``(n-1)/n``; so the bandwidth term
  is ``factor * S / busbw``.
* Algorithm by message size (aws-neuron-sdk ``neuron-runtime/explore/intranode-collective-comm.rst``): Mesh below
  1 MB (O(1) routed steps: one inside a chip, two when the group spans chips), RDH 1-56 MB (O(log2 n) steps), KangaRing
  above 56 MB (O(n/2) steps). An all-reduce is a reduce-scatter followed by an all-gather, so it takes twice the steps.
* ``t = alpha_base + steps * alpha_hop + factor * S / busbw(algorithm)``.

The per-hop latency (1-2 µs) and the band limits are published; the base latency and the busbw plateaus are modelled
defaults to be replaced by an nccom-test sweep on the target instance. The bench reads every one of them through its
collective table (``bench.model._hw_source.collective_table``: value, status documented / ASSUMPTION, source), which
re-exports the one written copy in ``nkisim.hardware`` (shared with the cost of nki.collectives instructions).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from nkisim.cost import collective as _nkisim_cc

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class CollectiveParams:
    """Alpha-beta parameters of one instance type (see ``bench.model.hardware``)."""

    alpha_base_s: float
    alpha_hop_s: float
    mesh_max_bytes: float
    rdh_max_bytes: float
    busbw_mesh: float          # bytes/s
    busbw_rdh: float
    busbw_kangaring: float


@dataclass(frozen=True)
class Collective:
    """One collective call in a modelled step: where it sits, what it moves, what it costs."""

    where: str          # e.g. "layer.attention", "embedding", "lm_head", "prefill.layer.mlp"
    op: str             # one of OPS
    group: str          # e.g. "attn_tp", "mlp_dp_col", "tp"
    n: int              # group size (ranks)
    bytes: float        # S in the nccl-tests convention
    per_layer: bool     # repeated once per decoder layer
    algorithm: str = ""
    time_s: float = 0.0
    spans_chips: bool = True

    def as_dict(self) -> dict:
        return asdict(self)


def busbw_factor(op: str, n: int) -> float:
    if op not in OPS:
        raise ValueError(f"unknown collective op {op!r}; expected one of {OPS}")
    return _nkisim_cc.busbw_factor(op, n)


def choose_algorithm(nbytes: float, params: CollectiveParams) -> str:
    """Neuron's empirical sweet spots: Mesh < 1 MB, RDH 1-56 MB, KangaRing > 56 MB."""
    if nbytes < params.mesh_max_bytes:
        return "Mesh"
    if nbytes <= params.rdh_max_bytes:
        return "RDH"
    return "KangaRing"


def algorithm_steps(op: str, n: int, algorithm: str, spans_chips: bool) -> int:
    """Latency-bearing steps (hops) of one collective (the one formula, shared with nkisim's cost model)."""
    if algorithm not in ("Mesh", "RDH", "KangaRing"):
        raise ValueError(f"unknown algorithm {algorithm!r}")
    return _nkisim_cc.algorithm_steps(op, n, algorithm, spans_chips)


def collective_time(op: str, n: int, nbytes: float, params: CollectiveParams,
                    spans_chips: bool = True) -> tuple[float, str]:
    """(seconds, algorithm) for one collective over ``n`` ranks moving ``nbytes`` (nccl-tests S). n == 1 costs 0."""
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    if nbytes < 0:
        raise ValueError(f"bytes must be >= 0, got {nbytes}")
    if n == 1:
        return 0.0, "bypass"
    algorithm = choose_algorithm(nbytes, params)
    busbw = {"Mesh": params.busbw_mesh, "RDH": params.busbw_rdh, "KangaRing": params.busbw_kangaring}[algorithm]
    steps = algorithm_steps(op, n, algorithm, spans_chips)
    t = params.alpha_base_s + steps * params.alpha_hop_s + busbw_factor(op, n) * nbytes / busbw
    return t, algorithm
