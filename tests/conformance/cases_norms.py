"""core/subkernels rmsnorm_tkg / layernorm_tkg / rmsnorm_mx_quantize_tkg as kernels, on shapes of the library's tests.

Sources: test/integration/nkilib/core/subkernels/test_rmsnorm_tkg.py::test_rmsnorm_tkg_unit and
test_layernorm_tkg.py::test_layernorm_tkg_unit (fast lists): seeded randn fp16 input/gamma(/beta), the output
[128, B*S, H/128] written in place; reference = the LNC=2 layout variant at LNC=2 (rmsnorm: unless hidden_dim_tp;
layernorm: or shard_on_h), else the LNC=1 one; atol 1e-5, rtol 2e-2; trn2 (the tests' default platform).
"""

import numpy as np

from bench.peers import nkilib

from .harness import Case

SUB = "test/integration/nkilib/core/subkernels"


def _rmsnorm(lnc, b, s, h, h_actual, tp, shard_on_h):
    def inputs():
        np.random.seed(42)
        return {"input": np.random.randn(b, s, h).astype(np.float16),
                "gamma": np.random.randn(1, h).astype(np.float16),
                "output": np.zeros((128, b * s, h // 128), np.float16),
                "hidden_actual": h_actual, "hidden_dim_tp": tp, "shard_on_h": shard_on_h}

    ref = "rmsnorm_tkg_torch_ref" if lnc == 2 and not tp else "rmsnorm_tkg_torch_ref_lnc1"
    shape = f"b{b}_s{s}_h{h}" + (f"_ha{h_actual}" if h_actual else "") + ("_tp" if tp else "") + \
        ("_shardh" if shard_on_h else "")
    return Case("core.subkernels.rmsnorm_tkg:rmsnorm_tkg", f"core.subkernels.rmsnorm_torch:{ref}", shape, inputs,
                atol=1e-5, rtol=2e-2, source=f"{SUB}/test_rmsnorm_tkg.py::test_rmsnorm_tkg_unit", lnc=lnc,
                out_args=("output",))


def _layernorm(lnc, b, s, h, shard_on_h):
    def inputs():
        np.random.seed(42)
        return {"input": np.random.randn(b, s, h).astype(np.float16),
                "gamma": np.random.randn(1, h).astype(np.float16),
                "output": np.zeros((128, b * s, h // 128), np.float16),
                "beta": np.random.randn(1, h).astype(np.float16), "shard_on_h": shard_on_h}

    ref = "layernorm_tkg_torch_ref" if lnc == 2 or shard_on_h else "layernorm_tkg_torch_ref_lnc1"
    return Case("core.subkernels.layernorm_tkg:layernorm_tkg", f"core.subkernels.layernorm_torch:{ref}",
                f"b{b}_s{s}_h{h}" + ("_shardh" if shard_on_h else ""), inputs, atol=1e-5, rtol=2e-2,
                source=f"{SUB}/test_layernorm_tkg.py::test_layernorm_tkg_unit", lnc=lnc, out_args=("output",))


CASES = [
    _rmsnorm(1, 1, 1, 8192, None, False, False),
    _rmsnorm(1, 1, 8, 8192, None, False, False),
    _rmsnorm(1, 1, 4, 2048, 1920, False, False),
    _rmsnorm(1, 1, 1, 4096, 3072, True, False),
    _rmsnorm(2, 1, 1, 8192, None, False, False),
    _rmsnorm(2, 2, 8, 8192, None, False, False),
    _rmsnorm(2, 128, 5, 3072, None, False, False),
    _rmsnorm(2, 2, 8, 3072, 2880, True, False),
    _rmsnorm(2, 2, 8, 8192, None, False, True),
    _layernorm(1, 1, 1, 8192, False),
    _layernorm(1, 1, 8, 8192, False),
    _layernorm(2, 2, 8, 8192, False),
    _layernorm(2, 128, 5, 3072, False),
    _layernorm(2, 2, 8, 8192, True),
    _layernorm(2, 4, 1, 3072, True),
]


MX_SOURCE = f"{SUB}/test_rmsnorm_mx_quantize_tkg.py"


def rmsnorm_mx_quantize_tkg(inp, gamma, residual=None, hidden_actual=None):
    """Launch kernel (ours) as the library's test drives the sub-kernel at LNC=2: SBUF outputs [128, T, H/128] (fp16),
    MX data [128, H/512, T] and scales, each core spilling its half of T to HBM; the scales of data quadrant q live in
    partitions q*32+0..3 (nisa.quantize_mx's layout), only those rows are copied."""
    import nki.isa as nisa
    import nki.language as nl
    kernel = nkilib.load("core.subkernels.rmsnorm_mx_quantize_tkg:rmsnorm_mx_quantize_tkg")
    cores, core = nl.num_programs(0), nl.program_id(0)
    b, s, h = inp.shape
    t, h1 = b * s, h // nl.tile_size.pmax
    out_shape, q_shape = (nl.tile_size.pmax, t, h1), (nl.tile_size.pmax, h1 // 4, t)
    out_sb = nl.ndarray(out_shape, dtype=inp.dtype, buffer=nl.sbuf)
    quant_sb = nl.ndarray(q_shape, dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf)
    scale_sb = nl.ndarray(q_shape, dtype=nl.uint8, buffer=nl.sbuf)
    res_out = nl.ndarray((t, h), dtype=inp.dtype, buffer=nl.shared_hbm) if residual is not None else None
    kernel(input=inp, gamma=gamma, output=out_sb, output_quant=quant_sb, output_scale=scale_sb, residual=residual,
           output_residual=res_out, hidden_actual=hidden_actual)
    out = nl.ndarray(out_shape, dtype=inp.dtype, buffer=nl.shared_hbm)
    scale = nl.ndarray(q_shape, dtype=nl.uint8, buffer=nl.shared_hbm)
    half = t // cores
    mine, other = nl.ds(half * core, half), nl.ds(half * (1 - core), half)
    nisa.dma_copy(dst=out[:, mine, :], src=out_sb[:, mine, :])   # each core holds the other half of the MX outputs
    for quadrant in range(4):
        rows = nl.ds(quadrant * 32, 4)
        nisa.dma_copy(dst=scale[rows, :, other], src=scale_sb[rows, :, other])
    return (out, scale, res_out) if residual is not None else (out, scale)


def _mx_reference(inp, gamma, residual=None, hidden_actual=None):
    """RMSNorm (the library's rms_norm_torch_ref) in the kernel's [128, T, H/128] layout, and the MX scales of it
    from the library's quantize_mx_golden, laid out [128, H/512, T] as the test arranges them."""
    import types

    import nki.language as nl
    rms = nkilib.load("core.subkernels.rmsnorm_torch:rms_norm_torch_ref")
    golden_mx = nkilib.load("core.utils.mx_torch_common:quantize_mx_golden")
    b, s, h = inp.shape
    t, h1 = b * s, h // 128
    x = inp.float() + (residual.float() if residual is not None else 0)
    normed = rms(x, gamma.float(), hidden_actual=hidden_actual).numpy()
    out = normed.reshape(t, h1, 128).transpose(2, 0, 1).astype(np.float16)
    q_in = out.reshape(128, t, 4, h1 // 4).transpose(0, 3, 1, 2).reshape(128, -1)
    scales = golden_mx(q_in, types.SimpleNamespace(dtype=nl.float8_e4m3fn_x4), None)["out_scale_hbm"]
    gold = {"out": out, "out_scale": scales.reshape(128, h1 // 4, t)}
    if residual is not None:
        gold["out_residual"] = x.numpy().reshape(t, h).astype(np.float16)
    return gold


def _undefined_scale_rows_from_golden(outs, gold):
    # partitions other than q*32+0..3 of the scale tile are not written (undefined); take them from the golden
    named = dict(zip(gold, outs))
    scale = np.array(gold["out_scale"])
    rows = (np.arange(4)[:, None] * 32 + np.arange(4)).ravel()
    scale[rows] = np.asarray(named["out_scale"])[rows]
    named["out_scale"] = scale
    return named


def _mx(b, s, h, h_actual, residual=False):
    def inputs():
        rng = np.random.default_rng(0)
        kw = {"inp": rng.normal(size=(b, s, h)).astype(np.float16),
              "gamma": rng.normal(size=(1, h)).astype(np.float16), "hidden_actual": h_actual}
        if residual:
            kw["residual"] = rng.normal(size=(b, s, h)).astype(np.float16)
        return kw

    test = "test_rmsnorm_mx_quantize_tkg_residual" if residual else "test_rmsnorm_mx_quantize_tkg"
    return Case(rmsnorm_mx_quantize_tkg, _mx_reference,
                f"b{b}_s{s}_h{h}" + (f"_ha{h_actual}" if h_actual else "") + ("_res" if residual else ""), inputs,
                atol=1e-3, rtol=1e-2, source=f"{MX_SOURCE}::{test} (trn3 only, LNC=2)", target="trn3", lnc=2,
                outputs=_undefined_scale_rows_from_golden)


CASES += [
    _mx(32, 1, 512, None),
    _mx(128, 1, 3072, 2880),
    _mx(16, 3, 3072, 2880),
    _mx(256, 1, 1024, None, residual=True),
    _mx(64, 5, 3072, 2880, residual=True),
]
