"""The TP-without-EP MoE layer on real gloo groups at world 2/4/8, loaded from real GPT-OSS-layout safetensors files
(bf16 and MXFP4 forms), equals the unsharded layer (moe_torch on the full weights) in prefill (SP) and decode; the
collective log is the seed's; decode is the all-reduce of decode_partial; each rank read only its slice of the expert
tensors."""

import pytest
import torch

from modules.loading import SafetensorsCheckpoint
from modules.moe import MoELayer, MoEShape, gpt_oss_checkpoint_is_mxfp4, gpt_oss_moe_mappings, mx_aligned_intermediate
from modules.parallel.coordinator import CollectiveLog, GroupCoordinator
from modules.testing import assert_close_global, run_distributed
from modules.testing.gpt_oss_moe import full_kernel_weights, make_gpt_oss_moe, save_checkpoint
from nki_kernels.moe.moe_torch import MX_BLOCK, moe_torch

E, H, INTER, K = 8, 96, 160, 4          # H pads to 128; I = 5 MX blocks
T_PREFILL, T_DECODE, EPS = 16, 5, 1e-5
EX = "model.layers.0.mlp.experts."


def _shape(form, n):
    # bf16: I padded so every shard is MX-aligned (at tp 8 ranks 5..7 hold only padding); mxfp4: unpadded, so the
    # down_proj shards cut through MX blocks and are read as whole covering blocks.
    return MoEShape(H, INTER, E, K, n, intermediate_padded=mx_aligned_intermediate(INTER, n) if form == "bf16" else 0)


def _reference(ref, x, norm):
    out, _, _ = moe_torch(x, ref["w_router"], ref["w_gate_up"], ref["w_down"], top_k=K, b_router=ref["b_router"],
                          b_gate_up=ref["b_gate_up"], b_down=ref["b_down"], gamma=ref["gamma"] if norm else None,
                          eps=EPS, hidden_actual=H)
    return out


def _check_moe(rank, world_size, paths):
    from safetensors.torch import load_file

    n = world_size
    log = CollectiveLog()
    group = GroupCoordinator([list(range(n))], "tp", log=log)
    g = torch.Generator().manual_seed(11)
    x_prefill, x_decode = torch.randn(T_PREFILL, H, generator=g), torch.randn(T_DECODE, H, generator=g)
    chunk = T_PREFILL // n
    reads = {}
    for form, path in paths.items():
        norm = form == "bf16"  # the fused RMSNorm on one form, none on the other
        ref = full_kernel_weights(load_file(f"{path}/model.safetensors"))
        shape = _shape(form, n)
        ckpt = SafetensorsCheckpoint(path)
        assert gpt_oss_checkpoint_is_mxfp4(ckpt, 0) == (form == "mxfp4")
        layer = MoELayer(shape, group, dtype=torch.float32, norm_eps=EPS if norm else None, backend="torch")
        ckpt.load_sharded(group.rank_in_group, n, layer, gpt_oss_moe_mappings(0, form == "mxfp4", norm=norm))
        reads[form] = dict(ckpt.bytes_read)
        Hp = shape.hidden_padded
        with torch.no_grad():
            # Prefill: this rank's SP chunk of the sequence, at the real width H.
            want = _reference(ref, x_prefill, norm)
            with log.capture() as cap:
                got = layer(x_prefill[rank * chunk:(rank + 1) * chunk], sequence_parallel=True)
            assert_close_global(got, want[rank * chunk:(rank + 1) * chunk], msg=f"{form} prefill")
            assert [(r.op, r.group, r.shape) for r in cap.records] == [
                ("all_gather", "tp", (chunk, Hp)), ("all_gather", "tp", (chunk, E)),
                ("reduce_scatter", "tp", (T_PREFILL, Hp))], cap.records
            # Decode: every rank holds all tokens, here at the padded width (the pad stays zero).
            xd = torch.cat([x_decode, torch.zeros(T_DECODE, Hp - H)], dim=1)
            with log.capture() as cap:
                got = layer(xd)
            assert [(r.op, r.group, r.shape) for r in cap.records] == [("all_reduce", "tp", (T_DECODE, Hp))]
            want = _reference(ref, x_decode, norm)
            assert_close_global(got[:, :H], want, msg=f"{form} decode")
            assert torch.equal(got[:, H:], torch.zeros(T_DECODE, Hp - H))
            # decode_partial: no collective, and the all-reduce of the partials is decode, bit for bit (same
            # buffer, same collective); at the real width H it is the first H columns of it.
            with log.capture() as cap:
                part, part_h = layer.decode_partial(xd), layer.decode_partial(x_decode)
            assert cap.records == [] and part.shape == (T_DECODE, Hp) and part_h.shape == (T_DECODE, H)
            assert torch.equal(part_h, part[:, :H])
            assert torch.equal(group.all_reduce(part), got)
            assert not torch.allclose(part[:, :H], want, atol=1e-3)  # a partial sum, not the output
            if form == "bf16":
                # bf16 activations and weights: bf16 collectives, bf16 rounding of partials before the sum.
                layer16 = MoELayer(shape, group, dtype=torch.bfloat16, norm_eps=EPS, backend="torch")
                layer16.load_gpt_oss(path, 0)
                assert_close_global(layer16(x_decode.bfloat16()), want, rtol=2e-2, msg="bf16 decode")
                got16 = layer16(x_prefill[rank * chunk:(rank + 1) * chunk].bfloat16(), sequence_parallel=True)
                assert_close_global(got16, _reference(ref, x_prefill, norm)[rank * chunk:(rank + 1) * chunk],
                                    rtol=2e-2, msg="bf16 prefill")
    return reads


def _expected_reads(form, n, rank):
    """Bytes each expert tensor read by rank: its own I-shard only (MXFP4 down_proj: the whole blocks covering it)."""
    start, stop = _shape(form, n).i_range(rank)
    m = stop - start
    if form == "bf16":
        return {EX + "gate_up_proj": E * H * 2 * m * 2, EX + "down_proj": E * m * H * 2,
                EX + "gate_up_proj_bias": E * 2 * m * 2}
    blocks = -(-stop // MX_BLOCK) - start // MX_BLOCK if m else 0
    return {EX + "gate_up_proj_blocks": E * 2 * m * (H // MX_BLOCK) * 16,
            EX + "gate_up_proj_scales": E * 2 * m * (H // MX_BLOCK),
            EX + "down_proj_blocks": E * H * blocks * 16, EX + "down_proj_scales": E * H * blocks,
            EX + "gate_up_proj_bias": E * 2 * m * 2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_moe")
    return {form: str(save_checkpoint(make_gpt_oss_moe(E, H, INTER, mxfp4=form == "mxfp4", seed=3), root / form))
            for form in ("bf16", "mxfp4")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_moe_layer_equals_unsharded(world_size, checkpoints):
    reads = run_distributed(_check_moe, world_size, checkpoints, timeout=100)
    for rank, per_form in enumerate(reads):
        for form, got in per_form.items():
            for key, nbytes in _expected_reads(form, world_size, rank).items():
                assert got.get(key, 0) == nbytes, (form, rank, key)
    # Together the ranks read each plain expert tensor exactly once.
    full = E * H * 2 * INTER * 2
    assert sum(r["bf16"].get(EX + "gate_up_proj", 0) for r in reads) == full


def _check_moe_kernels(rank, world_size, paths, lnc):
    """The same flows with the NKI kernels (router, CTE, TKG) on nkisim, bf16 weights and activations."""
    import nkisim

    nkisim.install()  # a fresh rank process: serve `import nki` from the interpreter
    from safetensors.torch import load_file

    n = world_size
    log = CollectiveLog()
    group = GroupCoordinator([list(range(n))], "tp", log=log)
    g = torch.Generator().manual_seed(12)
    x_prefill, x_decode = torch.randn(T_PREFILL, H, generator=g), torch.randn(T_DECODE, H, generator=g)
    chunk = T_PREFILL // n
    for form, path in paths.items():
        ref = full_kernel_weights(load_file(f"{path}/model.safetensors"))
        layer = MoELayer(_shape(form, n), group, norm_eps=EPS, backend="nkisim", lnc=lnc)
        layer.load_gpt_oss(path, 0)
        with torch.no_grad(), log.capture() as cap:
            got = layer(x_prefill[rank * chunk:(rank + 1) * chunk].bfloat16(), sequence_parallel=True)
            assert_close_global(got, _reference(ref, x_prefill, True)[rank * chunk:(rank + 1) * chunk], rtol=2e-2,
                                msg=f"{form} nkisim prefill")
            got = layer(x_decode.bfloat16())
            assert_close_global(got, _reference(ref, x_decode, True), rtol=2e-2, msg=f"{form} nkisim decode")
            assert not got.isnan().any()
        assert cap.ops() == [("all_gather", "tp"), ("all_gather", "tp"), ("reduce_scatter", "tp"), ("all_reduce", "tp")]
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size, lnc", [(2, 1), (4, 2)])
def test_moe_layer_with_nkisim_kernels(world_size, lnc, checkpoints):
    assert all(run_distributed(_check_moe_kernels, world_size, checkpoints, lnc, timeout=110))
