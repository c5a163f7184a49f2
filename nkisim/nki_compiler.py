"""`nki.compiler`: the per-kernel configuration objects of `@nki.jit` (NKI 0.7, AWS's nki.compiler page, v2.33.1).

`CompileConfig` holds options of the downstream compiler (address_rotation, non_ssa_legalization, dead_code_elim,
barrier_check); the interpreter has no backend, so they are carried and compared, not acted on.
`SpecializationConfig.allow_nested_config_override` is honoured: when a nested @nki.jit sub-kernel's config differs
from the top-level kernel's, the sub-kernel is inlined with a warning instead of an error.
Fields left out stay `...` (AWS shows `Ellipsis` as the default: "not set").
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class CompileConfig:
    """Per-kernel compile configuration passed to `@nki.jit(compile_config=...)`."""

    address_rotation: object = ...
    non_ssa_legalization: object = ...
    dead_code_elim: object = ...
    barrier_check: object = ...


@dataclass(frozen=True)
class SpecializationConfig:
    """Per-kernel specialization-time config passed to `@nki.jit(specialization_config=...)`."""

    allow_nested_config_override: object = ...
