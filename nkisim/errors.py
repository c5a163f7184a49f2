"""Exceptions and warnings raised by the interpreter.

`NkiValidationError` is the one the real `nki.isa` exposes ("raised when hardware constraints are violated"); every
constraint check in nkisim raises it with a message naming the op, the operand and the limit.
"""


class NkiValidationError(Exception):
    """A hardware or API constraint was violated (the op, the operand and the limit are named in the message)."""


class NkiCapacityError(NkiValidationError):
    """Live SBUF bytes per partition or PSUM banks exceed the capacity (checked beyond the official simulator)."""


class NkiPsumAccumulationWarning(UserWarning):
    """Matmul accumulation pattern that is correct in language semantics but known to misbehave on hardware."""


class NkiUninitializedReadWarning(UserWarning):
    """An accumulate=True matmul read PSUM that no matmul had written (undefined behaviour on hardware)."""


class NkiTensorTruthWarning(UserWarning):
    """`if tile:` / `bool(tile)` on an NkiTensor: a presence test (always True), never a test of the device data."""
