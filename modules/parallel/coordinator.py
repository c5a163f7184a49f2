"""GroupCoordinator: one object per process-group layout, vLLM parallel_state style.

Collectives are out-of-place (the input is never mutated), bypass themselves at world_size 1 (so model code
calls them unconditionally) and are recorded in a CollectiveLog as (op, group, bytes). The log records the
*logical* op: an emulated reduce-scatter is logged once as "reduce_scatter", not as its primitives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from modules.parallel.rank_lists import group_containing

EMULATABLE_OPS = frozenset({"reduce_scatter", "all_to_all"})


@dataclass(frozen=True)
class CollectiveRecord:
    op: str
    group: str
    nbytes: int  # bytes of this rank's input tensor
    world_size: int
    shape: tuple[int, ...]
    dtype: str
    bypassed: bool  # True when world_size == 1 (no communication happened)


class CollectiveLog:
    """Append-only record of collectives issued through coordinators that share this log."""

    def __init__(self) -> None:
        self.records: list[CollectiveRecord] = []
        self.enabled = True

    def record(self, op: str, group: str, x: torch.Tensor, world_size: int) -> None:
        if self.enabled:
            self.records.append(CollectiveRecord(op, group, x.numel() * x.element_size(), world_size,
                                                 tuple(x.shape), str(x.dtype), world_size == 1))

    def _select(self, op: str | None, group: str | None, include_bypassed: bool) -> list[CollectiveRecord]:
        return [r for r in self.records
                if (op is None or r.op == op) and (group is None or r.group == group)
                and (include_bypassed or not r.bypassed)]

    def count(self, op: str | None = None, group: str | None = None, include_bypassed: bool = False) -> int:
        """Number of collectives (bypassed size-1 calls excluded unless asked)."""
        return len(self._select(op, group, include_bypassed))

    def total_bytes(self, op: str | None = None, group: str | None = None) -> int:
        return sum(r.nbytes for r in self._select(op, group, False))

    def ops(self, include_bypassed: bool = False) -> list[tuple[str, str]]:
        return [(r.op, r.group) for r in self._select(None, None, include_bypassed)]

    def clear(self) -> None:
        self.records.clear()

    @contextlib.contextmanager
    def capture(self) -> Iterator[CollectiveLog]:
        """Yield a log holding only the records made inside the block (also kept in this log)."""
        start = len(self.records)
        window = CollectiveLog()
        try:
            yield window
        finally:
            window.records = self.records[start:]


def _norm_dim(x: torch.Tensor, dim: int) -> int:
    nd = max(x.dim(), 1)
    if not -nd <= dim < nd:
        raise ValueError(f"dim={dim} out of range for a tensor of shape {tuple(x.shape)}")
    return dim % nd


class GroupCoordinator:
    """Wraps one set of rank lists. Every rank calls the constructor with the full set (group creation is
    collective over the world) and keeps the group containing it.

    Args:
        group_ranks: a partition of the world's ranks, e.g. ``build_tp_group_ranks(world, tp)``.
        name: label used in the collective log ("tp", "attention_tp", ...).
        backend: process-group backend (None = the default group's backend: gloo on CPU).
        log: shared CollectiveLog; a private one is created if omitted.
        emulate: ops to implement with other primitives ("reduce_scatter", "all_to_all") for backends that lack
            them natively. Results are identical; the log still shows the logical op.
    """

    def __init__(self, group_ranks: Sequence[Sequence[int]], name: str, backend: str | None = None,
                 log: CollectiveLog | None = None, emulate: Iterable[str] = ()) -> None:
        if not dist.is_initialized():
            raise RuntimeError(f"GroupCoordinator {name!r}: torch.distributed is not initialized")
        self.emulate = frozenset(emulate)
        if not self.emulate <= EMULATABLE_OPS:
            raise ValueError(f"emulate={sorted(self.emulate)} has unknown ops; choose from {sorted(EMULATABLE_OPS)}")
        self.name = name
        self.aliases = [name]  # other roles sharing this coordinator (filled in by the state's GroupCache)
        self.group_ranks = [list(g) for g in group_ranks]
        self.rank = dist.get_rank()
        self.ranks = group_containing(self.group_ranks, self.rank)
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(self.rank)
        self.log = log if log is not None else CollectiveLog()
        self.device_group = None
        for ranks in self.group_ranks:
            # new_group is collective: all ranks create every group, in the same order. Size-1 groups are
            # created too so every coordinator has a real group (groups are always created, per the seed).
            pg = dist.new_group(ranks, backend=backend)
            if self.rank in ranks:
                self.device_group = pg

    def __repr__(self) -> str:
        return f"GroupCoordinator(name={self.name!r}, ranks={self.ranks}, rank_in_group={self.rank_in_group})"

    def _log(self, op: str, x: torch.Tensor) -> bool:
        """Record op; return True when it must be bypassed (size 1)."""
        self.log.record(op, self.name, x, self.world_size)
        return self.world_size == 1

    # -- collectives -----------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, out of place. At size 1 returns x itself."""
        if self._log("all_reduce", x):
            return x
        out = x.clone(memory_format=torch.contiguous_format)
        if out.numel():
            dist.all_reduce(out, group=self.device_group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's x along dim (all ranks pass the same shape)."""
        dim = _norm_dim(x, dim)
        if self._log("all_gather", x):
            return x
        return self._all_gather(x, dim)

    def _all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x.contiguous()
        if x.numel() == 0:  # nothing to move; the output shape is known locally
            return torch.cat([x] * self.world_size, dim=dim)
        bufs = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(bufs, x, group=self.device_group)
        return torch.cat(bufs, dim=dim)

    def all_gatherv(self, x: torch.Tensor, sizes: Sequence[int], dim: int = 0) -> torch.Tensor:
        """All-gather with per-rank sizes along dim (ragged batches). sizes must be known to every rank.

        Pads to max(sizes), gathers, trims: one logical all-gather.
        """
        dim = _norm_dim(x, dim)
        sizes = [int(s) for s in sizes]
        if len(sizes) != self.world_size or any(s < 0 for s in sizes):
            raise ValueError(f"sizes={sizes} must hold {self.world_size} non-negative entries (group {self.name!r})")
        if x.shape[dim] != sizes[self.rank_in_group]:
            raise ValueError(f"x.shape[{dim}]={x.shape[dim]} != sizes[{self.rank_in_group}]={sizes[self.rank_in_group]}"
                             f" on group {self.name!r}")
        if self._log("all_gather", x):
            return x
        width = max(sizes)
        if x.shape[dim] < width:
            pad = list(x.shape)
            pad[dim] = width - x.shape[dim]
            x = torch.cat([x, x.new_zeros(pad)], dim=dim)
        gathered = self._all_gather(x, dim).split(width, dim=dim)
        return torch.cat([g.narrow(dim, 0, s) for g, s in zip(gathered, sizes, strict=True)], dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over the group, then keep this rank's 1/world_size chunk along dim."""
        dim = _norm_dim(x, dim)
        if x.shape[dim] % self.world_size:
            raise ValueError(f"reduce_scatter: x.shape[{dim}]={x.shape[dim]} is not divisible by "
                             f"world_size={self.world_size} of group {self.name!r}")
        if self._log("reduce_scatter", x):
            return x
        chunk = x.shape[dim] // self.world_size
        if x.numel() == 0:
            return x.narrow(dim, 0, chunk).clone()
        if "reduce_scatter" in self.emulate:
            # all-reduce + local slice: same result, world_size× the received bytes.
            full = x.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(full, group=self.device_group)
            return full.narrow(dim, self.rank_in_group * chunk, chunk).contiguous()
        xt = x.movedim(dim, 0).contiguous()
        out = torch.empty_like(xt[:chunk])
        dist.reduce_scatter(out, list(xt.split(chunk)), group=self.device_group)
        return out.movedim(0, dim).contiguous()

    def all_to_all(self, x: torch.Tensor, dim: int = 0, input_split_sizes: Sequence[int] | None = None,
                   output_split_sizes: Sequence[int] | None = None) -> torch.Tensor:
        """Split x along dim, send piece j to group rank j, concatenate received pieces along dim.

        Uneven splits need both input_split_sizes (what I send) and output_split_sizes (what I receive).
        """
        dim = _norm_dim(x, dim)
        ws = self.world_size
        if input_split_sizes is None:
            if x.shape[dim] % ws:
                raise ValueError(f"all_to_all: x.shape[{dim}]={x.shape[dim]} is not divisible by world_size={ws} "
                                 f"of group {self.name!r}; pass input_split_sizes")
            input_split_sizes = [x.shape[dim] // ws] * ws
        input_split_sizes = [int(s) for s in input_split_sizes]
        if len(input_split_sizes) != ws or sum(input_split_sizes) != x.shape[dim]:
            raise ValueError(f"input_split_sizes={input_split_sizes} must have {ws} entries summing to "
                             f"x.shape[{dim}]={x.shape[dim]}")
        if output_split_sizes is None:
            if len(set(input_split_sizes)) > 1:
                raise ValueError(f"all_to_all with uneven input_split_sizes={input_split_sizes} needs "
                                 "output_split_sizes")
            output_split_sizes = input_split_sizes
        output_split_sizes = [int(s) for s in output_split_sizes]
        if len(output_split_sizes) != ws:
            raise ValueError(f"output_split_sizes={output_split_sizes} must have {ws} entries")
        if self._log("all_to_all", x):
            return x
        xt = x.movedim(dim, 0)
        sends = [t.contiguous() for t in xt.split(input_split_sizes)]
        recvs = [xt.new_empty((s, *xt.shape[1:])) for s in output_split_sizes]
        uneven = len(set(input_split_sizes)) > 1 or len(set(output_split_sizes)) > 1
        if uneven or "all_to_all" in self.emulate:
            # gloo's list all_to_all requires equal piece shapes, so uneven splits always take this path.
            # Pairwise isend/irecv: works for any split sizes on any backend with point-to-point.
            recvs[self.rank_in_group].copy_(sends[self.rank_in_group])
            reqs = []
            for j, peer in enumerate(self.ranks):
                if j == self.rank_in_group:
                    continue
                if sends[j].numel():
                    reqs.append(dist.isend(sends[j], dst=peer, group=self.device_group))
                if recvs[j].numel():
                    reqs.append(dist.irecv(recvs[j], src=peer, group=self.device_group))
            for req in reqs:
                req.wait()
        else:
            dist.all_to_all(recvs, sends, group=self.device_group)
        return torch.cat(recvs, dim=0).movedim(0, dim).contiguous()

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.device_group)


class StaticGroup:
    """World size and rank without a process group: build and load a layer "as rank r" in one process.

    Collectives bypass at size 1 and raise otherwise (there is nobody to talk to).
    """

    def __init__(self, world_size: int = 1, rank_in_group: int = 0, name: str = "static",
                 log: CollectiveLog | None = None) -> None:
        if not 0 <= rank_in_group < world_size:
            raise ValueError(f"rank_in_group={rank_in_group} must be in [0, world_size={world_size})")
        self.world_size, self.rank_in_group, self.name = world_size, rank_in_group, name
        self.ranks = list(range(world_size))
        self.log = log if log is not None else CollectiveLog()

    def __repr__(self) -> str:
        return f"StaticGroup(world_size={self.world_size}, rank_in_group={self.rank_in_group})"

    def _bypass(self, op: str, x: torch.Tensor) -> torch.Tensor:
        # Refuse before logging: the log must hold only collectives that ran (or were bypassed).
        if self.world_size != 1:
            raise RuntimeError(f"StaticGroup {self.name!r} (world_size={self.world_size}) cannot run {op}")
        self.log.record(op, self.name, x, self.world_size)
        return x

    def _check_single_piece(self, op: str, x: torch.Tensor, dim: int, arg: str, sizes) -> None:
        """At size 1 a per-rank size list must be exactly [x.shape[dim]]; anything else would be dropped silently."""
        if sizes is None or self.world_size != 1:
            return
        sizes = [int(s) for s in sizes]
        if sizes != [x.shape[dim]]:
            raise ValueError(f"{op}: {arg}={sizes} must be [x.shape[{dim}]]=[{x.shape[dim]}] on size-1 group "
                             f"{self.name!r}")

    def all_reduce(self, x):
        return self._bypass("all_reduce", x)

    def all_gather(self, x, dim=0):
        _norm_dim(x, dim)
        return self._bypass("all_gather", x)

    def all_gatherv(self, x, sizes, dim=0):
        dim = _norm_dim(x, dim)
        self._check_single_piece("all_gatherv", x, dim, "sizes", sizes)
        return self._bypass("all_gather", x)

    def reduce_scatter(self, x, dim=0):
        _norm_dim(x, dim)
        return self._bypass("reduce_scatter", x)

    def all_to_all(self, x, dim=0, input_split_sizes=None, output_split_sizes=None):
        dim = _norm_dim(x, dim)
        self._check_single_piece("all_to_all", x, dim, "input_split_sizes", input_split_sizes)
        self._check_single_piece("all_to_all", x, dim, "output_split_sizes", output_split_sizes)
        return self._bypass("all_to_all", x)

    def barrier(self) -> None:
        pass  # nobody to wait for
