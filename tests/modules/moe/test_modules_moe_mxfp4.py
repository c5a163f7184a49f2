"""MoELayer(expert_format="mxfp4"): the experts stay MXFP4, packed in the kernels' layout straight from a GPT-OSS
MXFP4 safetensors checkpoint (no bf16 round trip), each rank reading only its block-aligned I-shard; decode runs
moe_tkg and prefill moe_cte with the scales (the MX references on backend "torch", the nkisim kernels on trn3).

Checked: the packers against mx_weights.pack (the kernels' layout reference) for every byte value; every rank's
packed words/scales, unpacked, equal the dequantising loader's values bit for bit, and the bytes each rank read are
exactly its own blocks; the layer (fp32, torch backend) equals moe_torch(mx=True) on the unsharded weights (decode,
prefill, decode above the MX TKG kernel's 64 tokens, the sum of TP partials) and differs visibly from the
bf16-dequantised layer (so MX numerics ran); the nkisim kernels equal the torch backend at world 2 over gloo; errors.
"""

import numpy as np
import pytest
import torch

import modules.moe.layer as moe_layer
from modules.loading import SafetensorsCheckpoint
from modules.moe import MoELayer, MoEShape, gpt_oss_moe_mappings, mx_aligned_intermediate
from modules.moe.loaders import mx_pack_blocks, mx_pack_scales
from modules.parallel.coordinator import CollectiveLog, GroupCoordinator, StaticGroup
from modules.testing import assert_close_global, run_distributed
from modules.testing.gpt_oss_moe import full_kernel_weights, make_gpt_oss_moe, save_checkpoint
from nki_kernels.moe import mx_weights
from nki_kernels.moe.gate_up_layout import untile_gate_up
from nki_kernels.moe.moe_torch import MX_BLOCK, moe_torch

E, H, INTER, K, EPS = 8, 96, 160, 4, 1e-5      # H pads to 512 (one MX chunk); I = 5 MX blocks
EX = "model.layers.0.mlp.experts."


def _shape(tp):
    return MoEShape(H, INTER, E, K, tp, intermediate_padded=mx_aligned_intermediate(INTER, tp))


def _mx_reference(ref, x, mx=True):
    """moe_torch(mx=True) on the unsharded weights in x's dtype (bf16: the activations are rounded to bf16 before
    their MXFP8 quantisation, as in the layer; the dequantised E2M1 x 2^k weights are exact in bf16)."""
    w = {k: v.to(x.dtype) for k, v in ref.items()}
    out, _, _ = moe_torch(x, w["w_router"], w["w_gate_up"], w["w_down"], top_k=K, b_router=w["b_router"],
                          b_gate_up=w["b_gate_up"], b_down=w["b_down"], gamma=w["gamma"], eps=EPS, hidden_actual=H,
                          mx=mx)
    return out.float()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    t = make_gpt_oss_moe(E, H, INTER, mxfp4=True, seed=7)
    return str(save_checkpoint(t, tmp_path_factory.mktemp("moe_mx") / "mxfp4")), full_kernel_weights(t)


def _layer(shape, rank, fmt="mxfp4", backend="torch", dtype=torch.float32, path=None):
    layer = MoELayer(shape, StaticGroup(shape.tp_size, rank), dtype=dtype, norm_eps=EPS, backend=backend,
                     expert_format=fmt)
    if path is not None:
        layer.load_gpt_oss(path, 0, pipelined=False)
    return layer


def test_packers_match_mx_weights_pack_for_every_byte():
    """Checkpoint blocks [E, N, G, 16] / scales [E, N, G] → words and scales equal to mx_weights.pack of the same
    E2M1 codes (contraction-major, low nibble first), all 256 byte values present."""
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (2, 5, 32, 16), dtype=torch.uint8, generator=g)
    blocks.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    scales = torch.randint(0, 256, (2, 5, 32), dtype=torch.uint8, generator=g)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(2, 5, 32 * 32).transpose(1, 2)
    words, sc = mx_weights.pack(codes.numpy(), scales.transpose(1, 2).numpy())
    got = mx_pack_blocks(blocks)
    assert got.dtype == torch.int16 and np.array_equal(got.numpy().view(np.uint16), words)
    assert np.array_equal(mx_pack_scales(scales).numpy(), sc)
    with pytest.raises(ValueError, match="G=8 must be a multiple of 16"):
        mx_pack_blocks(blocks[:, :, :8])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_rank_packs_its_slice_equal_to_the_dequantising_loader(ckpt, tp):
    """Unpacked, each rank's packed experts are the dequantising loader's values bit for bit (zero padding
    included); each rank read exactly its own blocks of each expert tensor."""
    path, _ = ckpt
    shape = _shape(tp)
    Hp, Is = shape.hidden_padded, shape.i_per_rank
    for r in range(tp):
        c = SafetensorsCheckpoint(path)
        packed = _layer(shape, r)
        c.load_sharded(r, tp, packed, gpt_oss_moe_mappings(0, True, norm=True, packed=True))
        plain = _layer(shape, r, fmt="bf16", path=path)
        gu, down = mx_weights.dequantized_weights(packed.w_gate_up.numpy(), packed.w_down.numpy(),
                                                  packed.w_gate_up_scale.numpy(), packed.w_down_scale.numpy())
        assert gu.shape == (E, Hp, 2, Is) and down.shape == (E, Is, Hp)
        assert torch.equal(gu, untile_gate_up(plain.w_gate_up)) and torch.equal(down, plain.w_down), f"tp={tp} rank={r}"
        start, stop = shape.i_range(r)
        assert (plain.w_down.abs().sum() > 0) == (stop > start)   # tp 4: rank 3 holds only padding
        for name in ("router.weight", "router.bias", "b_gate_up", "b_down", "gamma"):
            assert torch.equal(packed.get_parameter(name), plain.get_parameter(name)), name
        m, hb = stop - start, H // MX_BLOCK
        assert start % MX_BLOCK == 0 and m % MX_BLOCK == 0
        want = {"gate_up_proj_blocks": E * 2 * m * hb * 16, "gate_up_proj_scales": E * 2 * m * hb,
                "down_proj_blocks": E * H * (m // MX_BLOCK) * 16, "down_proj_scales": E * H * (m // MX_BLOCK)}
        for key, nbytes in want.items():
            assert c.bytes_read.get(EX + key, 0) == nbytes, (tp, r, key)


def test_layer_equals_the_mx_reference_and_not_bf16_math(ckpt, monkeypatch):
    """fp32 layer on the torch backend: decode, prefill and decode of 70 tokens (two TKG calls of <= 64) equal
    moe_torch(mx=True) on the unsharded weights; at tp 2 the partials sum to it. The bf16-dequantised layer on the
    same checkpoint agrees within the MX quantisation error of the activations but not within fp32 rounding."""
    path, ref = ckpt
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, H, generator=g)
    want = _mx_reference(ref, x)
    layer = _layer(_shape(1), 0, path=path)
    assert layer.w_gate_up.dtype == torch.int16 and layer.w_down_scale.dtype == torch.uint8
    assert_close_global(layer(x), want, msg="mx decode")
    assert_close_global(layer(x, sequence_parallel=True), want, msg="mx prefill")
    plain = _layer(_shape(1), 0, fmt="bf16", path=path)
    for got in (plain(x), plain(x, sequence_parallel=True)):
        assert_close_global(got, want, rtol=0.1, msg="bf16-dequantised layer vs MX")
        assert (got - want).abs().max() > 1e-2 * want.abs().max(), "MX result indistinguishable from bf16 math"
    # Above the MX TKG kernel's 64 tokens, the TKG route (forced here, whatever the rule picks at this toy shape):
    # split into kernel calls of <= 64 tokens, same result.
    calls = _spy_kernels(monkeypatch)
    monkeypatch.setattr(layer, "decode_route", lambda T: "tkg")
    x70 = torch.randn(70, H, generator=g)
    assert_close_global(layer(x70), _mx_reference(ref, x70), msg="mx decode T=70")
    assert calls == [("tkg", 64, True), ("tkg", 6, True)]
    # Two ranks (StaticGroup: no collective), the last one with 32 padding columns: the partials sum to the output.
    parts = [_layer(_shape(2), r, path=path).decode_partial(x) for r in range(2)]
    assert_close_global(parts[0] + parts[1], want, msg="tp2 partials")


def _spy_kernels(monkeypatch):
    """Record (kernel, T, MX scales passed) of every moe_tkg / moe_cte call the layer makes."""
    calls = []
    for name, tag in (("moe_tkg", "tkg"), ("moe_cte", "cte")):
        real = getattr(moe_layer, name)

        def spy(x, *a, _real=real, _tag=tag, **kw):
            calls.append((_tag, x.shape[0], "w_gate_up_scale" in kw))
            return _real(x, *a, **kw)

        monkeypatch.setattr(moe_layer, name, spy)
    return calls


def test_decode_route_rule_at_gpt_oss_20b_tp8():
    """The layer's decode route on the GPT-OSS-20B TP8 rank shape (H 2880 -> 3072, I 384 a rank, E 32, k 4): TKG up
    to 64 tokens and for bf16 experts; MXFP4 above 64 the modelled cheaper one — two TKG calls at T = 65 (the second
    of one token touches 4 experts), one CTE call from T = 72 (two TKG calls would stream all 32 experts twice)."""
    shape = MoEShape(2880, 2880, 32, 4, 8, intermediate_padded=mx_aligned_intermediate(2880, 8))
    for lnc in (1, 2):
        mx = MoELayer(shape, StaticGroup(8, 0), expert_format="mxfp4", lnc=lnc)
        assert [mx.decode_route(T) for T in (1, 64, 65, 72, 96, 128, 256)] == ["tkg"] * 3 + ["cte"] * 4, lnc
    bf = MoELayer(shape, StaticGroup(8, 0), lnc=1)
    assert bf.decode_route(128) == bf.decode_route(256) == "tkg"


def test_mx_decode_above_64_tokens_reads_each_expert_once(ckpt, monkeypatch):
    """T = 128 MXFP4 decode (fp32, torch backend) on the CTE route: ONE moe_cte call with the scales and no moe_tkg
    call (each expert's weights read once instead of once per 64-token call); equal to moe_torch(mx=True) on the
    unsharded weights at tp 1, and the tp 2 partials (down bias on rank 0 only) sum to it."""
    path, ref = ckpt
    x = torch.randn(128, H, generator=torch.Generator().manual_seed(21))
    want = _mx_reference(ref, x)
    layer = _layer(_shape(1), 0, path=path)
    # (at this toy shape the rule's two routes are within ~10 % and it keeps the split: the CTE route is forced;
    # the rule's choice at a real rank shape is test_decode_route_rule_at_gpt_oss_20b_tp8's)
    monkeypatch.setattr(layer, "decode_route", lambda T: "cte")
    calls = _spy_kernels(monkeypatch)
    assert_close_global(layer(x), want, msg="mx decode T=128 (CTE route)")
    assert calls == [("cte", 128, True)]
    calls.clear()
    parts = []
    for r in range(2):
        tp2 = _layer(_shape(2), r, path=path)
        monkeypatch.setattr(tp2, "decode_route", lambda T: "cte")
        parts.append(tp2.decode_partial(x))
    assert calls == [("cte", 128, True)] * 2
    assert_close_global(parts[0] + parts[1], want, msg="tp2 partials T=128 (CTE route)")


def test_errors_name_the_argument(ckpt, tmp_path, monkeypatch):
    path, _ = ckpt
    with pytest.raises(ValueError, match=r"intermediate_padded=160 / tp_size=4 = 40 columns a rank is not a "
                                         r"multiple of 32; build the shape with intermediate_padded="
                                         r"mx_aligned_intermediate\(160, 4\) = 256"):
        MoELayer(MoEShape(H, INTER, E, K, 4), StaticGroup(4, 0), expert_format="mxfp4")
    with pytest.raises(ValueError, match="hidden_padded % 512 == 0.*got hidden_padded=128"):
        MoELayer(MoEShape(H, INTER, E, K, 1, hidden_padded=128), StaticGroup(), expert_format="mxfp4")
    with pytest.raises(ValueError, match="intermediate=144 to be a multiple of the MX block"):
        MoELayer(MoEShape(H, 144, E, K, 1), StaticGroup(), expert_format="mxfp4")
    with pytest.raises(ValueError, match=r"expert_format must be one of \('bf16', 'mxfp4'\), got 'fp8'"):
        MoELayer(_shape(1), StaticGroup(), expert_format="fp8")
    # A bf16 checkpoint cannot fill packed experts.
    bf = save_checkpoint(make_gpt_oss_moe(E, H, INTER, seed=1), tmp_path / "bf16")
    with pytest.raises(ValueError, match="packed=True .* needs an MXFP4 checkpoint.*use expert_format='bf16'"):
        _layer(_shape(1), 0, path=bf)
    # A checkpoint of another shape: the checkpoint tensor named with both shapes.
    small = save_checkpoint(make_gpt_oss_moe(E, H, 128, mxfp4=True, seed=1), tmp_path / "small")
    with pytest.raises(ValueError, match=r"gate_up_proj_blocks: checkpoint shape \(8, 256, 3, 16\) != expected "
                                         r"\(8, 320, 3, 16\)"):
        _layer(_shape(1), 0, path=small)
    # Real AWS nki: x4 words cannot travel as torch tensors; refused by name before any work.
    layer = _layer(_shape(1), 0, backend="nki", path=path)
    monkeypatch.setattr(moe_layer, "resolve_backend", lambda op, b: "nki")
    with pytest.raises(NotImplementedError, match="expert_format='mxfp4' with backend 'nki'"):
        layer(torch.zeros(2, H))


def test_trn2_is_refused_by_the_kernels(ckpt, monkeypatch):
    """The target is the kernels' (NEURON_PLATFORM_TARGET_OVERRIDE for nkisim): on trn2 both refuse MXFP4 with the
    reason (no nc_matmul_mx) instead of a silent dequantising fallback."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    layer = _layer(_shape(1), 0, backend="nkisim", dtype=torch.bfloat16, path=ckpt[0])
    x = torch.randn(3, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="nc_matmul_mx.*trn3.*expert_format='bf16'"):
        layer(x)
    with pytest.raises(AssertionError, match="nc_matmul_mx.*trn3.*expert_format='bf16'"):
        layer(x, sequence_parallel=True)


T_PREFILL, T_DECODE, T_DECODE_CTE = 8, 5, 96


def _check_mx_kernels(rank, world_size, path):
    """World 2 over gloo: the nkisim kernels on trn3 (TKG and CTE MX paths; decode of 96 tokens on the CTE route)
    equal the torch backend's MX references through the same layer, and the unsharded bf16 MX reference (tolerance
    as the kernels' own MX tests)."""
    import os

    import nkisim

    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = "trn3"   # the compile target the kernels check
    nkisim.install()
    from safetensors.torch import load_file

    ref = full_kernel_weights(load_file(f"{path}/model.safetensors"))
    group = GroupCoordinator([list(range(world_size))], "tp", log=CollectiveLog())
    g = torch.Generator().manual_seed(13)
    xp = torch.randn(T_PREFILL, H, generator=g).bfloat16()
    xd = torch.randn(T_DECODE, H, generator=g).bfloat16()
    chunk = T_PREFILL // world_size
    mine = xp[rank * chunk:(rank + 1) * chunk]
    layers = {}
    for backend in ("nkisim", "torch"):
        layer = MoELayer(_shape(world_size), group, norm_eps=EPS, backend=backend, expert_format="mxfp4")
        layer.load_gpt_oss(path, 0)
        layers[backend] = layer
    xb = torch.randn(T_DECODE_CTE, H, generator=g).bfloat16()
    with torch.no_grad():
        got_d, want_d = layers["nkisim"](xd), layers["torch"](xd)
        got_p, want_p = (layers[b](mine, sequence_parallel=True) for b in ("nkisim", "torch"))
        for layer in layers.values():   # the CTE decode route, forced (at this toy shape the rule keeps the split)
            layer.decode_route = lambda T: "cte"
        got_b, want_b = layers["nkisim"](xb), layers["torch"](xb)
    assert not got_d.isnan().any() and not got_p.isnan().any() and not got_b.isnan().any()
    assert_close_global(got_b, want_b, rtol=2e-2, msg="nkisim decode T=96 (CTE route) vs MX reference")
    assert_close_global(got_b, _mx_reference(ref, xb), rtol=2e-2, msg="decode T=96 (CTE route) vs unsharded")
    assert_close_global(got_d, want_d, rtol=2e-2, msg="nkisim decode vs MX reference")
    assert_close_global(got_p, want_p, rtol=2e-2, msg="nkisim prefill vs MX reference")
    assert_close_global(got_d, _mx_reference(ref, xd), rtol=2e-2, msg="decode vs unsharded")
    assert_close_global(got_p, _mx_reference(ref, xp)[rank * chunk:(rank + 1) * chunk], rtol=2e-2,
                        msg="prefill vs unsharded")
    return True


@pytest.mark.timeout(120)
def test_mxfp4_layer_with_nkisim_kernels_at_world_2(ckpt):
    assert all(run_distributed(_check_mx_kernels, 2, ckpt[0], timeout=110))
