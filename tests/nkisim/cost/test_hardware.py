"""The hardware table (nkisim.hardware): every constant carries a source; trn2/trn3 figures as published."""

import dataclasses

import pytest

from nkisim.hardware import CALIBRATION, HARDWARE, hardware


@pytest.mark.parametrize("name", ["trn1", "trn2", "trn3"])
def test_every_field_has_a_source(name):
    hw = HARDWARE[name]
    specs = [hw.core, hw.chip, hw.collective] + [s for s in (hw.instance, hw.ultraserver) if s is not None]
    for spec in specs:
        for f in dataclasses.fields(spec):
            if f.name in ("sources", "name"):
                continue
            assert spec.source(f.name).strip(), f"{name}: {type(spec).__name__}.{f.name} has no source"


def test_published_trn2_trn3_numbers():
    t2, t3 = HARDWARE["trn2"], HARDWARE["trn3"]
    assert t2.core.name == "NeuronCore-v3" and t3.core.name == "NeuronCore-v4"
    assert t2.core.tensor_bf16_flops == 79e12 and t2.core.tensor_fp8_flops == 158e12
    assert t2.core.tensor_fp32_flops == 20e12 and t3.core.tensor_mxfp8_flops == 315e12
    assert t2.core.tensor_clock_hz == t3.core.tensor_clock_hz == 2.4e9
    assert (t2.core.vector_clock_hz, t3.core.vector_clock_hz) == (0.96e9, 1.2e9)
    assert (t2.core.sbuf_bytes, t3.core.sbuf_bytes) == (28 << 20, 32 << 20)
    assert t2.core.psum_bytes == t3.core.psum_bytes == 2 << 20
    assert (t2.core.dma_bytes_per_s, t3.core.dma_bytes_per_s) == (368e9, 528e9)
    assert t2.chip.hbm_bytes_per_s == 2.9e12 and t3.chip.hbm_bytes_per_s == 4.9e12
    assert t2.chip.cores == t3.chip.cores == 8
    assert t2.core.hbm_bytes_per_s == pytest.approx(t2.chip.hbm_bytes_per_s / t2.chip.cores)
    # trn3: the DMA engines, not the HBM share, cap one core
    assert t3.core.memory_bytes_per_s == t3.core.dma_bytes_per_s < t3.core.hbm_bytes_per_s
    assert t2.instance.chips == 16 and "torus" in t2.instance.topology and t2.instance.default_lnc == 2
    assert t2.ultraserver.chips == 64 and t3.ultraserver.chips == 64
    # disagreeing sources: one value picked, the other named
    assert "alt:" in t2.chip.source("hbm_bytes_per_s") and "3 TB/s" in t2.chip.source("hbm_bytes_per_s")
    assert "alt:" in t3.chip.source("hbm_bytes_per_s") and "alt:" in t2.chip.source("bf16_flops")
    assert "uncalibrated" in CALIBRATION["core"]


def test_peak_flops_by_dtype_and_logical_core():
    c = HARDWARE["trn2"].core
    assert c.peak_flops("bfloat16") == 79e12
    assert c.peak_flops("float32") == 20e12
    assert c.peak_flops("float8_e4m3") == 79e12            # fp8 without double_row runs at the bf16 rate
    assert c.peak_flops("float8_e4m3", double_row=True) == 158e12
    lc = HARDWARE["trn2"].logical_core(2)
    assert lc.bf16_flops == 158e12 and lc.hbm_bytes_per_s == pytest.approx(725e9)


def test_lookup():
    assert hardware("gen3") is HARDWARE["trn2"] and hardware("TRN3") is HARDWARE["trn3"]
    with pytest.raises(KeyError):
        hardware("trn9")


def test_trn3_non_mx_fp8_runs_at_the_bf16_rate():
    c = HARDWARE["trn3"].core
    assert c.tensor_fp8_flops == c.tensor_bf16_flops == 79e12 and "2x128 (non-MXFP8" in c.source("tensor_fp8_flops")
    assert c.peak_flops("float8_e4m3", double_row=True) == 79e12 and c.peak_flops("mxfp8") == 315e12


def test_targets_derive_from_the_hardware_table():
    from nkisim.language import tile_size
    from nkisim.target import ALIASES, TARGETS, resolve_target
    for name, t in TARGETS.items():
        c = HARDWARE[name].core
        assert t.pmax == c.partitions and t.gemm_stationary_fmax == c.tensor_cols
        assert t.sbuf_physical_bytes == c.sbuf_partition_bytes and t.psum_bytes == c.psum_partition_bytes
        assert t.psum_num_banks == c.psum_banks and t.gemm_moving_fmax == t.psum_bank_bytes // 4 == 512
        assert t.sbuf_usable_bytes < t.sbuf_physical_bytes
    for alias, name in ALIASES.items():     # one alias map serves both lookups
        assert resolve_target(alias) is TARGETS[name] and hardware(alias) is HARDWARE[name]
    assert tile_size.pmax == 128 and tile_size.psum_bank_fmax == 512 and tile_size.gemm_moving_fmax == 512
