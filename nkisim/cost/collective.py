"""Alpha-beta cost of one `nki.collectives` instruction (engine "cc"; all figures modelled, uncalibrated).

    t = alpha_base + steps * alpha_hop + factor * S / busbw(algorithm)

S follows the nccl-tests convention recorded by nkisim.collectives (all-reduce: the buffer; all-gather: the total
output; reduce-scatter: the total input; all-to-all(-v): the send buffer; permutes: the bytes sent). Algorithms:

- all_reduce / all_gather / reduce_scatter: Neuron's intra-node bands by size (aws-neuron-sdk
  `intranode-collective-comm.rst`): Mesh below `mesh_max_bytes` (1 routed step inside a chip, 2 across chips), RDH up
  to `rdh_max_bytes` (ceil(log2 n) steps), KangaRing above (ceil(n/2) steps); an all-reduce takes twice the steps;
  busbw factor 2(n-1)/n for all-reduce, (n-1)/n otherwise.
- all_to_all(_v), all_gather_v: direct (Mesh): every rank writes every peer at once.
- collective_permute: one direct hop, factor 1; collective_permute_implicit(_reduce): one ring hop, factor 1 at the
  KangaRing plateau (channels share it: extra bandwidth from more channels is not modelled).
- an `all_*_v_prepare` costs alpha_base (the metadata setup it hoists); its trigger then pays no alpha_base.

Constants: `hw.collective` (hop and base latency, band limits) and `COLLECTIVE_BUSBW` (busbw plateaus) in
nkisim.hardware, each with its source. A rank's trace is scheduled alone: the model assumes the other ranks reach
the collective at the same time (SPMD), so waiting for a slower rank is not modelled.
"""

import math

from ..hardware import COLLECTIVE_BUSBW, HARDWARE

DIRECT = frozenset({"all_to_all", "all_to_all_v", "all_gather_v", "collective_permute"})
RING_STEP = frozenset({"collective_permute_implicit", "collective_permute_implicit_reduce"})


def platform_of(core):
    for p in HARDWARE.values():
        if p.core is core:
            return p
    return next(p for p in HARDWARE.values() if p.core.nc_version == core.nc_version)


def busbw_factor(op, n):
    if n <= 1:
        return 0.0
    if op in RING_STEP or op == "collective_permute":
        return 1.0
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def choose_algorithm(op, nbytes, cc):
    """Mesh / RDH / KangaRing for the size-banded collectives; fixed for direct and ring-step instructions."""
    if op in DIRECT:
        return "Mesh"
    if op in RING_STEP:
        return "KangaRing"
    if nbytes < cc.mesh_max_bytes:
        return "Mesh"
    return "RDH" if nbytes <= cc.rdh_max_bytes else "KangaRing"


def algorithm_steps(op, n, algorithm, spans_chips):
    if n <= 1:
        return 0
    if op in RING_STEP or op == "collective_permute":
        return 1
    if algorithm == "Mesh":
        steps = 2 if spans_chips else 1
    elif algorithm == "RDH":
        steps = math.ceil(math.log2(n))
    else:
        steps = max(1, math.ceil(n / 2))
    return 2 * steps if op == "all_reduce" else steps


def collective_time(op, n, nbytes, platform, spans_chips=False, setup=True):
    """(seconds, algorithm) of one collective instruction over a rank-list of n ranks moving nbytes (S)."""
    if n <= 1:
        return 0.0, "bypass"
    cc = platform.collective
    algorithm = choose_algorithm(op, nbytes, cc)
    busbw = COLLECTIVE_BUSBW[platform.name if platform.name in COLLECTIVE_BUSBW else "trn2"][algorithm]
    steps = algorithm_steps(op, n, algorithm, spans_chips)
    t = (cc.base_latency_s if setup else 0.0) + steps * cc.hop_latency_s + busbw_factor(op, n) * nbytes / busbw
    return t, algorithm


def collective_cost(ins, core):
    """OpCost of a recorded collective instruction (meta: collective, ranks, nbytes, lnc, setup, split)."""
    from .costs import OpCost, _hbm_bytes
    m = ins.meta
    platform = platform_of(core)
    n, nbytes, lnc = int(m.get("ranks", 1)), int(m.get("nbytes", 0)), int(m.get("lnc", 1))
    rd, wr = _hbm_bytes(ins)
    if m.get("setup"):     # all_*_v_prepare: the metadata setup only
        t = platform.collective.base_latency_s if n > 1 else 0.0
        return OpCost("cc", busy_s=t, hbm_read=rd, hbm_write=wr, note="prepare (setup)")
    ranks_per_chip = max(1, platform.chip.cores // max(lnc, 1))
    t, algorithm = collective_time(m.get("collective", ins.op), n, nbytes, platform,
                                   spans_chips=n > ranks_per_chip, setup=not m.get("split"))
    return OpCost("cc", busy_s=t, hbm_read=rd, hbm_write=wr, dma_bytes=nbytes, note=algorithm)
