"""Which NKI frontend the interpreter emulates: 0.7 tracing (the default) or the legacy 0.6 parser.

NKI 0.7 (Neuron 2.33) specializes kernels by tracing them with Python; `NKI_COMPILER_FRONTEND=custom` keeps the
previous parser-based specialization (deprecated in 2.33, removed in the next release). The frontend decides:
- the Python-subset rules of the parser (nkisim.lint.PARSER_RULES), enforced only under the parser;
- what a `VirtualRegister` does in Python control flow: under tracing its value is not known while the kernel is
  built, so `if reg:` / `while reg:` / `int(reg)` / `range(reg)` raise TypeError (AWS's VirtualRegister page);
  under the parser `while reg:` is a runtime loop on the register and `nl.dynamic_range` exists (0.6 semantics);
- whether tracer-only APIs exist (`nisa.scalar_load` / `scalar_store`: "The parser frontend rejects the call").

The environment is read at each use (tests switch it with monkeypatch), never cached.
"""

import os

FRONTEND_ENV = "NKI_COMPILER_FRONTEND"


def parser_frontend() -> bool:
    """True when `NKI_COMPILER_FRONTEND=custom` selects the legacy (0.6) parser; the default is 0.7 tracing."""
    return os.environ.get(FRONTEND_ENV, "").strip().lower() == "custom"
