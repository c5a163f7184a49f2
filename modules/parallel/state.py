"""Create every process group a NeuronConfig (and optional VisionNeuronConfig) needs, with aliasing.

Groups are looked up in a cache keyed by their rank lists, so identical layouts share one GroupCoordinator:
components with equal dp_size alias each other, a component at dp_size 1 aliases the TP group, and the vision
TP group reuses the text TP group when the sizes match. All groups are created on every rank in the same
order (process-group creation is collective). Modules receive these groups explicitly; nothing here is global.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from modules.config import COMPONENT_DP_FIELDS, NeuronConfig, VisionNeuronConfig
from modules.parallel import rank_lists as rl
from modules.parallel.coordinator import CollectiveLog, GroupCoordinator

COMPONENTS = tuple(f.removesuffix("_dp_size") for f in COMPONENT_DP_FIELDS)


class GroupCache:
    """One GroupCoordinator per distinct rank-list layout."""

    def __init__(self, log: CollectiveLog, backend: str | None = None, emulate: Iterable[str] = ()) -> None:
        self.log, self.backend, self.emulate = log, backend, tuple(emulate)
        self._by_layout: dict[tuple[tuple[int, ...], ...], GroupCoordinator] = {}

    def get(self, group_ranks: Sequence[Sequence[int]], name: str) -> GroupCoordinator:
        key = tuple(tuple(g) for g in group_ranks)
        coord = self._by_layout.get(key)
        if coord is None:
            coord = GroupCoordinator(group_ranks, name, backend=self.backend, log=self.log, emulate=self.emulate)
            self._by_layout[key] = coord
        elif name not in coord.aliases:
            coord.aliases.append(name)
        return coord

    def __len__(self) -> int:
        return len(self._by_layout)


@dataclass
class ComponentGroups:
    """A component's two groups: ``tp`` shards its weights (TP × component_dp ranks, passed to the module as
    its tp_group); ``dp`` is its DP column (component_dp ranks), used by dp_transition to move batch rows."""

    tp: GroupCoordinator
    dp: GroupCoordinator


@dataclass
class ParallelState:
    config: NeuronConfig
    world: GroupCoordinator
    tp: GroupCoordinator
    dp: GroupCoordinator
    attention: ComponentGroups
    embedding: ComponentGroups
    mlp: ComponentGroups
    lm_head: ComponentGroups
    local: GroupCoordinator  # size-1 self group: "gathered at local" = this replica's own batch
    vision_tp: GroupCoordinator | None
    vision_dp: GroupCoordinator | None
    log: CollectiveLog
    cache: GroupCache

    def component(self, name: str) -> ComponentGroups:
        if name not in COMPONENTS:
            raise ValueError(f"unknown component {name!r}; choose from {COMPONENTS}")
        return getattr(self, name)


def initialize_parallel_state(config: NeuronConfig, vision: VisionNeuronConfig | None = None,
                              backend: str | None = None, log: CollectiveLog | None = None,
                              emulate: Iterable[str] = ()) -> ParallelState:
    """Build all groups for this process. torch.distributed must already be initialized."""
    if not dist.is_initialized():
        raise RuntimeError("initialize_parallel_state: torch.distributed is not initialized")
    world_size = dist.get_world_size()
    config.validate_world_size(world_size)
    tp = config.tp_size
    log = log if log is not None else CollectiveLog()
    cache = GroupCache(log, backend=backend, emulate=emulate)

    world = cache.get([list(range(world_size))], "world")
    tp_group = cache.get(rl.build_tp_group_ranks(world_size, tp), "tp")
    dp_group = cache.get(rl.build_dp_group_ranks(world_size, tp), "dp")
    components = {}
    for name in COMPONENTS:
        size = getattr(config, f"{name}_dp_size")
        components[name] = ComponentGroups(
            tp=cache.get(rl.build_component_tp_group_ranks(world_size, tp, size), f"{name}_tp"),
            dp=cache.get(rl.build_dp_column_group_ranks(world_size, tp, size), f"{name}_dp"),
        )

    vision_tp = vision_dp = None
    if vision is not None:
        vtp, vdp = vision.resolve_tp_dp(world_size)
        # Same size → the text TP group is reused, no new group (the vision seed's rule).
        vision_tp = tp_group if vtp == tp else cache.get(rl.build_vision_tp_group_ranks(world_size, vtp), "vision_tp")
        # Vision DP column groups exist only when dp > 1 (at dp 1 there is nothing to scatter or gather).
        vision_dp = cache.get(rl.build_vision_dp_group_ranks(world_size, vtp, vdp), "vision_dp") if vdp > 1 else None

    local = cache.get(rl.build_dp_column_group_ranks(world_size, tp, 1), "local")
    return ParallelState(config=config, world=world, tp=tp_group, dp=dp_group, local=local, vision_tp=vision_tp,
                         vision_dp=vision_dp, log=log, cache=cache, **components)
