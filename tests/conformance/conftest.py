"""Conformance suite against AWS's nki-library: skipped (with the reason) unless NKILIB_SRC names a checkout."""

import pytest

from bench.peers import nkilib

from . import harness


def pytest_collection_modifyitems(config, items):
    reason = nkilib.skip_reason()
    for item in items:
        if reason and item.get_closest_marker("nkilib"):
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_configure(config):
    config.addinivalue_line("markers", "nkilib: needs NKILIB_SRC (a checkout of aws-neuron/nki-library)")


def pytest_terminal_summary(terminalreporter):
    if harness.RESULTS:
        terminalreporter.section("nki-library conformance (nkisim vs the library's torch references)")
        terminalreporter.write_line(harness.table(harness.RESULTS))
