"""Small kernels (valid and offending) for tests/nkisim/test_lint.py; loaded as a package by the tests."""
