"""Test utilities shared across packages (multi-process gloo runs)."""

from modules.testing.multiproc import RankFailedError, find_free_port, run_distributed

__all__ = ["RankFailedError", "find_free_port", "run_distributed"]
