"""`os.environ.get` for the interpreter's hot paths (read on every instruction or allocation).

CPython's `os.environ.get` encodes the key and goes through the Mapping machinery on every call (about a
microsecond); this reads os.environ's underlying dict with the key encoded once. Same value, still read each call,
so a variable set while the process runs (tests' monkeypatch.setenv) takes effect at once. Falls back to
`os.environ.get` where os.environ is not CPython's `os._Environ`.
"""

import os

_KEYS = {}


def get(name, default=None):
    env = os.environ
    data = getattr(env, "_data", None)
    if data is None:
        return env.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        try:
            key = _KEYS[name] = env.encodekey(name)
        except AttributeError:
            return env.get(name, default)
    raw = data.get(key)
    return default if raw is None else env.decodevalue(raw)
