"""Modelled kernel latencies (nkisim) fed back into the analytical model where a kernel exists.

The kernel benchmarks (``bench/test_decode_attention.py``) store nkisim's ``CostReport.extra_info()`` per
(shape, batch, context, target). ``KernelTable`` indexes those rows and answers the analytical model's
``kernel_latency(component, shape)`` callback: the decode-attention component of a configuration whose per-rank shape
matches a benchmarked shard takes nkisim's modelled latency (bilinear in batch × context between benchmarked
buckets; no extrapolation) instead of its roofline time. With LNC=2 the kernel splits the batch over the two physical
cores, so a logical-core launch of batch B is looked up at ceil(B / 2) on one core.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict

from bench.model.analytical import kv_heads_per_rank
from modules.model_specs import GPT_OSS_20B, LLAMA_31_8B


def _shard(spec, tp: int) -> dict:
    """The analytical model's decode-attention shape of one TP rank (same rule as its ``shape`` argument)."""
    return {"q_heads": spec.heads // tp, "kv_heads": kv_heads_per_rank(spec, tp), "head_dim": spec.head_dim,
            "hidden": spec.hidden}


# Per-rank shards benchmarked by bench/test_decode_attention.py (names are its SHAPES keys), derived from the one
# model-shape table (modules/model_specs.py), never restated.
KNOWN_SHAPES = {"gpt-oss-20b-tp8": _shard(GPT_OSS_20B, 8), "llama-3.1-8b-tp8": _shard(LLAMA_31_8B, 8)}


def _shape_key(d: dict) -> tuple | None:
    try:
        return int(d["q_heads"]), int(d["kv_heads"]), int(d["head_dim"]), int(d["hidden"])
    except (KeyError, TypeError, ValueError):
        return None


MAIN_GRID = "test_decode_attention_modelled["     # bench/test_decode_attention.py's contiguous grid
# extra_info keys that mark a variant of the decode-attention workload (not the contiguous full-attention grid)
_VARIANT_KEYS = ("modelled_sliding_window", "modelled_block_size", "modelled_layout", "modelled_context_split",
                 "modelled_batch_split", "modelled_kv_cache", "layout", "block_size", "sliding_window",
                 "context_split", "batch_split", "kv_cache", "ragged", "modelled_ragged", "peer")


def _int(v) -> int | None:
    """An integer batch / context, or None (e.g. a ragged row's 'ragged 128-16K' label)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and v.strip().isdigit():
        return int(v)
    return None


class KernelTable:
    def __init__(self) -> None:
        # (shape key, target) -> {(batch, ctx): latency_s}
        self._pts: dict[tuple, dict[tuple[int, int], float]] = defaultdict(dict)
        self.lookups = 0
        self.hits = 0

    def __len__(self) -> int:
        return sum(len(v) for v in self._pts.values())

    def add_benchmark(self, name: str, params: dict | None, extra_info: dict) -> bool:
        """Index one decode-attention benchmark row of the main grid; False if it is not one. Variants of the kernel
        benchmarked beside it (paged KV, sliding window, LNC=2 context split, ragged contexts, S_tkg > 1, peers) are
        other workloads at the same (batch, context) and must not replace the contiguous full-attention point."""
        x = extra_info or {}
        if "modelled_latency_s" not in x or not name.startswith(MAIN_GRID):
            return False
        if any(x.get(k) for k in _VARIANT_KEYS) or int(x.get("s_tkg", 1) or 1) != 1:
            return False
        shape = KNOWN_SHAPES.get(str(x.get("model", ""))) or x
        key = _shape_key(shape)
        batch, ctx = _int(x.get("batch")), _int(x.get("context", x.get("ctx")))
        if key is None or batch is None or ctx is None or _int(x.get("lnc", 1)) != 1:
            return False
        target = x.get("modelled_target", (params or {}).get("target", "trn2"))
        self._pts[(key, target)][(batch, ctx)] = float(x["modelled_latency_s"])
        return True

    @classmethod
    def from_benchmarks(cls, benchmarks) -> KernelTable:
        """From pytest-benchmark JSON dicts or live ``Metadata`` objects."""
        table = cls()
        for b in benchmarks:
            if isinstance(b, dict):
                table.add_benchmark(b.get("name", ""), b.get("params"), b.get("extra_info"))
            else:
                table.add_benchmark(getattr(b, "name", ""), getattr(b, "params", None), getattr(b, "extra_info", {}))
        return table

    def _interp(self, pts: dict[tuple[int, int], float], b: float, c: float) -> float | None:
        bs = sorted({k[0] for k in pts})
        cs = sorted({k[1] for k in pts})
        if not (bs[0] <= b <= bs[-1] and cs[0] <= c <= cs[-1]):
            return None

        def bracket(grid, v):
            i = bisect.bisect_left(grid, v)
            if grid[i] == v:
                return grid[i], grid[i], 0.0
            lo, hi = grid[i - 1], grid[i]
            return lo, hi, (v - lo) / (hi - lo)

        b0, b1, tb = bracket(bs, b)
        c0, c1, tc = bracket(cs, c)
        corners = [pts.get((bb, cc)) for bb in (b0, b1) for cc in (c0, c1)]
        if any(v is None for v in corners):
            return None
        v00, v01, v10, v11 = corners
        return (v00 * (1 - tb) * (1 - tc) + v01 * (1 - tb) * tc + v10 * tb * (1 - tc) + v11 * tb * tc)

    def __call__(self, component: str, shape: dict) -> float | None:
        """The analytical model's ``kernel_latency`` callback (seconds per launch, or None)."""
        if component != "attention" or shape.get("phase") or not self._pts:
            return None
        self.lookups += 1
        key = _shape_key(shape)
        pts = self._pts.get((key, shape.get("target", "trn2")))
        if not pts:
            return None
        lnc = int(shape.get("lnc", 1))
        t = self._interp(pts, math.ceil(shape["batch"] / lnc), shape["ctx"])
        if t is not None:
            self.hits += 1
        return t
