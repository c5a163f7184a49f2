"""core/attention: attention_tkg and attention_cte on shapes of the library's tests, against its torch references.

attention_tkg is a sub-kernel taking an SbufManager and preallocated outputs, so it runs inside `attention_tkg`
below, our launch kernel written the way test/integration/nkilib/core/attention/test_attention_tkg.py drives it
(SbufManager over the usable SBUF minus 16 KiB, outputs in shared_hbm or SBUF per the config, Q/K loaded to SBUF
when `qk_in_sb`). Inputs follow that test: uniform [0, 1) activations and caches (fp8 caches uniform over
[-240, 240]), a causal active mask when positions are given, else the library's build_full_attention_mask over
per-batch cache lengths; tolerance atol 1e-5 / rtol 1e-2 (3e-2 / 3e-2 with an fp8 KV cache), max mode; the reference
is attention_tkg_torch_ref[lnc] with its outputs rounded to the activation dtype. Shapes from the test's
attention_tkg_fast_configs (test_attn_tkg_fast runs LNC 1 and 2 on the platform given on the command line).
"""

import ml_dtypes
import numpy as np

from bench.peers import nkilib

from .harness import Case

TKG_SOURCE = "test/integration/nkilib/core/attention/test_attention_tkg.py::test_attn_tkg_fast"
BF16, FP8 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3


def attention_tkg(q, k_active, v_active, k_prior, v_prior, mask, inv_freqs, rope_pos_ids, start_pos_ids, sink,
                  active_blocks_table, cfg, out_shape, k_out_shape, out_dtype):
    """Launch kernel: allocate attention_tkg's outputs and SBUF manager, run it, return HBM outputs."""
    import nki.isa as nisa
    import nki.language as nl
    lib = nkilib.load("core.attention.attention_tkg")
    allocator = nkilib.load("core.utils.allocator:SbufManager")
    logger = nkilib.load("core.utils.logging:Logger")

    sbm = allocator(0, nl.tile_size.total_available_sbuf_size - 16 * 1024, logger("SBM"))
    sbm.open_scope()
    if cfg.out_in_sb:
        out = sbm.alloc_stack(out_shape, dtype=out_dtype, buffer=nl.sbuf)
    else:
        out = nl.ndarray(out_shape, dtype=out_dtype, buffer=nl.shared_hbm)
    k_out = None
    if cfg.fuse_rope:
        if cfg.k_out_in_sb:
            k_out = sbm.alloc_stack(k_out_shape, dtype=out_dtype, buffer=nl.sbuf)
        else:
            k_out = nl.ndarray(k_out_shape, dtype=out_dtype, buffer=nl.shared_hbm)
    if cfg.qk_in_sb:
        q_sb = sbm.alloc_stack(q.shape, dtype=q.dtype, buffer=nl.sbuf)
        k_sb = sbm.alloc_stack(k_active.shape, dtype=k_active.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=q_sb, src=q)
        nisa.dma_copy(dst=k_sb, src=k_active)
        q, k_active = q_sb, k_sb
    out, k_out = lib.attention_tkg(q, k_active, v_active, k_prior, v_prior, mask, out, cfg, sbm, inv_freqs,
                                   rope_pos_ids, start_pos_ids, sink, active_blocks_table, k_out)
    results = []
    for t in (out, k_out) if cfg.fuse_rope else (out,):
        if t.buffer == nl.sbuf:
            hbm = nl.ndarray(t.shape, dtype=t.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=hbm, src=t)
            t = hbm
        results.append(t)
    sbm.close_scope()
    return tuple(results)


def _tkg_reference(q, k_active, v_active, k_prior, v_prior, mask, inv_freqs, rope_pos_ids, start_pos_ids, sink,
                   active_blocks_table, cfg, out_shape, k_out_shape, out_dtype, lnc):
    import torch
    ref = nkilib.load("core.attention.attention_tkg_torch:attention_tkg_torch_ref")
    out = torch.zeros(out_shape, dtype=torch.float32)
    k_out = torch.zeros(k_out_shape, dtype=torch.float32) if cfg.fuse_rope else None
    out, k_out = ref[lnc](q=q, k_active=k_active, v_active=v_active, k_prior=k_prior, v_prior=v_prior, mask=mask,
                          out=out, cfg=cfg, sbm=None, inv_freqs=inv_freqs, rope_pos_ids=rope_pos_ids,
                          start_pos_ids=start_pos_ids, sink=sink, active_blocks_table=active_blocks_table,
                          k_out=k_out, DBG_TENSORS=None)
    np_dtype = {"bfloat16": BF16, "float32": np.float32}[str(out_dtype)]
    gold = {"out": out.numpy().astype(np_dtype)}
    if cfg.fuse_rope:
        gold["k_out"] = k_out.numpy().astype(np_dtype)
    return gold


def _tkg(lnc, target, bs, q_head, s_active, sprior, full_sprior, d_head, sink=False, fp8_kv=False, dtype=BF16,
         block_len=0, window=0, **flags):
    def config():
        return nkilib.load("core.attention.attention_tkg:AttnTKGConfig")(
            bs, q_head, s_active, sprior, full_sprior, d_head, block_len, **flags)

    def inputs():
        import nki.language as nl
        import torch
        cfg = config()
        rng = np.random.default_rng(42)
        kv_dtype = FP8 if fp8_kv else dtype

        def act(shape):
            return rng.random(shape).astype(dtype).astype(kv_dtype)

        def kv(shape):
            return ((rng.random(shape) * 480.0 - 240.0) if fp8_kv else rng.random(shape)).astype(kv_dtype)

        q = act((d_head, bs * q_head * s_active) if cfg.qk_in_sb else (bs, q_head, s_active, d_head))
        k_active = kv((d_head, bs * s_active) if cfg.qk_in_sb else (bs, 1, s_active, d_head))
        v_active = kv((bs, 1, s_active, d_head))
        if block_len:  # paged cache: bs * sprior / block_len blocks of [block_len, d]
            k_prior = kv((bs * sprior // block_len, block_len, d_head))
            v_prior = kv((bs * sprior // block_len, block_len, d_head))
        else:
            k_prior = kv((bs, 1, full_sprior, d_head) if cfg.tp_k_prior else (bs, 1, d_head, full_sprior))
            v_prior = kv((bs, 1, full_sprior, d_head))
        pos = ((np.arange(bs) * 3 + sprior // 4 * 3) % (sprior - s_active))[:, None]
        table = None
        if block_len:  # distinct random blocks per batch row, unused tail entries 0
            n_blocks = sprior // block_len
            table = rng.choice(bs * n_blocks, size=(bs, n_blocks), replace=False).astype(np.uint32)
            for b in range(bs):
                table[b, -(-(int(pos[b, 0]) + s_active) // block_len):] = 0
        positions = (pos + np.arange(s_active)[None, :]).astype(np.float32)
        start = None
        if window and (cfg.fuse_rope or cfg.use_pos_id):  # first visible position per query (flat cache: circular)
            start = positions - window + 1
            start = np.maximum(start, 0) if block_len else np.mod(start, sprior)
            start = start.astype(np.float32)
        if cfg.use_pos_id:  # causal mask over the active tokens, [s_active(k), B, H, s_active(q)]
            causal = np.tril(np.ones((s_active, s_active), np.uint8))
            mask = np.ascontiguousarray(np.broadcast_to(causal.T[:, None, None, :], (s_active, bs, q_head, s_active)))
        else:
            build = nkilib.load("core.attention.gen_mask_tkg_torch:build_full_attention_mask")
            mask = build(cache_lens=torch.from_numpy(pos.flatten().astype(np.float32)), batch=bs, num_heads=q_head,
                         s_active=s_active, s_ctx=sprior, lnc=lnc, block_len=block_len, include_active_mask=True,
                         transposed=True, enable_fa_s_prior_tiling=cfg.enable_fa_s_prior_tiling)
            mask = mask.numpy().astype(np.uint8)
        return {
            "q": q, "k_active": k_active, "v_active": v_active, "k_prior": k_prior, "v_prior": v_prior,
            "mask": mask,
            "inv_freqs": rng.random((d_head // 2, 1)).astype(np.float32) if cfg.fuse_rope else None,
            "rope_pos_ids": ((positions if window else np.broadcast_to(pos, (bs, s_active)).astype(np.float32))
                             if cfg.fuse_rope or cfg.use_pos_id else None),
            "start_pos_ids": start,
            "sink": rng.random((q_head, 1)).astype(np.float32) if sink else None,
            "active_blocks_table": table,
            "cfg": cfg,
            "out_shape": (d_head, bs * q_head * s_active) if cfg.out_in_sb else (bs, q_head, d_head, s_active),
            "k_out_shape": (d_head, bs * s_active) if cfg.k_out_in_sb else (bs, 1, d_head, s_active),
            "out_dtype": nl.float32 if dtype == np.float32 else nl.bfloat16,
        }

    def ref_inputs(kw):
        return dict(kw, lnc=lnc)

    short = {"tp_k_prior": "tpk", "use_pos_id": "pid", "fuse_rope": "rope", "qk_in_sb": "qsb", "out_in_sb": "osb",
             "k_out_in_sb": "kosb", "strided_mm1": "sm1"}
    shape = (f"b{bs}_h{q_head}_sa{s_active}_sp{sprior}_spf{full_sprior}_d{d_head}"
             + "".join(f"_{short.get(k, k)}{int(v)}" for k, v in flags.items())
             + ("_sink" if sink else "") + ("_fp8kv" if fp8_kv else "") + ("_fp32" if dtype == np.float32 else "")
             + (f"_bl{block_len}" if block_len else "") + (f"_swa{window}" if window else ""))
    tol = (3e-2, 3e-2) if fp8_kv else (1e-5, 1e-2)
    return Case(attention_tkg, _tkg_reference, shape, inputs, atol=tol[0], rtol=tol[1], source=TKG_SOURCE,
                target=target, lnc=lnc, ref_inputs=ref_inputs)


ROPE = {"tp_k_prior": True, "use_pos_id": True, "fuse_rope": True}
SB_IO = {"tp_k_prior": True, "qk_in_sb": True, "k_out_in_sb": True, "out_in_sb": True}
CASES = [
    _tkg(1, "trn2", 4, 1, 5, 1024, 10240, 128, **ROPE),
    _tkg(2, "trn2", 4, 1, 5, 1024, 10240, 128, **ROPE),
    _tkg(2, "trn3", 4, 1, 5, 1024, 10240, 128, **ROPE),
    _tkg(2, "trn2", 4, 2, 7, 256, 16384, 128, use_pos_id=True, fuse_rope=True),
    _tkg(1, "trn2", 8, 4, 4, 128, 256, 64, sink=True, **SB_IO),
    _tkg(2, "trn2", 8, 4, 4, 128, 256, 64, sink=True, **SB_IO),
    _tkg(2, "trn3", 1, 1, 1, 128, 256, 64, **SB_IO),
    _tkg(2, "trn2", 8, 8, 1, 1024, 10240, 64, sink=True, dtype=np.float32, **ROPE),
    _tkg(2, "trn2", 4, 1, 5, 1024, 10240, 128, fp8_kv=True, strided_mm1=False, qk_in_sb=True),
    _tkg(2, "trn2", 4, 1, 5, 1024, 10240, 128, window=128, **ROPE),
    _tkg(2, "trn2", 4, 1, 5, 8192, 8192, 128, sink=True, block_len=16, strided_mm1=False, **SB_IO),
    _tkg(2, "trn3", 4, 1, 5, 8192, 8192, 128, sink=True, block_len=16, window=128, strided_mm1=False,
         use_pos_id=True, **SB_IO),
    _tkg(2, "trn2", 4, 1, 5, 8192, 8192, 128, fp8_kv=True, block_len=16, strided_mm1=False, **SB_IO),
]


CTE_SOURCE = "test/integration/nkilib/core/attention/test_attention_cte.py"


def _cte(kind, lnc, bs, seqlen_kv, seqlen_q, d, scale, dtype, causal, tp_q, tp_k, tp_out, sink=False, prior=None,
         prior_used=None, window=0, cp=None, cp_rank=None, cp_strided=False, cache_softmax=False):
    """attention_cte as test_attention_cte.py's build_attention_cte_input feeds it: uniform [0, 1) Q/K/V (and prior
    K/V for prefix caching), sink logits uniform in [15, 25); reference attention_cte_torch_ref, output rounded to the
    input dtype; atol 1e-5, rtol 2e-2; CompilerArgs() there is trn2 (its LNC default 2 unless the test sets it)."""
    def inputs():
        rng = np.random.default_rng(0)

        def gen(shape):
            return rng.random(shape).astype(dtype)

        kw = {"q": gen((bs, seqlen_q, d) if tp_q else (bs, d, seqlen_q)),
              "k": gen((bs, seqlen_kv, d) if tp_k else (bs, d, seqlen_kv)),
              "v": gen((bs, seqlen_kv, d)), "scale": scale, "causal_mask": causal,
              "k_prior": None, "v_prior": None, "prior_used_len": None}
        if prior:
            kw["k_prior"] = gen((bs, prior, d) if tp_k else (bs, d, prior))
            kw["v_prior"] = gen((bs, prior, d))
            kw["prior_used_len"] = np.full((1,), prior_used, np.int32)
        offset = None
        if cp:  # this rank's first query position (strided slicing: its index among the ranks)
            offset = np.full((1, 1), cp_rank if cp_strided else cp_rank * seqlen_q, np.int32)
        kw.update({"sink": rng.uniform(15.0, 25.0, (bs, 1)).astype(np.float32) if sink else None,
                   "sliding_window": window, "tp_q": tp_q, "tp_k": tp_k, "tp_out": tp_out, "cp_offset": offset,
                   "global_cp_deg": cp, "cp_strided_q_slicing": cp_strided, "cache_softmax": cache_softmax,
                   "softmax_dtype": "float32", "mm_out_dtype": "float32", "bound_min": None, "bound_max": None})
        return kw

    def reference(q, k, v, scale, causal_mask, k_prior, v_prior, prior_used_len, sink, sliding_window, tp_q, tp_k,
                  tp_out, cp_offset, global_cp_deg, cp_strided_q_slicing, cache_softmax, softmax_dtype, mm_out_dtype,
                  bound_min, bound_max):
        import torch
        ref = nkilib.load("core.attention.attention_cte_torch:attention_cte_torch_ref")
        out = ref(q=q, k=k, v=v, scale=scale, causal_mask=causal_mask, k_prior=k_prior, v_prior=v_prior,
                  prior_used_len=prior_used_len, sink=sink, sliding_window=sliding_window, tp_q=tp_q, tp_k=tp_k,
                  tp_out=tp_out, cache_softmax=cache_softmax, softmax_dtype=torch.float32, cp_offset=cp_offset,
                  global_cp_deg=global_cp_deg, cp_strided_q_slicing=cp_strided_q_slicing, bound_min=None,
                  bound_max=None)
        if cache_softmax:
            out, neg_max, recip = out
            return {"out": out.numpy().astype(dtype), "out_cached_negative_max": neg_max.numpy(),
                    "out_cached_sum_reciprocal": recip.numpy()}
        return {"out": out.numpy().astype(dtype)}

    shape = (f"b{bs}_kv{seqlen_kv}_q{seqlen_q}_d{d}_{np.dtype(dtype).name}{'_causal' if causal else ''}"
             f"{'_tpq' if tp_q else ''}{'_tpk' if tp_k else ''}{'_tpo' if tp_out else ''}{'_sink' if sink else ''}"
             f"{f'_prior{prior}u{prior_used}' if prior else ''}{f'_swa{window}' if window else ''}"
             f"{f'_cp{cp}r{cp_rank}' if cp else ''}{'_strided' if cp_strided else ''}"
             f"{'_cachesm' if cache_softmax else ''}")
    return Case("core.attention.attention_cte:attention_cte", reference, shape, inputs, atol=1e-5, rtol=2e-2,
                source=f"{CTE_SOURCE}::{kind}", lnc=lnc)


F16 = np.float16
CASES += [
    _cte("test_attention_cte_no_cp_unit", 2, 1, 128, 128, 128, 1.0, BF16, True, False, False, True),
    _cte("test_attention_cte_no_cp_unit", 2, 3, 1024, 512, 128, 1.0, F16, False, False, False, True),
    _cte("test_attention_cte_no_cp_vnc_apc_klr_unit", 2, 1, 256, 256, 128, 1.0, BF16, True, True, True, True,
         prior=2048, prior_used=1920),
    _cte("test_attention_cte_no_cp_vnc_apc_klr_unit", 2, 2, 2048, 2048, 64, 1.0, BF16, True, False, False, True,
         sink=True, prior=512, prior_used=500, window=1024),
    _cte("test_attention_cte_no_cp_vnc_apc_klr_unit", 1, 2, 2048, 2048, 128, 1.0, BF16, True, False, False, False,
         prior=512, prior_used=500),
    _cte("test_ranged_attn_cte_sweep_cp_manual", 2, 1, 32768, 1024, 128, 1.0, BF16, True, False, False, False,
         cp=32, cp_rank=10),
    _cte("test_ranged_attn_cte_sweep_cp_manual", 1, 1, 32768, 1024, 128, 1.0, BF16, True, True, True, True,
         cp=32, cp_rank=31, window=127, cp_strided=True, cache_softmax=True),
]
