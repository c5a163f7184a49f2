"""Hand-written NKI kernels with their torch references.

Importing this package registers the lower layer: `nkisim.install()` serves `import nki` from the CPU interpreter
unless AWS's real `nki` package is importable (or `NKISIM=1` forces the interpreter).
"""

import nkisim

nkisim.install()
