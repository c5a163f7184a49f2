"""Fixtures of the nkisim conformance suite (fresh default core per test, target switching)."""

from .._sim import fresh_core, on_target  # noqa: F401
