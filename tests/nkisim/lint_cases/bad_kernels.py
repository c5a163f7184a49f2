"""One kernel per rule; each offending line carries a unique '# <- tag' marker that the tests look up."""

import nki
import nki.isa as nisa
import nki.language as nl
from nki import isa as isa_ops
from nki.language import mgrid

from . import bad_helpers


@nki.jit
def kwonly_kernel(a,
                  *,
                  b):  # <- kwonly
    return a


@nki.jit
def is_kernel(a, b=None):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    if b is None:  # <- is
        return out
    return out


@nki.jit
def is_not_kernel(a, b=None):
    return [x for x in (a, b) if x is not None]  # <- is-not


@nki.jit
def helper_is_kernel(a):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    bad_helpers.scale_or_copy(out, a, 2.0)
    return out


class Options:  # <- options-class
    tile = 128


class Settings:  # <- settings-class
    def __init__(self, tile):
        self.tile = tile


SETTINGS = Settings(128)


class KernelConfigError(ValueError):
    pass


@nki.jit
def class_kernel(a):
    opts = Options()
    return a[0:opts.tile]


@nki.jit
def global_instance_kernel(a):
    if a.shape[0] > 4096:
        raise KernelConfigError("too many rows")  # exceptions only abort compilation: fine
    return a[0:SETTINGS.tile]


@nki.jit
def helper_class_kernel(a):
    return bad_helpers.PlainConfig(128).describe()


@nki.jit
def nested_class_kernel(a):
    class Holder(dict):  # <- nested-class
        pass

    return Holder


@nki.jit
def neuronxcc_helper_kernel(a):
    return bad_helpers.legacy_loader()


@nki.jit
def arange_kernel(a):
    t = nl.ndarray((128, 64), dtype=a.dtype, buffer=nl.sbuf)
    i_p = nl.arange(128)[:, None]  # <- arange
    nisa.dma_copy(dst=t, src=a[i_p, 0:64])
    return t


@nki.jit
def mgrid_kernel(a):
    i_p, i_f = mgrid[0:128, 0:64]  # <- mgrid
    return a[i_p, i_f]


@nki.jit
def isa_dtype_kernel(a):
    t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=t, src=a,
                     dtype=nl.bfloat16)  # <- isa-dtype
    return t


@nki.jit
def isa_mask_kernel(a):
    t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    nki.isa.activation(dst=t, op=nl.exp, data=a, mask=None)  # <- isa-mask
    return t


@nki.jit
def isa_alias_kernel(a):
    t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    isa_ops.memset(dst=t, value=0.0, dtype=nl.float32)  # <- isa-alias
    return t


@nki.jit
def isa_local_import_kernel(a):
    import nki.isa as local_isa

    t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    local_isa.iota(dst=t, pattern=[[1, 64]], mask=True)  # <- isa-local
    return t


@nki.jit
def other_kernel(a):
    return a


@nki.jit
def nested_jit_call_kernel(a):
    return other_kernel(a)  # <- jit-call


@nki.jit
def nested_jit_grid_kernel(a):
    return other_kernel[2](a)  # <- jit-grid


@nki.jit
def nested_jit_helper_kernel(a):
    return bad_helpers.calls_sub_kernel(a)


@nki.jit
def nested_jit_def_kernel(a):
    @nki.jit  # <- jit-def
    def inner(x):
        return x

    return a


@nki.jit
def dict_key_kernel(a):
    tiles = {"ok": a,
             0: a}  # <- dict-key
    return tiles["ok"]


@nki.jit
def dict_store_kernel(a):
    tiles = {}
    tiles["ok"] = a
    tiles[0] = a  # <- dict-store
    return tiles["ok"]


def _tile_rows(a):
    r = 0
    while r < a.shape[0]:
        yield r  # <- yield
        r += 128


def _all_rows(a):
    yield from _tile_rows(a)  # <- yield-from


@nki.jit
def generator_kernel(a):
    return [r for r in _all_rows(a)]


class Mixin:
    scale = 2.0


class Both(nl.NKIObject, Mixin):  # <- extra-base
    tile = 128


@nki.jit
def extra_base_kernel(a):
    return a[0:Both().tile]


@nki.jit
def nested_extra_base_kernel(a):
    class Pair(nl.NKIObject, tuple):  # <- nested-extra-base
        pass

    return Pair


@nki.jit
def list_default_kernel(img, stride=[1, 1]):  # noqa: B006 - the parser rule under test
    return img


@nki.jit
def dict_comp_key_kernel(a):
    by_index = {(i, 0): a for i in range(2)}  # <- dict-comp
    return by_index
