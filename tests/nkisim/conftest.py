"""Frontend-selection fixtures of the modules that check both NKI frontends. `tracing` is opt-in per module
(`pytestmark = pytest.mark.usefixtures("tracing")`) so that the other modules keep the caller's environment."""

import pytest


@pytest.fixture
def tracing(monkeypatch):
    """The default (0.7 tracing) frontend, whatever the caller's environment says."""
    monkeypatch.delenv("NKI_COMPILER_FRONTEND", raising=False)


@pytest.fixture
def parser(monkeypatch):
    """Select the legacy parser frontend (NKI_COMPILER_FRONTEND=custom), whose Python-subset rules are then enforced."""
    monkeypatch.setenv("NKI_COMPILER_FRONTEND", "custom")
