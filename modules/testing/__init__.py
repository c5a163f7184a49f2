"""Test utilities shared across packages (multi-process gloo runs)."""

from modules.testing.multiproc import RankFailedError, find_free_port, run_distributed
from modules.testing.numerics import assert_close_global

__all__ = ["RankFailedError", "assert_close_global", "find_free_port", "run_distributed"]
