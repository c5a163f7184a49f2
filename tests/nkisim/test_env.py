"""nkisim._env.get: os.environ.get for the interpreter's hot paths, read from os.environ's dict on every call."""

import os

import pytest

from nkisim import _env
from nkisim import dtypes as dt

NAME = "NKISIM_TEST_ENV_PROBE"


@pytest.mark.parametrize("value", ["1", "", "fp64", " zero ", "caf\u00e9", "bad\udcff bytes", "a=b;c"])
def test_get_is_os_environ_get(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    assert _env.get(NAME) == os.environ.get(NAME) == value
    assert _env.get(NAME, "default") == value           # an empty value is a value, not the default


def test_changes_while_running_are_seen_at_once(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert _env.get(NAME) is None
    assert _env.get(NAME, "d") == "d"
    for v in ("a", "b", "a"):
        monkeypatch.setenv(NAME, v)
        assert _env.get(NAME, "d") == v
    monkeypatch.delenv(NAME)
    assert _env.get(NAME, "d") == "d"
    os.environ[NAME] = "direct"                          # not through monkeypatch
    try:
        assert _env.get(NAME) == "direct"
    finally:
        del os.environ[NAME]
    assert _env.get(NAME) is None


def test_falls_back_to_a_plain_mapping(monkeypatch):
    """Where os.environ is not CPython's os._Environ (no _data), the mapping's own get is used."""
    monkeypatch.setattr(os, "environ", {NAME: "plain"})
    assert _env.get(NAME) == "plain"
    assert _env.get("NKISIM_TEST_ENV_ABSENT", 7) == 7


def test_hot_env_reads_follow_the_environment(monkeypatch):
    monkeypatch.setenv("NKI_PRECISE_FP", "0")
    assert dt.storage_dtype(dt.bfloat16) == dt.float32.np
    monkeypatch.setenv("NKI_PRECISE_FP", "1")
    assert dt.storage_dtype(dt.bfloat16) == dt.bfloat16.np
    monkeypatch.setenv("NKISIM_UNINIT", " Zero ")
    assert dt.sentinel(dt.float32) == 0
    monkeypatch.delenv("NKISIM_UNINIT")
    assert dt.sentinel(dt.float32) != dt.sentinel(dt.float32)     # NaN
    assert dt.sentinel(dt.int32) == 4
