"""Modelled cost of attention DP inside the decode megakernel (nkisim cost model; NOT measured).

One DP column of attn_dp ranks (nkisim.run_ranks, one rank-list) at the TP=8 rank shape of GPT-OSS-20B (8 query
heads / 1 KV head per TP position, d 64, H 3072; the one shape keeps the main job short): the gathered batch of
B = 16 sequences at context 4K on trn2, each rank projecting it with 1/attn_dp of the query heads, swapping heads
for sequences with an in-kernel nki.collectives.all_to_all, attending its own B / attn_dp sequences with every query
head of its TP position, swapping back and applying its O-projection shard (decode/exchange.py).
Per row (rank 0's trace; the ranks are symmetric): the modelled latency, the two all_to_alls' modelled time (cost
model: alpha-beta, Mesh, nkisim/cost/collective.py; uncalibrated), the part of the critical path they hold, and the
plain TP=8 launch at the same B (every sequence, its own cache; no DP) for comparison. The exchange's bytes: Q of
the gathered tokens (B x nq_e x d) and o^T back (same), bf16.
"""

import pytest

import nkisim
from modules.model_specs import GPT_OSS_20B
from nki_kernels.attention.decode_attention import decode_attention_nki
from nki_kernels.attention.decode_inputs import dp_rank_inputs, make_inputs, rank_shard

pytestmark = pytest.mark.skipif(not nkisim.active(), reason="the cost model needs the nkisim interpreter")

SHAPES = {"gpt-oss-20b-tp8": rank_shard(GPT_OSS_20B, 8)}
B, CTX, TARGET = 16, 4096, "trn2"
_PLAIN = {}      # model -> the plain launch's report (shared by the attn_dp rows)


def modelled_dp(model, attn_dp):
    """(rank 0's CostReport, the plain launch's CostReport) of a DP column of attn_dp ranks."""
    from nkisim.cost import analyze
    args, kw = make_inputs(B, 1, s_max=CTX, ctx=CTX, **SHAPES[model])
    if model not in _PLAIN:
        _PLAIN[model] = nkisim.profile(decode_attention_nki, *args, target=TARGET, **kw).report
    plain = _PLAIN[model]
    columns = [list(range(attn_dp))]
    res = nkisim.run_ranks(decode_attention_nki, attn_dp,
                           [dp_rank_inputs(args, kw, columns, r) for r in range(attn_dp)], target=TARGET)
    return analyze(res.ranks[0], kernel_name="decode_attention_kernel"), plain


@pytest.mark.parametrize("attn_dp", (2, 4))
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_decode_attention_dp_modelled(benchmark, model, attn_dp):
    rep, plain = benchmark.pedantic(modelled_dp, args=(model, attn_dp), rounds=1, iterations=1)
    cc = [e for e in rep.events if e.engine == "cc"]
    assert len(cc) == 2, "one all_to_all each way"
    exchange_s = sum(e.end - e.start for e in cc)
    info = rep.extra_info()
    info.update({"model": model, "batch": B, "context": CTX, "s_tkg": 1, "lnc": 1, "modelled_attention_dp": attn_dp,
                 "modelled_own_batch": B // attn_dp, "modelled_bound_s": rep.roofline_s,
                 "modelled_latency_over_bound": rep.latency_s / rep.roofline_s,
                 "modelled_exchange_s": exchange_s,
                 "modelled_exchange_on_critical_path_s": rep.critical_path_s.get("cc", 0.0),
                 "modelled_plain_tp_latency_s": plain.latency_s,
                 "modelled_latency_over_plain_tp": rep.latency_s / plain.latency_s,
                 "modelled_critical_path_s": rep.critical_path_s})
    benchmark.extra_info.update(info)
    assert rep.latency_s >= rep.roofline_s * 0.999
    assert exchange_s > 0
