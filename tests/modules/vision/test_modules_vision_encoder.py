"""The Qwen3-VL vision encoder: single-process numerics against an independent per-image reference, sharded
loading from HF-layout safetensors, and gloo worlds running every mode of the vision seed's table (the fat output
equal across modes, padding blocks never reaching it)."""

from pathlib import Path

import pytest
import torch
from vision_helpers import (
    BLOCK,
    GRIDS,
    TINY,
    assert_bf16_close,
    random_pixels,
    random_tensors,
    reference_forward,
    write_checkpoint,
)

from modules.config import NeuronConfig, VisionNeuronConfig
from modules.loading.checkpoint import SafetensorsCheckpoint
from modules.parallel.coordinator import StaticGroup
from modules.parallel.state import initialize_parallel_state
from modules.testing import run_distributed
from modules.vision import Qwen3VLVisionEncoder, pack_images


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(TINY, tmp_path_factory.mktemp("qwen3vl") / "ckpt")


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    return reference_forward(random_tensors(TINY), TINY, random_pixels(TINY, GRIDS), GRIDS)


def _encoder(ckpt, tp=1, rank=0, backend="torch"):
    enc = Qwen3VLVisionEncoder(TINY, StaticGroup(tp, rank), backend=backend)
    enc.load_checkpoint(ckpt)
    return enc


def test_matches_reference_single_rank(ckpt, reference):
    enc = _encoder(ckpt)
    packed = pack_images(random_pixels(TINY, GRIDS), GRIDS, TINY, BLOCK)
    assert (packed.num_blocks, packed.num_real_blocks) == (3, 3)
    fat = enc(packed)
    assert fat.shape == (sum(g.tokens for g in GRIDS) // 4, TINY.out_hidden_size * 3)
    assert_bf16_close(fat, reference, "tp1 dp1 vs reference")


@pytest.mark.parametrize("lnc,block", [(1, BLOCK), (2, 2 * BLOCK)])
def test_nkisim_kernel_matches_reference(ckpt, reference, lnc, block):
    # The NKI kernel itself (on the interpreter) in every layer; at LNC 2 a block holds two query tiles per core pair.
    packed = pack_images(random_pixels(TINY, GRIDS), GRIDS, TINY, block, dp_size=2)
    enc = Qwen3VLVisionEncoder(TINY, StaticGroup(), backend="nkisim", lnc=lnc)
    enc.load_checkpoint(ckpt)
    if lnc == 2:
        with pytest.raises(ValueError, match=r"block_size=128 must be a multiple of 256 at lnc=2"):
            enc(pack_images(random_pixels(TINY, GRIDS), GRIDS, TINY, BLOCK))
    fat = enc(packed)
    assert_bf16_close(fat, reference, f"nkisim lnc {lnc} vs reference")
    assert_bf16_close(fat, _encoder(ckpt)(packed), f"nkisim lnc {lnc} vs torch backend")


def test_padding_blocks_are_zero_and_never_reach_the_output(ckpt, reference):
    enc = _encoder(ckpt)
    px = random_pixels(TINY, GRIDS)
    packed = pack_images(px, GRIDS, TINY, BLOCK, num_blocks=5)
    assert (packed.num_blocks, packed.num_real_blocks) == (5, 3)
    # Poison the padding: huge pixels in the two padding blocks and in the free rows of the real ones. Their
    # bounds stay empty, so no real query may see them and their merged rows must come out exactly zero.
    pad_rows = packed.bound_max <= packed.bound_min
    assert pad_rows[3:].all() and pad_rows[:3].any()
    poisoned = packed.pixel_values.clone()
    poisoned[pad_rows] = 1e4
    packed = packed.replace_blocks(pixel_values=poisoned)
    feats = enc.encode_blocks(packed.block_tensors())
    merged_pad = pad_rows[:, ::TINY.merge_unit]
    for f in feats:
        assert torch.equal(f[merged_pad], torch.zeros_like(f[merged_pad]))
        assert f[~merged_pad].abs().amax() > 0
    assert_bf16_close(enc(packed), reference, "padded + poisoned vs reference")
    # unpack_indices never point into padding.
    flat_pad = merged_pad.reshape(-1)
    assert not flat_pad[packed.unpack_indices].any()


def test_sharded_load_reads_only_the_rank_slices(ckpt):
    full = random_tensors(TINY)
    tp = 2
    for rank in range(tp):
        enc = Qwen3VLVisionEncoder(TINY, StaticGroup(tp, rank), backend="torch")
        ck = SafetensorsCheckpoint(ckpt)
        enc.load_checkpoint(ck)
        qkv = full["model.visual.blocks.1.attn.qkv.weight"].reshape(3, TINY.num_heads, TINY.head_dim, -1)
        heads = slice(rank * 2, rank * 2 + 2)
        assert torch.equal(enc.blocks[1].attn.qkv.weight, qkv[:, heads].reshape(-1, TINY.hidden_size))
        fc2 = full["model.visual.merger.linear_fc2.weight"]
        half = fc2.shape[1] // tp
        assert torch.equal(enc.merger.linear_fc2.weight, fc2[:, rank * half:(rank + 1) * half])
        # Column/row-parallel weights are read half at a time; replicated ones in full.
        nbytes = {k: v.numel() * 2 for k, v in full.items()}
        for key in ("blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.2.mlp.linear_fc1.weight",
                    "deepstack_merger_list.1.linear_fc2.weight"):
            assert ck.bytes_read["model.visual." + key] == nbytes["model.visual." + key] // tp
        assert ck.bytes_read["model.visual.pos_embed.weight"] == nbytes["model.visual.pos_embed.weight"]
        assert "model.language_model.embed_tokens.weight" not in ck.bytes_read


# ---- gloo worlds -----------------------------------------------------------------------------------------------
def _run_modes(rank, world_size, ckpt, text_tp, modes, backend="torch"):
    if backend == "nkisim":
        import nkisim

        nkisim.install()          # a fresh rank process: serve `import nki` from the interpreter
    px = random_pixels(TINY, GRIDS)
    out = []
    for kwargs in modes:
        vision = VisionNeuronConfig(**kwargs, buckets=((BLOCK, 3),))
        st = initialize_parallel_state(NeuronConfig(tp_size=text_tp, dp_size=world_size // text_tp), vision)
        enc = Qwen3VLVisionEncoder.from_parallel_state(TINY, st, backend=backend)
        enc.load_checkpoint(ckpt)
        packed = pack_images(px, GRIDS, TINY, BLOCK, num_blocks=vision.buckets[0][1])
        with st.log.capture() as log:
            fat = enc(packed)
        out.append({"mode": kwargs, "tp_dp": (vision.tp_size, vision.dp_size), "fat": fat.float(),
                    "num_blocks": packed.num_blocks, "tp_ranks": st.vision_tp.ranks,
                    "dp_ranks": None if st.vision_dp is None else st.vision_dp.ranks,
                    "reuses_text_tp": st.vision_tp is st.tp,
                    "all_reduce": log.count("all_reduce", st.vision_tp.name),
                    "all_gather": log.count("all_gather") if st.vision_dp is None
                    else log.count("all_gather", st.vision_dp.name)})
    return out


def _check_world(results, reference, world):
    n_mergers = TINY.num_outputs
    for per_rank in zip(*results):
        tp, dp = per_rank[0]["tp_dp"]
        assert tp * dp == world
        for r, res in enumerate(per_rank):
            what = f"world {world} mode {res['mode']} (tp {tp}, dp {dp}) rank {r}"
            assert_bf16_close(res["fat"], reference, what)
            # num_blocks padded to a multiple of dp at config time (3 real blocks → 4 at dp 2 and 4).
            assert res["num_blocks"] == -(-3 // dp) * dp
            assert res["tp_ranks"] == list(range(r // tp * tp, r // tp * tp + tp))
            assert res["dp_ranks"] == (None if dp == 1 else list(range(r % tp, world, tp)))
            # TP: two all-reduces per layer plus one per merger; DP: one gather per feature set.
            assert res["all_reduce"] == (0 if tp == 1 else 2 * TINY.depth + n_mergers), what
            assert res["all_gather"] == (0 if dp == 1 else n_mergers), what
        # Every rank returns the same fat output (bit-identical: the gather hands everyone the same blocks).
        assert all(torch.equal(res["fat"], per_rank[0]["fat"]) for res in per_rank)


@pytest.mark.timeout(120)
def test_every_mode_world4(ckpt, reference):
    # The seed's table at world 4: default (full DP), tp only (combined, then full TP), tp and dp both set.
    # Text TP 2: vision TP 2 reuses the text TP group, vision TP 1 and 4 get their own.
    modes = [{}, {"tp_size": 2}, {"tp_size": 4}, {"tp_size": 2, "dp_size": 2}]
    results = run_distributed(_run_modes, 4, str(ckpt), 2, modes, timeout=110)
    assert [m["tp_dp"] for m in results[0]] == [(1, 4), (2, 2), (4, 1), (2, 2)]
    assert [m["reuses_text_tp"] for m in results[0]] == [False, True, False, True]
    _check_world(results, reference, 4)


@pytest.mark.timeout(120)
def test_combined_mode_world16(ckpt, reference):
    results = run_distributed(_run_modes, 16, str(ckpt), 4, [{"tp_size": 4}], timeout=110)
    assert results[0][0]["tp_dp"] == (4, 4) and results[0][0]["reuses_text_tp"]
    # The seed's golden: DP columns [0,4,8,12], [1,5,9,13], ...
    assert [results[r][0]["dp_ranks"] for r in range(4)] == [[c, c + 4, c + 8, c + 12] for c in range(4)]
    _check_world(results, reference, 16)


@pytest.mark.timeout(120)
def test_nkisim_kernel_tp2_dp2_world4(ckpt, reference):
    # The NKI kernel on the interpreter inside the combined mode: each rank runs its 2 heads on its 2 blocks.
    results = run_distributed(_run_modes, 4, str(ckpt), 2, [{"tp_size": 2}], "nkisim", timeout=110)
    assert results[0][0]["tp_dp"] == (2, 2)
    _check_world(results, reference, 4)
