"""Names and behaviours of the nki API that AWS's nki-library relies on (issue 9 §2), each checked against AWS's
stubs/docs: nki.dtype, nki.isa.constants, ordered nc_version, NKIObject keyword construction, str() of dtypes,
shared_identity_matrix in SBUF, raw-int dge_mode, neuronxcc.nki.typing, nl.range / nl.bool, .ap(dtype=...)."""

import importlib
import importlib.util
import sys
from dataclasses import dataclass

import numpy as np
import pytest

from nkisim.errors import NkiValidationError
from nkisim.tensor import read

from ._sim import fresh_core, hbm, nisa, nl, sb, tile  # noqa: F401


def test_nki_dtype_is_the_type_of_nl_dtypes():
    import nki
    assert isinstance(nl.bfloat16, nki.dtype) and isinstance(nl.int32, nki.dtype)


def test_isa_constants_module_importable_and_same_enums():
    constants = importlib.import_module("nki.isa.constants")
    from nki.isa.constants import dge_mode, matmul_perf_mode, oob_mode  # noqa: F401
    assert constants.oob_mode is nisa.oob_mode and constants.dge_mode is nisa.dge_mode
    assert constants.matmul_perf_mode.double_row is nisa.matmul_perf_mode.double_row
    assert constants.engine.tensor is nisa.engine.tensor
    assert sys.modules["nki.isa.constants"] is constants


def test_nc_version_members_are_ordered_and_compare_with_ints():
    v = nisa.nc_version
    assert v.gen2 <= v.gen3 < v.gen4 and v.gen4 >= v.gen3
    assert v.gen3 >= 3 and v.gen3 < 4 and v.gen2 <= 2
    assert nisa.get_nc_version() >= v.gen3 and nisa.get_nc_version() >= 3
    assert not (nisa.get_nc_version() <= v.gen2)


def test_str_of_dtypes_is_the_plain_name():
    assert str(nl.bfloat16) == "bfloat16" and str(nl.float32) == "float32"
    assert str(nl.float8_e4m3) == "float8_e4m3" and str(nl.bool_) == "bool"
    assert str(nl.bfloat16) != str(nl.float32)
    assert nl.bool_ == "bool" and nl.bfloat16 == "bfloat16" and nl.bfloat16 != "float32"


def test_nl_bool_and_nl_range():
    assert nl.bool is nl.bool_
    assert list(nl.range(3)) == [0, 1, 2] and list(nl.range(1, 7, 2)) == [1, 3, 5]


class _Dims(nl.NKIObject):
    B: int
    H: int
    T: int = 7


class _WithInit(nl.NKIObject):
    def __init__(self, a=1):
        self.a = a


@dataclass(frozen=True)
class _Frozen(nl.NKIObject):
    k: int
    sorted: bool = True


def test_nkiobject_keyword_construction():
    d = _Dims(B=2, H=64)
    assert (d.B, d.H, d.T) == (2, 64, 7)
    omitted = _Dims(B=1)
    assert omitted.H is None and omitted.T == 7  # omitted annotated field without default reads as None
    extra = nl.NKIObject(x=3)
    assert extra.x == 3
    assert _WithInit(a=5).a == 5 and _WithInit().a == 1
    f = _Frozen(k=8)
    assert f.k == 8 and f.sorted is True and hash(f) == hash(_Frozen(k=8))
    # dataclass fields are optional too: the nki-library's @dataclass MLPTKGConstantsDimensionSizes(nl.NKIObject) is
    # built without its `remainderIFused` field on every moe_tkg / mlp_tkg call (core/mlp/mlp_tkg/mlp_tkg_constants.py)
    assert _Frozen().k is None and _Frozen().sorted is True


@dataclass
class _Unannotated(nl.NKIObject):
    idx = None      # class attributes without annotations: @dataclass generates an __init__() with no parameters
    offset = None


def test_nkiobject_dataclass_takes_keywords_for_class_attributes():
    """The nki-library builds such a class with keywords (SectionParams, core/attention/attention_cte.py)."""
    sp = _Unannotated(idx=3, offset=128)
    assert (sp.idx, sp.offset) == (3, 128)
    assert _Unannotated().idx is None
    with pytest.raises(TypeError):
        _Unannotated(undeclared=1)  # a keyword naming nothing the class declares is still an error


def test_plain_dataclass_keeps_its_required_fields():
    @dataclass
    class Plain:
        k: int

    with pytest.raises(TypeError):
        Plain()  # only NKIObject subclasses relax the rule


def test_shared_identity_matrix_is_an_sbuf_operand():
    eye = nl.shared_identity_matrix(128, dtype=nl.float32)
    assert eye.buffer is nl.sbuf and eye.shape == (128, 128)
    x = np.arange(128 * 4, dtype=np.float32).reshape(128, 4)
    ps = tile((4, 128), buffer=nl.psum)
    # transpose via matmul with the identity as moving operand, as AWS's find_nonzero_indices does
    nisa.nc_matmul(dst=ps, stationary=sb(x), moving=eye[0:128, 0:128])
    np.testing.assert_array_equal(read(ps), x.T)


def test_raw_int_dge_mode_accepted_bad_int_rejected():
    a = sb(np.ones((4, 4), np.float32))
    h = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=h, src=a, dge_mode=3)  # AWS's norm_tkg_utils passes _DGE_MODE_NONE = 3
    np.testing.assert_array_equal(read(h), np.ones((4, 4)))
    with pytest.raises(NkiValidationError, match=r"dma_copy.*dge_mode=9.*none=3"):
        nisa.dma_copy(dst=h, src=a, dge_mode=9)
    with pytest.raises(NkiValidationError, match=r"dge_mode"):
        nisa.dma_copy(dst=h, src=a, dge_mode="hwdge")


def test_neuronxcc_typing_importable_but_not_the_legacy_language():
    import neuronxcc.nki.typing as nt
    assert nt.mutable_tensor is not None and nt.tensor[128, 4].shape == (128, 4)
    with pytest.raises(ImportError):
        importlib.import_module("neuronxcc.nki.language")

    assert importlib.util.find_spec("neuronxcc") is not None  # probing code keeps working


def test_ap_dtype_strides_in_units_of_the_new_dtype():
    x = np.arange(128 * 8, dtype=np.float32).reshape(128, 8)  # 8 fp32 = 16 bf16 per partition
    t = sb(x)
    v = t.ap(pattern=[[16, 128], [2, 8]], dtype=nl.bfloat16)  # every other bf16 half: the low halves
    lo = x.view(np.uint32) & 0xFFFF
    np.testing.assert_array_equal(read(v).view(np.uint16), lo.astype(np.uint16))
    with pytest.raises(NkiValidationError, match=r"partition stride 8"):
        t.ap(pattern=[[8, 128], [1, 8]], dtype=nl.bfloat16)
