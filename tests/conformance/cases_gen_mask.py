"""core/attention gen_mask_tkg: shapes of test/integration/nkilib/core/attention/test_gen_mask_tkg.py (flat KV strided
and non-strided MM1, block KV, sliding window, active mask with batch sharding / batch offsets; LNC=1 and 2; full
s_prior and FA tiles), exact (atol = rtol = 0) as the test requires.
The driver kernel (HBM <-> SBUF around gen_mask_tkg with an SbufManager) and the reference adapter over the library's
gen_mask_tkg_torch_ref are ours."""

import nki
import nki.isa as nisa
import nki.language as nl
import numpy as np

from bench.peers import nkilib

from .harness import Case

P = 128
_SRC = "test/integration/nkilib/core/attention/test_gen_mask_tkg.py"


@nki.jit
def gen_mask_tkg(pos_ids, bs, q_head, s_active, sharded, s_prior_per_shard, n_tiles, s_prior_offset, block_len,
                 strided_mm1, start_pos=None, active_mask=None, batch_sharded=False, batch_offset=0):
    """pos_ids [P, bs*s_active] (and start_pos for a sliding window) -> the mask gen_mask_tkg writes in SBUF, stored
    per shard; the active mask stays in HBM, as gen_mask_tkg takes it."""
    gen = nkilib.load("core.attention.gen_mask_tkg:gen_mask_tkg")
    manager = nkilib.load("core.utils.allocator:SbufManager")
    logger = nkilib.load("core.utils.logging:Logger")
    lnc, shard = nl.num_programs(0), nl.program_id(0)
    sbm = manager(0, P * n_tiles * bs * q_head * s_active * 8, logger("gen_mask_conformance"), use_auto_alloc=True)
    sbm.open_scope(name="gen_mask_conformance")
    pos = sbm.alloc_stack((P, bs * s_active), dtype=pos_ids.dtype, buffer=nl.sbuf, name="pos_ids")
    mask = sbm.alloc_stack((P, n_tiles, bs, q_head, s_active), dtype=nl.float32, buffer=nl.sbuf, name="mask")
    nisa.dma_copy(dst=pos, src=pos_ids)
    start = None
    if start_pos is not None:
        start = sbm.alloc_stack((P, bs * s_active), dtype=start_pos.dtype, buffer=nl.sbuf, name="start_pos")
        nisa.dma_copy(dst=start, src=start_pos)
    gen(pos_ids=pos, mask_out=mask, bs=bs, q_head=q_head, s_active=s_active, is_s_prior_sharded=sharded,
        s_prior_per_shard=s_prior_per_shard, start_pos=start, s_prior_offset=s_prior_offset, block_len=block_len,
        strided_mm1=strided_mm1, active_mask=active_mask, sbm=sbm, is_batch_sharded=batch_sharded,
        batch_offset=batch_offset)
    out = nl.ndarray((lnc, P, n_tiles, bs, q_head, s_active), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[shard], src=mask)
    sbm.close_scope()
    return out


def _reference(pos_ids, bs, q_head, s_active, sharded, s_prior_per_shard, n_tiles, s_prior_offset, block_len,
               strided_mm1, lnc, start_pos=None, active_mask=None, batch_sharded=False, batch_offset=0):
    import torch
    ref = nkilib.load("core.attention.gen_mask_tkg_torch:gen_mask_tkg_torch_ref")
    out = torch.zeros((lnc, P, n_tiles, bs, q_head, s_active), dtype=torch.float32)
    for shard in range(lnc):
        ref.shard_id = shard
        # batch_offset reaches the reference only at LNC=1, as the library test's adapter wires it
        ref[lnc](pos_ids=pos_ids.float(), mask_out=out[shard], bs=bs, q_head=q_head, s_active=s_active,
                 is_s_prior_sharded=sharded, s_prior_per_shard=s_prior_per_shard,
                 start_pos=None if start_pos is None else start_pos.float(), s_prior_offset=s_prior_offset,
                 block_len=block_len, strided_mm1=strided_mm1,
                 active_mask=None if active_mask is None else active_mask.float(), is_batch_sharded=batch_sharded,
                 **({"batch_offset": batch_offset} if lnc == 1 else {}))
    return {"golden_mask": out}


def _case(batch, q_head, s_ctx, s_active, block_len, s_prior_offset, fa_tile, lnc, strided_mm1, test, target="trn2",
          window=0, active=False, batch_offset=0, bs_full=None):
    def inputs():
        utils = nkilib.load("core.attention.attention_tkg_utils")
        cfg = utils.AttnTKGConfig(bs=batch, q_head=q_head, s_active=s_active, curr_sprior=s_ctx)
        sharded = lnc > 1 and utils.is_s_prior_sharded(cfg.bs, cfg.q_head, cfg.s_active, cfg.curr_sprior, P)
        per_shard = s_ctx // lnc if sharded else s_ctx
        n_tiles = (fa_tile or per_shard) // P
        blk = block_len
        if block_len:
            blk, _ = utils.resize_cache_block_len_for_attention_tkg_kernel(
                s_ctx // block_len, block_len, lnc, P, batch, q_head, s_active, enable_fa_s_prior_tiling=fa_tile > 0)
        rng = np.random.default_rng(s_ctx + batch + q_head)
        cache_lens = rng.integers(1, s_ctx - s_active if window else s_ctx, size=batch)
        # a sliding window numbers the active tokens pos, pos+1, ... (the flat cache is a circular buffer)
        pos = cache_lens[:, None] + (np.arange(s_active)[None, :] if window else np.zeros((1, s_active), int))
        kw = {"pos_ids": _rows(pos), "bs": batch, "q_head": q_head, "s_active": s_active, "sharded": bool(sharded),
              "s_prior_per_shard": per_shard, "n_tiles": n_tiles, "s_prior_offset": s_prior_offset,
              "block_len": blk, "strided_mm1": strided_mm1}
        if window:
            lo = pos - window + 1
            kw["start_pos"] = _rows(np.maximum(lo, 0) if block_len else lo % s_ctx)
        if active:
            batch_sharded = lnc > 1 and utils.is_batch_sharded(cfg.bs, cfg.q_head, cfg.s_active, cfg.curr_sprior, P)
            full = bs_full or (batch * lnc if batch_sharded else batch)
            causal = np.tril(np.ones((s_active, s_active), np.float32))  # [q, k] lower triangular
            # [k, batch, head, q]: the transposed layout the test hands the kernel
            kw["active_mask"] = np.ascontiguousarray(np.broadcast_to(causal.T[:, None, None, :],
                                                                     (s_active, full, q_head, s_active)))
            kw["batch_sharded"] = bool(batch_sharded)
            kw["batch_offset"] = batch_offset
        return kw

    return Case(gen_mask_tkg, _reference,
                f"b{batch}_qh{q_head}_sc{s_ctx}_sa{s_active}_bl{block_len}_spo{s_prior_offset}_fa{fa_tile}"
                f"{'_smm1' if strided_mm1 else ''}{f'_sw{window}' if window else ''}{'_am' if active else ''}"
                f"{f'_bo{batch_offset}of{bs_full}' if batch_offset else ''}", inputs, atol=0.0, rtol=0.0,
                source=f"{_SRC}::{test}", target=target, lnc=lnc, ref_inputs=lambda kw: {**kw, "lnc": lnc},
                exact=("golden_mask",))


def _rows(values):
    """[batch, s_active] positions -> the [P, batch*s_active] fp32 rows every partition holds."""
    row = np.asarray(values, np.float32).reshape(-1)
    return np.ascontiguousarray(np.broadcast_to(row, (P, row.size)))


_STRIDED = "test_flat_kv_strided_mask_generation"
_FLAT = "test_flat_kv_nonstrided_mask_generation"
_BLOCK = "test_block_kv_mask_generation"
_SWA = "test_swa_mask_generation"
_ACTIVE = "test_flat_kv_with_active_mask"
CASES = [
    *(_case(b, qh, sc, sa, 0, spo, fa, lnc, True, _STRIDED) for b, qh, sc, sa, spo, fa, lnc in [
        (4, 1, 256, 1, 0, 0, 1), (4, 1, 1024, 5, 0, 0, 1), (4, 2, 2048, 7, 0, 0, 1), (4, 1, 1024, 5, 512, 256, 1),
        (4, 2, 16384, 7, 0, 0, 2), (4, 1, 4096, 5, 768, 256, 2), (8, 8, 4096, 5, 1536, 256, 2)]),
    *(_case(b, qh, sc, sa, 0, spo, fa, lnc, False, _FLAT) for b, qh, sc, sa, spo, fa, lnc in [
        (4, 1, 512, 1, 0, 0, 1), (4, 1, 1024, 5, 256, 256, 1), (4, 1, 4096, 5, 0, 0, 2),
        (8, 8, 4096, 5, 1536, 512, 2)]),
    *(_case(b, qh, sc, sa, bl, spo, fa, lnc, False, _BLOCK) for b, qh, sc, sa, bl, spo, fa, lnc in [
        (4, 1, 256, 5, 16, 0, 0, 1), (4, 1, 2048, 5, 32, 0, 0, 1), (4, 1, 4096, 5, 16, 2048, 2048, 1),
        (4, 1, 10240, 5, 16, 8192, 2048, 1), (4, 1, 8192, 5, 16, 0, 0, 2), (8, 8, 10240, 5, 16, 8192, 2048, 2)]),
    *(_case(b, qh, sc, sa, bl, spo, fa, lnc, smm1, _SWA, window=sw) for b, qh, sc, sa, bl, sw, smm1, spo, fa, lnc in [
        (4, 1, 1024, 5, 0, 64, True, 0, 0, 1), (4, 2, 2048, 7, 0, 128, True, 0, 0, 1),
        (4, 2, 4096, 7, 0, 256, True, 0, 0, 2), (4, 1, 1024, 5, 0, 256, False, 0, 0, 1),
        (4, 1, 1024, 5, 16, 128, False, 0, 0, 1), (4, 1, 8192, 5, 16, 256, False, 0, 0, 2),
        (4, 1, 1024, 5, 0, 128, True, 512, 256, 1), (4, 1, 4096, 5, 16, 128, False, 2048, 2048, 1),
        (4, 1, 2048, 1, 16, 256, False, 0, 0, 1), (8, 8, 4096, 5, 16, 128, False, 0, 0, 2)]),
    *(_case(b, qh, sc, sa, 0, spo, fa, lnc, smm1, _ACTIVE, window=sw, active=True, batch_offset=bo, bs_full=full)
      for b, qh, sc, sa, smm1, sw, spo, fa, lnc, bo, full in [
        (4, 1, 256, 5, True, 0, 0, 0, 1, 0, None), (4, 2, 512, 5, False, 0, 0, 0, 1, 0, None),
        (4, 1, 1024, 5, True, 0, 768, 256, 1, 0, None), (4, 2, 4096, 5, True, 0, 0, 0, 2, 0, None),
        (80, 8, 256, 8, True, 0, 0, 256, 2, 0, None), (80, 8, 256, 7, True, 0, 0, 0, 1, 0, None),
        (32, 8, 256, 5, False, 0, 0, 256, 2, 0, None), (4, 1, 4096, 16, True, 0, 0, 0, 2, 0, None),
        (26, 1, 256, 5, True, 0, 0, 256, 2, 0, None), (4, 2, 4096, 5, True, 128, 0, 0, 2, 0, None),
        (3, 2, 512, 5, True, 0, 0, 0, 1, 3, 7), (2, 1, 256, 5, False, 0, 0, 0, 1, 2, 4),
        (2, 2, 4096, 5, True, 0, 0, 0, 2, 2, 4), (40, 8, 256, 8, True, 0, 0, 256, 2, 40, 160),
        (2, 1, 1024, 5, False, 128, 768, 256, 1, 2, 4), (2, 2, 4096, 5, True, 256, 0, 0, 2, 2, 4)]),
    _case(4, 1, 1024, 5, 0, 0, 0, 1, True, _STRIDED, target="trn3"),
    _case(80, 8, 256, 8, 0, 0, 256, 2, True, _ACTIVE, target="trn3", active=True),
    _case(4, 1, 4096, 5, 16, 0, 0, 2, False, _BLOCK, target="trn3"),
]
