"""bench/calibration: the case table, our tutorial kernels' numerics on small shapes, and one scaled-down row."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import nkisim
from bench.calibration import matmul_tutorial as MM
from bench.calibration.cases import CASES, TARGET_BAND
from bench.calibration.mamba import mamba_reference, mamba_v1
from bench.calibration.run import format_table, model_case
from nkisim.hardware import HARDWARE


def test_case_table_is_complete_and_sourced():
    keys = [c.key for c in CASES]
    assert len(keys) == len(set(keys)) == 10
    for c in CASES:
        assert c.target in HARDWARE and c.published_s > 0 and c.source
        assert c.kernel == "mamba_v1" or hasattr(MM, c.kernel)
    assert any(c.held_out for c in CASES) and not all(c.held_out for c in CASES)
    assert TARGET_BAND == 0.15


@pytest.mark.parametrize("target,dtype", [("trn2", np.float32), ("trn1", ml_dtypes.bfloat16)])
@pytest.mark.parametrize("name,kw", [("matmul_v2", {}), ("matmul_v3", {}), ("matmul_v4", {}),
                                     ("matmul_v5", dict(tiles_m=2, tiles_n=2, tiles_k=2))])
def test_tutorial_matmuls_compute_the_product(target, dtype, name, kw):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((512, 256)).astype(dtype)
    b = rng.standard_normal((512, 1024)).astype(dtype)
    res = nkisim.run(getattr(MM, name), (a, b), kw, target=target)
    ref = a.astype(np.float32).T @ b.astype(np.float32)
    tol = 1e-4 if dtype is np.float32 else 2e-2
    np.testing.assert_allclose(res.outputs.astype(np.float32), ref, atol=tol * np.abs(ref).max())
    assert res.outputs.dtype == a.dtype


def test_mamba_matches_its_reference():
    rng = np.random.default_rng(1)
    d = rng.uniform(0.01, 0.1, (1, 128, 64)).astype(np.float32)
    u = rng.standard_normal((1, 128, 64)).astype(np.float32)
    A = -rng.uniform(0.5, 2, (128, 4)).astype(np.float32)
    B = rng.standard_normal((1, 4, 64)).astype(np.float32)
    C = rng.standard_normal((1, 4, 64)).astype(np.float32)
    out = nkisim.run(mamba_v1, (d, u, A, B, C), {}, target="trn1").outputs
    np.testing.assert_allclose(out, mamba_reference(d, u, A, B, C), rtol=1e-4, atol=1e-4)


def test_model_case_row_on_a_scaled_down_case():
    small = dataclasses.replace(CASES[1], shape=(256, 512, 1024), published_s=1e-5)
    row = model_case(small)
    assert row["modelled"] and row["modelled_s"] > 0 and row["modelled_program_s"] >= row["modelled_s"]
    assert row["ratio"] == pytest.approx(row["modelled_s"] / 1e-5)
    assert row["modelled_with_launch_s"] == pytest.approx(row["modelled_s"] + row["launch_s"])
    assert small.key in format_table([row]) and "within" in format_table([row])


def test_report_has_the_calibration_table():
    import json
    from pathlib import Path

    from bench.report import render_html
    from bench.report.render import load_calibration

    doc = load_calibration()
    assert doc is not None and len(doc["rows"]) == len(CASES)
    data = json.loads((Path(__file__).parent / "fixtures" / "bench_fixture.json").read_text())
    page = render_html(data)
    assert 'id="calibration"' in page
    for r in doc["rows"]:
        assert r["case"] in page
    assert f'{sum(r["within_band"] for r in doc["rows"])}/{len(doc["rows"])} cases within' in page
