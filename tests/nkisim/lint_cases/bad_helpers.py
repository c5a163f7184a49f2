"""Helpers in a second user module that break the rules (reported with this file and line)."""

import nki
import nki.isa as nisa
import nki.language as nl


def scale_or_copy(dst, src, scale):
    if scale is not None:  # <- helper-is
        nisa.tensor_scalar(dst=dst, data=src, op0=nl.multiply, operand0=scale)
    else:
        nisa.tensor_copy(dst=dst, src=src)


def legacy_loader():
    from neuronxcc import nki as legacy_nki  # <- helper-neuronxcc

    return legacy_nki


class PlainConfig:  # <- plain-class
    def __init__(self, tile):
        self.tile = tile

    def describe(self):
        return self.tile is None  # <- method-is


@nki.jit
def sub_kernel(x):
    return x


def calls_sub_kernel(x):
    return sub_kernel(x)  # <- helper-jit-call
