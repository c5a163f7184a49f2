"""NKI 0.7 (tracer frontend, the default) versus the legacy parser (NKI_COMPILER_FRONTEND=custom).

Every 0.7 construct is exercised under the default frontend; every parser behaviour under
`monkeypatch.setenv("NKI_COMPILER_FRONTEND", "custom")`. Facts are AWS's pages (cited per test).
"""

import math
import warnings

import nki
import numpy as np
import pytest

from nkisim.errors import NkiTensorTruthWarning, NkiValidationError

from ._sim import fresh_core, hbm, nisa, nl, rd, sb, tile  # noqa: F401

pytestmark = pytest.mark.usefixtures("tracing")   # every test starts under the 0.7 frontend (conftest)


def int_tile(value, buffer=None):
    return sb(np.array([[value]], np.int32), buffer=buffer)


# ---- NkiScalar, scalar_load, scalar_store (nki.isa.NkiScalar / scalar_load / scalar_store pages) --------------

def test_scalar_load_arithmetic_store_roundtrip():
    """The AWS example: i = scalar_load(index_tile); i = i * 4 + 1; scalar_store(result, i)."""
    i = nisa.scalar_load(int_tile(5))
    assert isinstance(i, nisa.NkiScalar) and i.dtype == nl.int32
    j = i * 4 + 1
    k = 100 - (-j) * 2          # reflected and unary operators
    out = tile((1, 1), nl.int32)
    nisa.scalar_store(out, j)
    assert rd(out)[0, 0] == 21
    nisa.scalar_store(out, k)
    assert rd(out)[0, 0] == 142


def test_scalar_int32_arithmetic_wraps():
    """'100000 * 100000 yields 1410065408, and adding 1 to the largest nl.int32 yields the smallest.'"""
    big = nisa.scalar_load(int_tile(100000))
    assert (big * 100000).value == 1410065408
    top = nisa.scalar_load(int_tile(2 ** 31 - 1))
    assert (top + 1).value == -(2 ** 31)


def test_scalar_has_no_python_value_while_traced():
    i = nisa.scalar_load(int_tile(3))
    with pytest.raises(TypeError, match=r"no value while the kernel is traced"):
        bool(i)
    with pytest.raises(TypeError, match=r"no value while the kernel is traced"):
        int(i)
    with pytest.raises(TypeError, match=r"no value while the kernel is traced"):
        range(i)


def test_scalar_comparison_is_traced_but_unusable():
    i = nisa.scalar_load(int_tile(3))
    c = i < 4
    assert isinstance(c, nisa.NkiScalar) and c.is_comparison
    with pytest.raises(TypeError, match=r"comparison is traced but cannot be used"):
        c + 1
    with pytest.raises(TypeError, match=r"comparison is traced but cannot be used"):
        nisa.scalar_store(tile((1, 1), nl.int32), c)
    with pytest.raises(TypeError, match=r"comparison is traced but cannot be used"):
        nl.fori_loop(0, c, lambda k: None)


def test_scalar_undocumented_operators_and_mixed_operands_rejected():
    i = nisa.scalar_load(int_tile(8))
    with pytest.raises(TypeError, match=r"not documented"):
        i // 2
    with pytest.raises(TypeError, match=r"not documented"):
        i % 3
    with pytest.raises(TypeError):
        i + 1.5
    with pytest.raises(TypeError, match=r"not a VirtualRegister"):
        i + nisa.register_alloc(1)
    with pytest.raises(TypeError, match=r"does not fit"):
        i * 2 ** 40
    i2 = i * 2          # positive twin: int operands within 32 bits
    assert i2.value == 16


@pytest.mark.parametrize("case, pattern", [
    ("psum", r"SBUF or HBM"),
    ("shape", r"1x1 tensor"),
    ("uint32", r"unsigned dtypes are not accepted"),
    ("float", r"nl.int32 or nl.int64"),
])
def test_scalar_load_source_rules(case, pattern):
    src = {
        "psum": lambda: int_tile(1, buffer=nl.psum),
        "shape": lambda: sb(np.zeros((1, 2), np.int32)),
        "uint32": lambda: sb(np.zeros((1, 1), np.uint32)),
        "float": lambda: sb(np.zeros((1, 1), np.float32)),
    }[case]()
    with pytest.raises(NkiValidationError, match=pattern):
        nisa.scalar_load(src)


def test_scalar_load_from_hbm_and_sbuf():
    assert nisa.scalar_load(hbm(np.array([[7]], np.int32))).value == 7
    assert nisa.scalar_load(int_tile(-7)).value == -7


def test_scalar_store_rules():
    out = tile((1, 1), nl.int32)
    with pytest.raises(NkiValidationError, match=r"must be an NkiScalar.*nisa.memset"):
        nisa.scalar_store(out, 3)
    with pytest.raises(NkiValidationError, match=r"nl.int32 or nl.int64"):
        nisa.scalar_store(tile((1, 1), nl.float32), nisa.scalar_load(int_tile(1)))
    nisa.scalar_store(out, nisa.scalar_load(int_tile(9)))
    assert rd(out)[0, 0] == 9


def test_scalar_calls_rejected_by_parser(parser):
    """'Only the tracer frontend supports this. The parser frontend rejects the call.'"""
    with pytest.raises(NkiValidationError, match=r"only by the tracer frontend"):
        nisa.scalar_load(int_tile(1))
    with pytest.raises(NkiValidationError, match=r"only by the tracer frontend"):
        nisa.scalar_store(tile((1, 1), nl.int32), nisa.NkiScalar(1))


# ---- nl.int64 (nki.isa.scalar_load / scalar_store / NkiScalar pages, "NKI Scalar Values") ---------------------------

BIG = 2 ** 40 + 3          # needs more than 32 bits


def int64_tile(value):
    t = tile((1, 1), nl.int64)
    nisa.dma_copy(dst=t, src=nl.shared_constant(np.array([[value]], np.int64)))
    return t


def test_int64_scalar_load_and_store_without_truncation():
    """'scalar_load accepts nl.int64, and the value is not truncated. An int64 scalar can be written back with
    nki.isa.scalar_store()'; at 64 bits +, - and * are available."""
    i = nisa.scalar_load(int64_tile(BIG))
    assert i.dtype == nl.int64 and i.value == BIG
    out = tile((1, 1), nl.int64)
    nisa.scalar_store(out, i * 4 - 1)
    assert rd(out)[0, 0] == BIG * 4 - 1 and rd(out).dtype == np.int64


def test_int64_scalar_store_width_must_match():
    """'dst must have the same width as value' in both directions."""
    with pytest.raises(NkiValidationError, match=r"width of value"):
        nisa.scalar_store(tile((1, 1), nl.int64), nisa.scalar_load(int_tile(1)))
    with pytest.raises(NkiValidationError, match=r"width of value"):
        nisa.scalar_store(tile((1, 1), nl.int32), nisa.scalar_load(int64_tile(1)))


def test_int64_scalar_comparison_and_loop_bound_rejected():
    """Comparisons: 'Rejected at compile time' at 64 bits; fori_loop bound: 'Not supported'. Twin: int32 ones."""
    i64, i32 = nisa.scalar_load(int64_tile(3)), nisa.scalar_load(int_tile(3))
    with pytest.raises(TypeError, match=r"nl.int64 scalars are rejected"):
        i64 < 5  # noqa: B015
    assert (i32 < 5).is_comparison
    with pytest.raises(NkiValidationError, match=r"nl.fori_loop.*32-bit"):
        nl.fori_loop(0, i64, lambda it: None)
    seen = []
    nl.fori_loop(0, i32, lambda it: seen.append(it))
    assert len(seen) == 3


def test_int64_scalar_offset_on_hbm_only():
    """'A scalar of either dtype can be used as a scalar_offset ... on an SBUF or PSUM operand the offset must be
    nl.int32.'"""
    data = hbm(np.arange(8 * 4, dtype=np.float32).reshape(8, 4))
    row = tile((1, 4))
    nisa.dma_copy(dst=row, src=data.ap([[4, 1], [1, 4]], scalar_offset=nisa.scalar_load(int64_tile(5)),
                                       indirect_dim=0))
    assert rd(row).tolist() == [[20.0, 21.0, 22.0, 23.0]]
    on_chip = sb(np.arange(4 * 8, dtype=np.float32).reshape(4, 8))
    with pytest.raises(NkiValidationError, match=r"nl.int64 offset cannot address on-chip"):
        on_chip.ap([[8, 4], [1, 2]], scalar_offset=nisa.scalar_load(int64_tile(1)), indirect_dim=1)
    with pytest.raises(NkiValidationError, match=r"nl.ds start: an nl.int64 offset cannot address on-chip"):
        on_chip[:, nl.ds(nisa.scalar_load(int64_tile(1)), 2)]
    assert rd(data[nl.ds(nisa.scalar_load(int64_tile(2)), 1)]).tolist() == [[8.0, 9.0, 10.0, 11.0]]
    twin = tile((4, 2))
    nisa.tensor_copy(dst=twin, src=on_chip.ap([[8, 4], [1, 2]], scalar_offset=nisa.scalar_load(int_tile(3)),
                                              indirect_dim=1))
    assert rd(twin)[:, 0].tolist() == [3.0, 11.0, 19.0, 27.0]


def test_int64_moves_by_dma_but_not_through_compute_engines():
    """'Unlike the compute instructions, scalar_load accepts nl.int64': DMA moves int64 exactly, engines refuse it."""
    src = nl.shared_constant(np.array([[BIG, -BIG]], np.int64))
    t = tile((1, 2), nl.int64)
    nisa.dma_copy(dst=t, src=src)
    assert rd(t).tolist() == [[BIG, -BIG]]
    with pytest.raises(NkiValidationError, match=r"tensor_copy.*nl.int64; compute instructions"):
        nisa.tensor_copy(dst=tile((1, 2), nl.int64), src=t)
    with pytest.raises(NkiValidationError, match=r"nl.int64; compute instructions"):
        nisa.tensor_copy(dst=tile((1, 2), nl.int32), src=t)
    i32 = tile((1, 2), nl.int32)
    nisa.tensor_copy(dst=i32, src=sb(np.array([[7, -7]], np.int32)))
    assert rd(i32).tolist() == [[7, -7]]


def test_int64_kernel_argument():
    """NumPy/torch int64 arrays are nl.int64 kernel arguments (float64 still has no NKI dtype)."""
    @nki.jit
    def first(idx):
        t = nl.ndarray((1, 1), dtype=nl.int64, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=idx)
        out = nl.ndarray((1, 1), dtype=nl.int64, buffer=nl.shared_hbm)
        nisa.scalar_store(t, nisa.scalar_load(t) + 1)
        nisa.dma_copy(dst=out, src=t)
        return out

    got = first(np.array([[BIG]], np.int64))
    assert got.dtype == np.int64 and got[0, 0] == BIG + 1


# ---- nl.fori_loop (nki.language.fori_loop page, v2.33.0) -------------------------------------------------------------

def test_fori_loop_variable_is_a_scalar_with_arithmetic_in_addressing():
    """i * 4 + 1 in nl.ds, in a Python slice, as an integer index and as an .ap scalar_offset."""
    x = hbm(np.arange(64 * 4, dtype=np.float32).reshape(64, 4))
    acc = {name: sb(np.zeros((1, 4), np.float32)) for name in ("ds", "slice", "index", "ap")}
    kinds = []

    def body(i):
        kinds.append(type(i))
        r = i * 4 + 1
        for name, view in (("ds", x[nl.ds(r, 1), :]), ("slice", x[r:r + 1, :]), ("index", x[r, :]),
                           ("ap", x.ap([[4, 1], [1, 4]], scalar_offset=r))):
            row = tile((1, 4))
            nisa.dma_copy(dst=row, src=view)
            nisa.tensor_tensor(dst=acc[name], data1=acc[name], data2=row, op=nl.add)

    nl.fori_loop(0, 3, body)
    assert kinds == [nisa.NkiScalar] * 3
    want = np.arange(64 * 4).reshape(64, 4)[[1, 5, 9]].sum(0)
    for name in acc:
        np.testing.assert_array_equal(rd(acc[name])[0], want, err_msg=name)


def test_scalar_slice_needs_a_size_known_while_tracing():
    x = hbm(np.arange(64, dtype=np.float32).reshape(64, 1))
    i = nisa.scalar_load(int_tile(2))
    r = i * 8
    assert x[r + 1:r + 5, :].shape == (4, 1)           # stop = start + constant: size 4
    with pytest.raises(IndexError, match=r"not known while the kernel is traced.*nl.ds"):
        x[i * 8:(i + 1) * 8, :]                         # two different products: size unknown while tracing
    with pytest.raises(IndexError, match=r"not known while the kernel is traced"):
        x[r:40, :]                                      # device start, constant stop
    with pytest.raises(IndexError, match=r"not known while the kernel is traced"):
        x[r:r + 4:2, :]                                 # a step other than 1


def test_fori_loop_bounds_from_scalars_and_registers():
    x = hbm(np.arange(16, dtype=np.float32).reshape(16, 1))
    seen = []
    n = nisa.scalar_load(int_tile(3))
    nl.fori_loop(n - 2, n * 2, lambda i: seen.append((type(i), i.value)))     # bounds are NkiScalar expressions
    assert seen == [(nisa.NkiScalar, v) for v in range(1, 6)]
    seen.clear()
    reg = nisa.register_alloc(3)

    def body(i):
        seen.append((type(i), i.value))
        t = tile((1, 1))
        nisa.dma_copy(dst=t, src=x[nl.ds(i, 1), :])

    nl.fori_loop(0, reg, body)     # a VirtualRegister bound: the body gets a VirtualRegister
    assert seen == [(nisa.VirtualRegister, v) for v in range(3)]


def test_fori_loop_bound_must_not_be_a_tensor():
    """fori_loop page: lower / upper are an int, a VirtualRegister or an NkiScalar."""
    n = int_tile(3)
    with pytest.raises(NkiValidationError, match=r"upper is a tensor.*nisa.scalar_load"):
        nl.fori_loop(0, n, lambda i: None)
    seen = []
    nl.fori_loop(0, nisa.scalar_load(n), lambda i: seen.append(i.value))     # the twin: load it first
    assert seen == [0, 1, 2]


def test_fori_loop_body_gets_register_under_parser(parser):
    seen = []
    nl.fori_loop(0, 2, lambda i: seen.append(type(i)))
    assert seen == [nisa.VirtualRegister] * 2


def test_fori_loop_step_must_be_positive_compile_time_int():
    with pytest.raises(NkiValidationError, match=r"positive compile-time int"):
        nl.fori_loop(0, 4, lambda i: None, step=nisa.register_alloc(1))
    with pytest.raises(NkiValidationError, match=r"positive compile-time int"):
        nl.fori_loop(0, 4, lambda i: None, step=0)
    seen = []
    nl.fori_loop(0, 4, lambda i: seen.append(i.value), step=2)
    assert seen == [0, 2]


# ---- tensors allocated inside a runtime-loop body are not usable after it --------------------------------------------

def test_tensor_allocated_in_fori_loop_body_unusable_after_loop():
    keep = []

    def body(i):
        t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf, name="scratch")
        nisa.memset(dst=t, value=1.0)
        keep.append(t)

    nl.fori_loop(0, 1, body)
    line = body.__code__.co_firstlineno + 1
    with pytest.raises(NkiValidationError, match=rf"'scratch' was allocated at .*test_frontend.py:{line} inside the "
                                                 r"body of nl.fori_loop.*allocate it before the loop"):
        nisa.memset(dst=keep[0], value=0.0)


def test_tensor_from_a_previous_iteration_is_unusable():
    """The body is traced once: a tile carried in Python from iteration k to k+1 does not exist on the device."""
    carried = []

    def body(i):
        t = tile((1, 4))
        nisa.memset(dst=t, value=0.0)
        if carried:
            nisa.tensor_copy(dst=t, src=carried[-1])
        carried.append(t)

    with pytest.raises(NkiValidationError, match=r"inside the body of nl.fori_loop"):
        nl.fori_loop(0, 2, body)


def test_tensor_allocated_before_the_loop_is_usable_inside_and_after():
    acc = sb(np.zeros((1, 4), np.float32))

    def body(i):
        one = tile((1, 4))
        nisa.memset(dst=one, value=1.0)
        nisa.tensor_tensor(dst=acc, data1=acc, data2=one, op=nl.add)

    nl.fori_loop(0, 3, body)
    out = tile((1, 4))
    nisa.tensor_copy(dst=out, src=acc)
    np.testing.assert_array_equal(rd(out), np.full((1, 4), 3.0, np.float32))


def test_tensor_allocated_in_while_loop_body_unusable_after_loop():
    keep = []

    def body(r):
        t = tile((1, 1))
        nisa.memset(dst=t, value=0.0)
        keep.append(t)
        nisa.register_move(r, 0)
        return r

    nl.while_loop(nisa.register_alloc(1), body)
    with pytest.raises(NkiValidationError, match=r"inside the body of nl.while_loop"):
        nisa.memset(dst=keep[0], value=2.0)


# ---- registers in Python control flow (VirtualRegister page, v2.32.0 note) -------------------------------------------

@pytest.mark.parametrize("use", ["if", "while", "int", "range"])
def test_register_in_python_control_flow_is_a_type_error(use):
    reg = nisa.register_alloc(2)
    with pytest.raises(TypeError, match=r"nl.fori_loop.*nl.while_loop"):
        if use == "if":
            if reg:
                pass
        elif use == "while":
            while reg:
                break
        elif use == "int":
            int(reg)
        else:
            range(reg)


def test_bare_while_reg_loops_on_the_register_under_parser(parser):
    """0.6: `while reg:` runs while the register is nonzero (it used to loop forever in nkisim)."""
    flag = sb(np.array([[1]], np.int32))
    reg = nisa.register_alloc()
    nisa.register_load(reg, flag)
    trips = 0
    while reg:
        trips += 1
        nisa.memset(dst=flag, value=0 if trips == 3 else 1)
        nisa.register_load(reg, flag)
        assert trips <= 3
    assert trips == 3
    assert int(nisa.register_alloc(5)) == 5 and list(range(nisa.register_alloc(2))) == [0, 1]


def test_dynamic_range_rejected_by_tracer_kept_by_parser(monkeypatch):
    with pytest.raises(TypeError, match=r"nl.dynamic_range is not supported by the NKI 0.7 tracer.*nl.fori_loop"):
        nl.dynamic_range(nisa.register_alloc(3))
    monkeypatch.setenv("NKI_COMPILER_FRONTEND", "custom")
    assert list(nl.dynamic_range(1, nisa.register_alloc(3))) == [1, 2]


# ---- deprecated static range iterators ("NKI Loops" deep-dive, latest) -----------------------------------------------

@pytest.mark.parametrize("name", ["affine_range", "sequential_range", "static_range"])
def test_static_range_iterators_warn_and_behave_as_range(name):
    fn = getattr(nl, name)
    with pytest.warns(DeprecationWarning, match=rf"nl.{name} is deprecated in NKI 0.7"):
        got = list(fn(2, 8, 3))
    assert got == [2, 5]
    with pytest.warns(DeprecationWarning):
        assert list(fn(3)) == [0, 1, 2]


def test_nl_range_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(nl.range(3)) == [0, 1, 2]


# ---- control flow on a tensor's runtime value ---------------------------------------------------------------

def test_truth_value_of_a_tensor_is_a_presence_test_with_a_warning_naming_the_fix():
    """AWS's nki-library tests `if params.expert_params.expert_index:` as a presence test, so it must stay valid;
    it never reads device data, and the warning says how to branch on the data."""
    t = tile((2, 4))
    with pytest.warns(NkiTensorTruthWarning, match=r"always True.*`tile is not None`.*nisa.scalar_load.*nl.fori_loop"):
        assert bool(t) is True
    z = sb(np.zeros((2, 4), np.float32))          # all-zero contents: still True (the data is not read)
    with pytest.warns(NkiTensorTruthWarning):
        taken = bool(z)
    assert taken and len(z) == 2


def test_truth_value_of_a_tensor_inside_a_kernel():
    @nki.jit
    def k(x, bias=None):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=bias if bias else x)
        return out

    x, b = np.ones((2, 2), np.float32), np.full((2, 2), 5.0, np.float32)
    with pytest.warns(NkiTensorTruthWarning, match=r"truth value of NkiTensor"):
        np.testing.assert_array_equal(k(x, b), b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(k(x), x)     # `None` is falsy without touching any tensor


# ---- LNC from NEURON_LOGICAL_NC_CONFIG and kernel[n] (nki.jit page v2.33.1; NCC_EVRF066) ----------------------------

@nki.jit
def _which_core(x):
    out = nl.ndarray((2, 1), nl.int32, buffer=nl.shared_hbm)
    t = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=nl.num_programs() * 10 + nl.program_id(0))
    nisa.dma_copy(dst=out[nl.program_id(0):nl.program_id(0) + 1, :], src=t)
    return out


def _programs(kernel, monkeypatch, env=None):
    if env is None:
        monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    else:
        monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", env)
    out = kernel(np.zeros((2, 1), np.int32))
    return out[0, 0], (out[1, 0] if out[1, 0] in (20, 21) else None)


def test_lnc_from_environment_bracket_and_default(monkeypatch):
    assert _programs(_which_core, monkeypatch) == (10, None)               # default LNC=1
    assert _programs(_which_core, monkeypatch, "2") == (20, 21)            # NEURON_LOGICAL_NC_CONFIG=2
    assert _programs(_which_core[2], monkeypatch) == (20, 21)              # kernel[2]
    assert _programs(_which_core[2], monkeypatch, "2") == (20, 21)         # both, agreeing
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    assert _which_core.lnc == 2 and _which_core[2].lnc == 2                 # read at launch, not at decoration


def test_lnc_bracket_and_environment_disagree(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    with pytest.raises(NkiValidationError, match=r"kernel\[2\] launches with LNC=2 but NEURON_LOGICAL_NC_CONFIG=1.*"
                                                 r"NCC_EVRF066"):
        _which_core[2](np.zeros((2, 1), np.int32))
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "4")
    with pytest.raises(NkiValidationError, match=r"NEURON_LOGICAL_NC_CONFIG='4': LNC must be 1 or 2"):
        _which_core(np.zeros((2, 1), np.int32))


# ---- @nki.jit options (nki.jit page v2.33.1; NKI migration guide "nki.jit(platform_target=...)", "(mode=...)") ---

def _copy(x):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=x)
    return out


def test_jit_platform_target_rejected_with_the_documented_message():
    with pytest.raises(TypeError, match=r"platform_target.*raises an error since NKI 0.3.0.*"
                                        r"NEURON_PLATFORM_TARGET_OVERRIDE"):
        nki.jit(platform_target="trn2")(_copy)
    with pytest.raises(TypeError, match=r"platform_target"):
        nki.jit(_copy, platform_target="trn3")


def test_jit_mode_is_deprecated_and_ignored():
    with pytest.warns(DeprecationWarning, match=r"mode parameter is deprecated and ignored"):
        k = nki.jit(mode="trace")(_copy)
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    np.testing.assert_array_equal(k(x), x)


def test_jit_known_options_accepted():
    from nki.compiler import CompileConfig, SpecializationConfig
    k = nki.jit(compile_config=CompileConfig(non_ssa_legalization=True),
                specialization_config=SpecializationConfig(allow_nested_config_override=True),
                debug_kernel=True, show_compiler_tb=True)(_copy)
    x = np.ones((2, 2), np.float32)
    np.testing.assert_array_equal(k(x), x)
    assert k.options["compile_config"].non_ssa_legalization is True


def _nested_kernels(top_config, sub_config):
    from nki.compiler import CompileConfig
    sub = nki.jit(_copy, compile_config=CompileConfig(dead_code_elim=sub_config))

    def top(x):
        return sub(x)

    return nki.jit(top, **top_config)


def test_nested_jit_config_must_agree_unless_override():
    """SpecializationConfig.allow_nested_config_override: 'warn (instead of raising) if a nested @nki.jit
    sub-kernel's config disagrees, and let it inline under this kernel's config'."""
    from nki.compiler import CompileConfig, SpecializationConfig
    x = np.ones((2, 2), np.float32)
    same = _nested_kernels({"compile_config": CompileConfig(dead_code_elim=True)}, True)
    np.testing.assert_array_equal(same(x), x)
    differ = _nested_kernels({"compile_config": CompileConfig(dead_code_elim=False)}, True)
    with pytest.raises(NkiValidationError, match=r"different compile_config.*allow_nested_config_override=True"):
        differ(x)
    override = _nested_kernels({"compile_config": CompileConfig(dead_code_elim=False),
                                "specialization_config": SpecializationConfig(allow_nested_config_override=True)},
                               True)
    with pytest.warns(UserWarning, match=r"inlined under the top-level kernel's config"):
        np.testing.assert_array_equal(override(x), x)


# ---- tile and block grids (nki.language.tiles / blocks / alloc_tiles / alloc_blocks / NkiGrid pages) -----------------

def _hbm_iota(shape):
    return hbm(np.arange(math.prod(shape), dtype=np.float32).reshape(shape))


def test_tiles_grid_shape_remainders_and_data():
    """tile_shape (128, 256) over (300, 600): a 3 x 3 grid whose last row / column are clamped."""
    src = _hbm_iota((300, 600))
    g = nl.tiles(src, tile_shape=(128, 256))
    assert isinstance(g, nl.NkiTileGrid) and isinstance(g, nl.NkiGrid)
    assert g.shape == (3, 3) and g.tile_shape == (128, 256) and g.element_shape == (300, 600)
    corner = g[2, 2]
    assert isinstance(corner, nl.NkiTileGrid) and corner.shape == ()           # integer indexing keeps a grid
    assert corner.element_shape == (44, 88) and corner.is_remainder and not g[0, 0].is_remainder
    assert g[1, :].element_shape == (128, 600) and g[:, 0].index_step_elements == (128,)
    np.testing.assert_array_equal(rd(g[1, 2].data), rd(src)[128:256, 512:600])
    assert g.dtype == nl.float32 and g.buffer is nl.shared_hbm


def test_tiles_gapped_selection_is_not_representable():
    g = nl.tiles(_hbm_iota((256, 1024)), tile_shape=(128, 256))
    gapped = g[0, ::2]
    assert gapped.shape == (2,) and gapped.element_shape == (128, 512) and not gapped.is_data_representable
    with pytest.raises(ValueError, match=r"is_data_representable is False"):
        _ = gapped.data
    with pytest.raises(ValueError, match=r"positive step"):
        g[0, ::-1]
    with pytest.raises(TypeError, match=r"grid indices are Python ints or slices"):
        g[nisa.register_alloc(0), 0]


def test_copy_through_tile_grids_like_the_aws_example():
    """AWS's NkiTileGrid example: copy a tensor tile by tile through SBUF (nl.ndarray(...).data is the tensor)."""
    @nki.jit
    def copy_tile_grid(src):
        src_tiles = nl.tiles(src, tile_shape=(128, 256))
        dst = nl.ndarray(src.shape, dtype=src.dtype, buffer=nl.shared_hbm)
        dst_tiles = nl.tiles(dst, tile_shape=(128, 256))
        for i in range(src_tiles.shape[0]):
            for j in range(src_tiles.shape[1]):
                src_tile = src_tiles[i, j]
                t = nl.ndarray(src_tile.element_shape, dtype=src.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=t.data, src=src_tile.data)
                nisa.dma_copy(dst=dst_tiles[i, j].data, src=t.data)
        return dst

    x = np.random.default_rng(0).standard_normal((200, 600)).astype(np.float32)
    np.testing.assert_array_equal(copy_tile_grid(x), x)


def test_blocks_group_tiles_and_expose_them_again():
    src = _hbm_iota((300, 600))
    b = nl.blocks(src, tile_shape=(128, 256), block_shape=(2, 2))
    assert isinstance(b, nl.NkiBlockGrid) and b.shape == (2, 2) and b.block_shape == (2, 2)
    assert b[0, 0].element_shape == (256, 512) and b[1, 1].element_shape == (44, 88)    # partial final block
    np.testing.assert_array_equal(rd(b[0, 1].data), rd(src)[0:256, 512:600])
    inner = nl.tiles(b[0, 0])
    assert isinstance(inner, nl.NkiTileGrid) and inner.shape == (2, 2)
    np.testing.assert_array_equal(rd(inner[1, 0].data), rd(src)[128:256, 0:256])
    with pytest.raises(ValueError, match=r"rank of tile_shape"):
        nl.blocks(src, tile_shape=(128, 256), block_shape=(2,))


def test_untiled_hbm_prefix_is_indexed_one_slab_at_a_time():
    src = _hbm_iota((3, 256, 512))
    g = nl.tiles(src, tile_shape=(128, 256))
    assert g.shape == (3, 2, 2) and g[1].shape == (2, 2) and g[1, 0, 1].element_shape == (1, 128, 256)
    np.testing.assert_array_equal(rd(g[1, 0, 1].data), rd(src)[1:2, 0:128, 256:512])
    with pytest.raises(ValueError, match=r"no untiled dims"):
        nl.tiles(tile((128, 4, 8)), tile_shape=(4, 8))


def test_alloc_tiles_sbuf_capacity_layout():
    """SBUF: tile_shape[0] partitions, tile slots side by side along the free dim (row-major), nominal size each."""
    g = nl.alloc_tiles(tile_shape=(128, 256), element_shape=(256, 600), buffer=nl.sbuf, dtype=nl.float32)
    assert g.shape == (2, 3) and g.element_shape == (256, 600)
    assert g._store.backing.shape == (128, 6 * 256)
    t12 = g[1, 2].data
    assert t12.shape == (128, 88) and t12.offset == 5 * 256                  # slot 5, clamped to 88 columns
    row = g[1, :].data
    assert row.shape == (128, 600) and row.offset == 3 * 256
    assert not g[:, 0].is_data_representable                                # two partition tiles: no one view
    src = _hbm_iota((128, 600))
    nisa.dma_copy(dst=g[1, :].data, src=src)
    np.testing.assert_array_equal(rd(g[1, 1].data), rd(src)[:, 256:512])


@pytest.mark.parametrize("kwargs, exc, pattern", [
    ({"tile_shape": [128, 256]}, TypeError, r"tuple of exact Python ints"),
    ({"tile_shape": (128,)}, ValueError, r"at least 2 dims"),
    ({"tile_shape": (128, 0)}, ValueError, r"nonpositive"),
    ({"element_shape": (256,)}, ValueError, r"greater rank"),
    ({"buffer": "sbuf"}, TypeError, r"buffer"),
    ({"tile_shape": (256, 128)}, ValueError, r"128 partitions"),
])
def test_alloc_tiles_rejects_bad_arguments(kwargs, exc, pattern):
    args = dict(tile_shape=(128, 256), element_shape=(256, 512), buffer=nl.sbuf, dtype=nl.float32)
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        nl.alloc_tiles(**args)


def test_alloc_blocks_hbm_and_sbuf():
    hb = nl.alloc_blocks(tile_shape=(128, 128), block_shape=(1, 2), element_shape=(2, 128, 512),
                         buffer=nl.shared_hbm, dtype=nl.bfloat16, name="kv")
    assert isinstance(hb, nl.NkiBlockGrid) and hb.shape == (2, 1, 2) and hb.dtype == nl.bfloat16
    assert hb[0, 0, 1].data.shape == (1, 128, 256)
    sb_ = nl.alloc_blocks(tile_shape=(128, 128), block_shape=(1, 2), element_shape=(128, 512), buffer=nl.sbuf,
                          dtype=nl.float32)
    assert sb_.shape == (1, 2) and sb_[0, 1].data.shape == (128, 256) and sb_[0, 1].data.offset == 256


# ---- == on user classes: structural under the parser, Python's under the tracer (ANN33, 0.6 language guide) ---------

class _Pair(nl.NKIObject):
    def __init__(self, a, b):
        self.a, self.b = a, b


def test_nkiobject_equality_follows_python_under_tracer():
    p, q = _Pair(1, 2), _Pair(1, 2)
    assert p != q and not (p == q) and p == p and len({p, q}) == 2


def test_nkiobject_equality_is_structural_under_parser(parser):
    assert _Pair(1, 2) == _Pair(1, 2) and _Pair(1, 2) != _Pair(1, 3)
    assert hash(_Pair(1, 2)) is not None


# ---- the cost model sees scalar dependencies -----------------------------------------------------------------------

@nki.jit
def _scalar_addressed_copy(x, n_in):
    """n = scalar_load(n_in); out rows [2n+1] and [2(n+1)+1] copied from x through a fori_loop (0, n - 1)."""
    out = nl.ndarray((2, 64), dtype=x.dtype, buffer=nl.shared_hbm)
    n_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=n_sb, src=n_in)
    n = nisa.scalar_load(n_sb)

    def body(i):
        r = (n + i) * 2 + 1
        row = nl.ndarray((1, 64), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=row, src=x[nl.ds(r, 1), :])
        nisa.dma_copy(dst=out[i, :], src=row)

    nl.fori_loop(0, n - 1, body)
    return out


def test_cost_model_orders_scalar_addressed_dma_after_its_scalar_load():
    import nkisim
    x = np.arange(16 * 64, dtype=np.float32).reshape(16, 64)
    out, rep = nkisim.profile(_scalar_addressed_copy, x, np.array([[3]], np.int32))
    np.testing.assert_array_equal(out, x[[7, 9]])
    dmas = [e for e in rep.events if e.op == "dma_copy"]
    load_n, gathers = dmas[0], dmas[1::2]
    assert len(gathers) == 2
    assert all(g.start >= load_n.end for g in gathers)           # RAW through scalar_load -> scalar_op -> nl.ds
    assert gathers[0].reason == "RAW register"                     # waited for the scalar, not for a DMA queue
    assert [e.op for e in rep.events].count("scalar_op") >= 4


def test_empty_like_keeps_grid_geometry_and_packs_gapped_cells():
    """nl.empty_like page: grid inputs keep the grid type, navigation shape, tile shape, block grouping and remainder
    extents; a gapped selection is packed densely."""
    g = nl.tiles(_hbm_iota((300, 1024)), tile_shape=(128, 256))
    row = nl.empty_like(g[2, ::2], buffer=nl.sbuf)
    assert isinstance(row, nl.NkiTileGrid) and row.shape == (2,) and row.element_shape == (44, 512)
    assert row.is_data_representable and row.data.shape == (44, 512) and row.buffer is nl.sbuf
    b = nl.empty_like(nl.blocks(_hbm_iota((256, 600)), tile_shape=(128, 256), block_shape=(1, 2)))
    assert isinstance(b, nl.NkiBlockGrid) and b.shape == (2, 2) and b.block_shape == (1, 2)
    assert b[1, 1].element_shape == (128, 88) and b.buffer is nl.shared_hbm


def test_empty_like_transpose_axes_for_dma_transpose():
    src = tile((64, 128), nl.bfloat16)
    dst = nl.empty_like(src, transpose_axes=(1, 0))
    assert dst.shape == (128, 64) and dst.buffer is nl.sbuf and dst.dtype == nl.bfloat16
    with pytest.raises(NkiValidationError, match=r"not supported for a rank-2"):
        nl.empty_like(src, transpose_axes=(0, 1))
    with pytest.raises(NkiValidationError, match=r"must not exceed 128"):
        nl.empty_like(tile((64, 256)), transpose_axes=(1, 0))
    assert nl.empty_like(src).shape == (64, 128)
