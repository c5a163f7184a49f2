"""MoE module pieces in one process: shapes, GPT-OSS loaders from real safetensors files (every rank's slice, bf16
and MXFP4), the router module, the size-1 layer against moe_torch, the routing gather, the backend switch, errors."""

import pytest
import torch

import modules.moe.layer as moe_layer
import modules.moe.router as moe_router
from modules.loading import SafetensorsCheckpoint, load_from_tensors
from modules.model_specs import GPT_OSS_20B, GPT_OSS_120B, LLAMA_31_8B
from modules.moe import (
    UNSELECTED,
    MoELayer,
    MoERouter,
    MoEShape,
    gpt_oss_checkpoint_is_mxfp4,
    gpt_oss_moe_mappings,
    mx_aligned_intermediate,
)
from modules.parallel.coordinator import StaticGroup
from modules.testing import assert_close_global
from modules.testing.gpt_oss_moe import full_kernel_weights, make_gpt_oss_moe, save_checkpoint
from nki_kernels.moe.gate_up_layout import tile_gate_up, untile_gate_up
from nki_kernels.moe.moe_torch import moe_torch, router_torch

E, H, INTER, K = 8, 96, 160, 4
EX = "model.layers.0.mlp.experts."


def test_gpt_oss_rank_shapes_follow_the_seed():
    s = MoEShape.from_spec(GPT_OSS_20B, 8)
    assert (s.hidden_padded, s.intermediate_padded, s.i_per_rank) == (3072, GPT_OSS_20B.intermediate, 360)
    # The seed's TP=8 figures: intermediate 3072, 384 per rank, each shard on MX block boundaries.
    s = MoEShape.from_spec(GPT_OSS_20B, 8, intermediate_padded=mx_aligned_intermediate(GPT_OSS_20B.intermediate, 8))
    assert (s.intermediate_padded, s.i_per_rank) == (3072, 384)
    assert s.i_range(7) == (7 * 384, GPT_OSS_20B.intermediate)  # the last rank's real columns end at 2880
    s = MoEShape.from_spec(GPT_OSS_120B, 16)
    assert (s.experts, s.top_k, s.i_per_rank) == (128, 4, 180)


def test_gpt_oss_20b_tp8_rank_parameters_are_the_seeds():
    """The seed's per-rank shards (gate_up [32, 3072, 768], down [32, 384, 3072]) in the kernel layout: gate/up held
    once in the tiled layout [E, 128, Hp/128, 2·Is] (gate_up_layout.py) that both kernels read."""
    shape = MoEShape.from_spec(GPT_OSS_20B, 8, intermediate_padded=mx_aligned_intermediate(GPT_OSS_20B.intermediate, 8))
    with torch.device("meta"):
        layer = MoELayer(shape, StaticGroup(8, 3), norm_eps=1e-5)
    got = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert got == {"router.weight": (3072, 32), "router.bias": (32,), "w_gate_up": (32, 128, 24, 768),
                   "w_down": (32, 384, 3072), "b_gate_up": (32, 2, 384), "b_down": (32, 3072), "gamma": (3072,)}
    assert all(p.dtype == torch.bfloat16 for p in layer.parameters())


@pytest.mark.parametrize("kwargs, match", [
    (dict(tp_size=7), "tp_size=7 does not divide intermediate size 160; pass intermediate_padded"),
    (dict(tp_size=3, intermediate_padded=200), "tp_size=3 does not divide intermediate padded size 200"),
    (dict(intermediate_padded=128), "intermediate_padded=128 < intermediate=160"),
    (dict(hidden_padded=192), "hidden_padded=192 must be a multiple of 128"),
    (dict(hidden_padded=64), "hidden_padded=64 must be a multiple of 128 and >= hidden=96"),
    (dict(top_k=9), "top_k=9 exceeds experts=8"),
    (dict(tp_size=0), "tp_size must be a positive integer"),
])
def test_shape_errors_name_the_argument(kwargs, match):
    args = dict(hidden=H, intermediate=INTER, experts=E, top_k=K, tp_size=2) | kwargs
    with pytest.raises(ValueError, match=match):
        MoEShape(**args)
    with pytest.raises(ValueError, match="not an MoE model"):
        MoEShape.from_spec(LLAMA_31_8B, 2)
    with pytest.raises(ValueError, match="rank=2 out of range"):
        MoEShape(H, INTER, E, K, 2).i_range(2)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_local")
    out = {}
    for form in ("bf16", "mxfp4"):
        t = make_gpt_oss_moe(E, H, INTER, mxfp4=form == "mxfp4", seed=5)
        out[form] = (str(save_checkpoint(t, root / form)), full_kernel_weights(t))
    return out


def _load(path, shape, rank, norm=True, dtype=torch.float32):
    ckpt = SafetensorsCheckpoint(path)
    layer = MoELayer(shape, StaticGroup(shape.tp_size, rank), dtype=dtype, norm_eps=1e-5 if norm else None,
                     backend="torch")
    ckpt.load_sharded(rank, shape.tp_size, layer, gpt_oss_moe_mappings(0, gpt_oss_checkpoint_is_mxfp4(ckpt, 0),
                                                                       norm=norm))
    return layer, ckpt.bytes_read


@pytest.mark.parametrize("form", ["bf16", "mxfp4"])
@pytest.mark.parametrize("tp, padded", [(1, False), (2, False), (4, False), (8, False), (4, True), (8, True)])
def test_every_rank_loads_its_slice_in_kernel_layout(ckpts, form, tp, padded):
    path, ref = ckpts[form]
    shape = MoEShape(H, INTER, E, K, tp, intermediate_padded=mx_aligned_intermediate(INTER, tp) if padded else 0)
    Hp, Is = shape.hidden_padded, shape.i_per_rank
    layers = [_load(path, shape, r)[0] for r in range(tp)]
    for m in layers:    # held tiled: [E, 128, Hp/128, 2·Is], H row kt·128 + p at (p, kt)
        assert tuple(m.w_gate_up.shape) == (E, 128, Hp // 128, 2 * Is)
    gu = torch.cat([untile_gate_up(m.w_gate_up) for m in layers], dim=3)          # [E, Hp, 2, I_pad]
    gub = torch.cat([m.b_gate_up for m in layers], dim=2)         # [E, 2, I_pad]
    down = torch.cat([m.w_down for m in layers], dim=1)           # [E, I_pad, Hp]
    assert gu.shape == (E, Hp, 2, tp * Is) and down.shape == (E, tp * Is, Hp)
    assert torch.equal(gu[:, :H, :, :INTER], ref["w_gate_up"])
    assert torch.equal(gub[:, :, :INTER], ref["b_gate_up"])
    assert torch.equal(down[:, :INTER, :H], ref["w_down"])
    # Padding is zero: hidden rows/columns beyond H and intermediate columns beyond I.
    assert not gu[:, H:].any() and not gu[..., INTER:].any() and not gub[..., INTER:].any()
    assert not down[:, INTER:].any() and not down[..., H:].any()
    for m in layers:  # replicated pieces
        assert torch.equal(m.router.weight[:H], ref["w_router"]) and not m.router.weight[H:].any()
        assert torch.equal(m.router.bias, ref["b_router"])
        assert torch.equal(m.b_down[:, :H], ref["b_down"]) and not m.b_down[:, H:].any()
        assert torch.equal(m.gamma[:H], ref["gamma"]) and not m.gamma[H:].any()


def test_bf16_layer_holds_gate_up_tiled_once_for_both_kernels(ckpts, monkeypatch):
    """bf16 experts: the layer's w_gate_up IS the tiled layout of this rank's [E, Hp, 2, Is] slice (element
    [e, p, kt, g·Is + i] = slice[e, kt·128 + p, g, i]), the only gate/up copy it holds, and that same tensor goes to
    moe_cte (prefill) and moe_tkg (decode)."""
    path, ref = ckpts["bf16"]
    shape = MoEShape(H, INTER, E, K, 2)
    layer, _ = _load(path, shape, 1)
    Hp, Is = shape.hidden_padded, shape.i_per_rank
    assert Hp // 128 > 1 and tuple(layer.w_gate_up.shape) == (E, 128, Hp // 128, 2 * Is)
    start, stop = shape.i_range(1)
    want = torch.zeros(E, Hp, 2, Is)
    want[:, :H, :, :stop - start] = ref["w_gate_up"][..., start:stop]
    assert torch.equal(layer.w_gate_up, tile_gate_up(want))
    assert torch.equal(layer.w_gate_up[3, 5, 2, Is + 7], want[3, 2 * 128 + 5, 1, 7])
    gate_up_bytes = sum(p.numel() for n, p in layer.named_parameters() if n.startswith("w_gate_up"))
    assert gate_up_bytes == E * Hp * 2 * Is
    seen = []
    for name in ("moe_cte", "moe_tkg"):
        real = getattr(moe_layer, name)

        def spy(x, *a, _real=real, _name=name, **kw):
            w = a[1] if _name == "moe_tkg" else a[2]    # moe_tkg(x, w_r, w_gu, ...) / moe_cte(x, idx, aff, w_gu, ...)
            seen.append((_name, w is layer.w_gate_up))
            return _real(x, *a, **kw)

        monkeypatch.setattr(moe_layer, name, spy)
    layer, _ = _load(path, MoEShape(H, INTER, E, K, 1), 0)     # size 1: the collectives are bypassed
    x = torch.randn(4, H)
    layer(x, sequence_parallel=True)
    layer(x)
    assert seen == [("moe_cte", True), ("moe_tkg", True)]


def test_a_rank_reads_only_its_slice(ckpts):
    tp = 4
    shape = MoEShape(H, INTER, E, K, tp)           # 40 columns a rank: MXFP4 down shards cut through blocks
    for r in range(tp):
        start, stop = shape.i_range(r)
        _, read = _load(ckpts["bf16"][0], shape, r)
        assert read[EX + "gate_up_proj"] == E * H * 2 * (stop - start) * 2   # bf16 bytes of 2·40 columns
        assert read[EX + "down_proj"] == E * (stop - start) * H * 2
        _, read = _load(ckpts["mxfp4"][0], shape, r)
        assert read[EX + "gate_up_proj_blocks"] == E * 2 * (stop - start) * (H // 32) * 16
        covering = -(-stop // 32) - start // 32     # [0,40) → 2 blocks, [40,80) → 2, [80,120) → 2, [120,160) → 2
        assert covering == 2 and read[EX + "down_proj_blocks"] == E * H * covering * 16
        assert read[EX + "down_proj_scales"] == E * H * covering
    # A rank lying wholly in the padding reads no expert bytes at all.
    shape = MoEShape(H, INTER, E, K, 8, intermediate_padded=mx_aligned_intermediate(INTER, 8))
    _, read = _load(ckpts["mxfp4"][0], shape, 7)
    assert not any(k in read for k in (EX + "gate_up_proj_blocks", EX + "down_proj_blocks", EX + "gate_up_proj_bias"))


def test_mxfp4_loads_to_bf16_exactly(ckpts):
    layer, _ = _load(ckpts["mxfp4"][0], MoEShape(H, INTER, E, K, 2), 1, dtype=torch.bfloat16)
    ref = ckpts["mxfp4"][1]
    assert layer.w_gate_up.dtype == torch.bfloat16
    assert torch.equal(untile_gate_up(layer.w_gate_up)[:, :H, :, :].float(), ref["w_gate_up"][..., 80:])


def test_bad_checkpoints_are_named(ckpts):
    t = make_gpt_oss_moe(6, H, INTER)                 # 6 experts where the layer expects 8
    layer = MoELayer(MoEShape(H, INTER, E, K, 2), StaticGroup(2, 0))
    with pytest.raises(ValueError, match=r"gate_up_proj \[E, H, 2I\]: checkpoint shape \(6, 96, 320\) != expected "
                                         r"\(8, 96, 320\)"):
        load_from_tensors(layer, t, 0, gpt_oss_moe_mappings(0, False))
    # An MXFP4 blocked dimension that is not a multiple of 32 (hidden 80).
    shape = MoEShape(80, INTER, E, K, 2)
    t = make_gpt_oss_moe(E, 80, INTER, mxfp4=True)
    with pytest.raises(ValueError, match="gate_up_proj: the MXFP4-blocked dimension 80 is not a multiple of 32"):
        load_from_tensors(MoELayer(shape, StaticGroup(2, 0)), t, 0, gpt_oss_moe_mappings(0, True))
    t = make_gpt_oss_moe(E, H, INTER, mxfp4=True)
    t[EX + "down_proj_scales"] = t[EX + "down_proj_scales"][:, :, :3]
    with pytest.raises(ValueError, match=r"down_proj_scales: checkpoint shape \(8, 96, 3\) != expected \(8, 96, 5\)"):
        load_from_tensors(MoELayer(MoEShape(H, INTER, E, K, 2), StaticGroup(2, 0)), t, 0,
                          gpt_oss_moe_mappings(0, True))
    with pytest.raises(KeyError, match="neither"):
        gpt_oss_checkpoint_is_mxfp4(SafetensorsCheckpoint(ckpts["bf16"][0]), 3)


def test_size_one_layer_equals_moe_torch_and_logs_bypassed_collectives(ckpts):
    path, ref = ckpts["bf16"]
    layer, _ = _load(path, MoEShape(H, INTER, E, K, 1), 0)
    x = torch.randn(6, H)
    want, _, _ = moe_torch(x, ref["w_router"], ref["w_gate_up"], ref["w_down"], top_k=K, b_router=ref["b_router"],
                           b_gate_up=ref["b_gate_up"], b_down=ref["b_down"], gamma=ref["gamma"], hidden_actual=H)
    log = layer.tp_group.log
    with torch.no_grad(), log.capture() as cap:
        assert_close_global(layer(x, sequence_parallel=True), want)
        assert_close_global(layer(x), want)
    assert cap.ops(include_bypassed=True) == [("all_gather", "static"), ("all_gather", "static"),
                                               ("reduce_scatter", "static"), ("all_reduce", "static")]
    assert cap.count() == 0  # all bypassed at size 1
    # A decode batch above the TKG kernel's 128-token limit: several kernel calls, one all-reduce.
    x = torch.randn(130, H)
    want, _, _ = moe_torch(x, ref["w_router"], ref["w_gate_up"], ref["w_down"], top_k=K, b_router=ref["b_router"],
                           b_gate_up=ref["b_gate_up"], b_down=ref["b_down"], gamma=ref["gamma"], hidden_actual=H)
    with torch.no_grad(), log.capture() as cap:
        assert_close_global(layer(x), want)
    assert cap.ops(include_bypassed=True) == [("all_reduce", "static")]


def test_prefill_routing_gather_recovers_indices_even_with_ties_and_zero_affinities(monkeypatch):
    shape = MoEShape(H, INTER, E, K, 1, hidden_padded=128)
    layer = MoELayer(shape, StaticGroup(), dtype=torch.float32, backend="torch")
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 1000.0       # token 0: expert 0 dominates, the other 3 selected get 0
    seen = {}
    real = moe_layer.moe_cte

    def spy(x, index, aff, *a, **kw):
        seen["index"], seen["aff"] = index, aff
        return real(x, index, aff, *a, **kw)

    monkeypatch.setattr(moe_layer, "moe_cte", spy)
    x = torch.zeros(3, H)
    x[0, 0] = 1.0                                  # rows 1, 2: every logit equal (ties)
    layer(x, sequence_parallel=True)
    _, index, aff = router_torch(x, torch.nn.functional.pad(layer.router.weight[:H], (0, 0)), top_k=K)
    assert (aff[0, 1:] == 0).all()                 # underflowed affinities: still selected
    for t in range(3):
        assert sorted(seen["index"][t].tolist()) == sorted(index[t].tolist())
        order = seen["index"][t].argsort()
        assert torch.equal(seen["aff"][t][order], aff[t][index[t].argsort()])
    assert (seen["aff"] > UNSELECTED).all()


def test_router_module_matches_reference_and_checks_input():
    shape = MoEShape(H, INTER, E, K, 1)
    assert shape.hidden_padded == 512
    r = MoERouter(shape, mode="softmax_topk", renormalize=True, dtype=torch.float32, backend="torch")
    with torch.no_grad():
        r.weight[:H].copy_(torch.randn(H, E))
        r.bias.copy_(torch.randn(E))
    x = torch.cat([torch.randn(5, H), torch.zeros(5, shape.hidden_padded - H)], dim=1)
    got = r(x)
    want = router_torch(x[:, :H], r.weight[:H], r.bias, top_k=K, mode="softmax_topk", renormalize=True)
    assert torch.equal(got[1], want[1]) and torch.allclose(got[2], want[2])
    with pytest.raises(ValueError, match=r"MoERouter: x must be \[T, hidden_padded=512\], got \(5, 96\)"):
        r(x[:, :H])
    with pytest.raises(ValueError, match="MoERouter: mode must be one of"):
        MoERouter(shape, mode="sigmoid")


def test_layer_input_errors():
    shape = MoEShape(H, INTER, E, K, 2)
    with pytest.raises(ValueError, match="tp_group world_size=1 != shape.tp_size=2"):
        MoELayer(shape, StaticGroup())
    with pytest.raises(ValueError, match="activation must be one of"):
        MoELayer(MoEShape(H, INTER, E, K, 1), StaticGroup(), activation="gelu")
    layer = MoELayer(MoEShape(H, INTER, E, K, 1), StaticGroup(), backend="torch")
    with pytest.raises(ValueError, match=r"MoELayer.decode: x must be \[T, 96\] or \[T, 512\] \(padded\), got "
                                         r"\(4, 100\)"):
        layer(torch.zeros(4, 100))
    with pytest.raises(ValueError, match="MoELayer.prefill: x has no tokens"):
        layer(torch.zeros(0, H, dtype=torch.bfloat16), sequence_parallel=True)


def test_backend_and_lnc_reach_the_kernel_entries(monkeypatch):
    seen = []

    def spy(name, real):
        def call(*a, **kw):
            seen.append((name, kw["backend"], kw.get("lnc")))
            return real(*a, **{**kw, "backend": "torch"})
        return call

    monkeypatch.setattr(moe_layer, "moe_cte", spy("moe_cte", moe_layer.moe_cte))
    monkeypatch.setattr(moe_layer, "moe_tkg", spy("moe_tkg", moe_layer.moe_tkg))
    monkeypatch.setattr(moe_router, "router_entry", spy("router", moe_router.router_entry))
    layer = MoELayer(MoEShape(H, INTER, E, K, 1), StaticGroup(), backend="nkisim", lnc=2)
    x = torch.randn(4, H, dtype=torch.bfloat16)
    layer(x, sequence_parallel=True)
    layer(x)
    assert seen == [("router", "nkisim", None), ("moe_cte", "nkisim", 2), ("moe_tkg", "nkisim", 2)]


def test_load_gpt_oss_from_a_sharded_checkpoint_directory(tmp_path):
    """Decoder layer 1's MoE, spread over two .safetensors files with an index (as the published checkpoints are)."""
    import json

    from safetensors.torch import save_file

    t = make_gpt_oss_moe(E, H, INTER, layer=1, mxfp4=True, seed=9)
    keys = sorted(t)
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in halves.items():
        save_file({k: t[k] for k in ks}, tmp_path / name)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: name for name, ks in halves.items() for k in ks}}))
    ref = full_kernel_weights(t, layer=1)
    shape = MoEShape(H, INTER, E, K, 2)
    layer = MoELayer(shape, StaticGroup(2, 1), dtype=torch.float32, norm_eps=1e-5, backend="torch")
    state = layer.load_gpt_oss(tmp_path, 1)
    assert set(state) == {n for n, _ in layer.named_parameters()}
    assert torch.equal(layer.w_down[:, :, :H], ref["w_down"][:, 80:])
    assert torch.equal(layer.gamma[:H], ref["gamma"])


def test_rows_last_dequant_is_dequant_mxfp4_transposed_bit_for_bit():
    """The loaders' layout-aware MXFP4 decode against moe_torch.dequant_mxfp4 followed by the transpose, every byte
    and scale code (NaN and the subnormal 2^-127 included), one and two row axes, strided inputs."""
    from modules.moe.loaders import dequant_mxfp4_rows_last
    from nki_kernels.moe.moe_torch import dequant_mxfp4

    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (2, 12, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, (2, 12, 4), dtype=torch.uint8, generator=g)
    scales[0, :2] = torch.tensor([0, 255, 1, 254])
    want = dequant_mxfp4(blocks, scales)                                       # [E, R, 128]
    same = lambda a, b: torch.equal(a.view(torch.int32), b.contiguous().view(torch.int32))  # noqa: E731 - NaN-safe
    assert same(dequant_mxfp4_rows_last(blocks, scales), want.transpose(1, 2))
    # Rows 2i + j viewed as [j, i] (the gate/up interleave): a strided two-row-axis input.
    got = dequant_mxfp4_rows_last(blocks.view(2, 6, 2, 4, 16).transpose(1, 2), scales.view(2, 6, 2, 4).transpose(1, 2))
    assert same(got, want.view(2, 6, 2, 128).permute(0, 3, 2, 1))


@pytest.mark.parametrize("form", ["bf16", "mxfp4"])
def test_load_gpt_oss_pipelined_equals_sequential(ckpts, form):
    path = ckpts[form][0]
    shape = MoEShape(H, INTER, E, K, 2)
    for rank in range(2):
        a, b = (MoELayer(shape, StaticGroup(2, rank), dtype=torch.bfloat16, norm_eps=1e-5, backend="torch")
                for _ in range(2))
        sa, sb = a.load_gpt_oss(path, 0, pipelined=False), b.load_gpt_oss(path, 0)
        assert list(sa) == list(sb) == [n for n, _ in a.named_parameters()]
        for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert torch.equal(p.view(torch.int16), q.view(torch.int16)), n  # bit for bit
