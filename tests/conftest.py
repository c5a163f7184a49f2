"""Test-wide setup: serve `import nki` from nkisim unless the real package is installed (NKISIM=1 forces it)."""

import nkisim

nkisim.install()
