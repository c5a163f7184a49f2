"""The TKG kernel's expert-mode rule: serve only the experts the tokens touch ("selective") or stream every local
expert ("all"), whichever the modelled cost says is faster for the shape.

Both modes load each expert's weights once and run it on all T tokens together (the tokens that did not pick it
get affinity 0), so the expert phase of either is bound by the weight bytes it streams: selective streams the
touched experts, all-expert streams E. What selective pays extra is the routing on its critical path: no expert's
DMA can start before the router has chosen (its DMAs are addressed by registers read from the routing), while the
all-expert stream starts at the first instruction and hides the router under the first expert's load. So

    t_all       = E · t_w
    t_selective = t_route + n̄ · (t_w + t_slot)
    n̄           = E · (1 − (1 − 1/E)^(T·k))   (expected touched experts, k·T independent uniform picks; ≤ min(E, T·k))
    t_w         = expert bytes / the core's memory roof (hw.core.memory_bytes_per_s, nkisim.hardware)

and "auto" picks selective iff t_selective < t_all. t_route is the kernel's modelled routing prologue (RMSNorm,
router, top-k, schedule, first register-addressed DMA issue) and t_slot what a register-addressed slot costs beyond
its bytes (control dependencies on the registers shorten the overlap of one expert's compute with the next one's
loads): ROUTE_LATENCY_S and SLOT_OVERHEAD_S below, read off the kernel's modelled timelines on GPT-OSS-20B TP=8
(selective vs all at T = 128, where both stream all 32 experts: (656.0 - 625.2) us / 32 on trn2; the routing
prologue is 3.3 us at T = 1 and 7.8 us at T = 8 to the first register-addressed weight DMA on trn2; re-measure with
bench/test_moe_tkg.py when the kernel changes). Uniform routing is an assumption of the rule only; the kernel is
correct for any routing.
"""

from nkisim.hardware import hardware

ROUTE_LATENCY_S = 8e-6     # modelled routing prologue at GPT-OSS rank shapes (trn2 3.3 us at T = 1, 7.8 us at T = 8)
SLOT_OVERHEAD_S = 0.96e-6  # modelled extra time per register-addressed expert slot (trn2)
# MXFP4 experts (trn3, tkg_mx.py), read off the same way on GPT-OSS-20B TP=8 (trn3): a slot costs (144.8 - 134.4) us
# / 32 beyond the all-expert stream (T = 32, both streaming all 32 experts); the stream of one expert moves at ~78 %
# of the roof (3.71 us per 1.77 MB: the busiest DMA engine carries ~1.15x the mean bytes, see DESIGN.md); no extra
# routing latency for selective (the all-expert MX stream also waits for the x quantisation and the bias matmuls
# before its first expert's compute: selective 123.1 vs all 131.2 us at T = 16, 28 touched)
MX_ROUTE_LATENCY_S = 0.0
MX_SLOT_OVERHEAD_S = 0.33e-6
MX_STREAM_EFFICIENCY = 0.78


def expected_touched(T, E, k):
    """Expected number of distinct experts among T tokens' top-k picks under uniform routing."""
    return min(float(E), float(T * k), E * (1.0 - (1.0 - 1.0 / E) ** (T * k)))


def expert_bytes(H, inter, itemsize=2, mx=False):
    """Weight bytes of one expert: gate/up [H, 2I] + down [I, H] (+ its biases, in the activations' dtype). mx: the
    projections in MXFP4 (4-bit codes + one scale byte per 32 contraction elements, mx_weights.packed_bytes)."""
    if mx:
        from .mx_weights import packed_bytes
        return packed_bytes(H, 2 * inter) + packed_bytes(inter, H) + (2 * inter + H) * itemsize
    return (3 * H * inter + 2 * inter + H) * itemsize


def mode_costs(T, E, k, H, inter, target="trn2", mx=False):
    """(t_selective, t_all) modelled seconds of the expert phase under the rule above (mx: MXFP4 expert bytes at the
    MX path's measured stream efficiency, slot overhead and routing latency)."""
    t_w = expert_bytes(H, inter, mx=mx) / hardware(target).core.memory_bytes_per_s
    if mx:
        t_w /= MX_STREAM_EFFICIENCY
    slot, route = (MX_SLOT_OVERHEAD_S, MX_ROUTE_LATENCY_S) if mx else (SLOT_OVERHEAD_S, ROUTE_LATENCY_S)
    return route + expected_touched(T, E, k) * (t_w + slot), E * t_w


def choose_expert_mode(T, E, k, H, inter, target="trn2", mx=False):
    t_sel, t_all = mode_costs(T, E, k, H, inter, target, mx)
    return "selective" if t_sel < t_all else "all"


# ---- MXFP4 decode above the MX TKG kernel's 64 tokens: several TKG calls or one CTE call -------------------------
# The MX TKG kernel takes T <= 64 (tkg_mx_error), so a larger decode batch is either split into TKG calls, each
# streaming the experts its tokens touch again, or run as ONE moe_cte call (its MX path reads every routed expert
# once, at any T) after the router kernel; `MoELayer` picks the cheaper by `mx_decode_costs`:
#
#     t_split = Σ_pieces [ lnc · MX_CALL_FIXED_S + max(min(t_selective, t_all), n · t · MX_EXPERT_TOKEN_S) / lnc
#                          + launch ]      (pieces of <= 64 tokens; the mode rule's t_selective / t_all with the
#                                           expert bytes at MX_TKG_EFF of the roof; n = the touched or all E)
#     t_cte   = CTE_ROUTER_S + 2 · launch + [n̄ · (MXFP4 expert bytes + 3 · rows moved · H · 2) / (roof · CTE_MX_EFF)
#                                          + tiles · CTE_TILE_S] / lnc
#
# TKG: the weight stream of the mode rule above (expert bytes at MX_TKG_EFF of the roof), or at larger T the
# per-expert compute (quantised tokens through gate/up, activation, down, the fp32 accumulate: ~T · 0.1 us per
# expert at GPT-OSS-20B TP8, ~T · 0.08 us at 120B TP16; above the stream from T ~ 40), plus a fixed part per call
# (routing prologue, store).
# CTE: each touched expert (T·k/n̄ rows each under uniform routing) moves its weights once and its rows in 128-row
# tiles, the last <= 64 in a narrow 64-row tile: gather, scatter-add read and write (rows moved = 128 per full tile,
# 64 for a narrow one), at CTE_MX_EFF of the roof, plus a fixed part per tile; the router kernel runs before it.
# Read off the modelled timelines (trn3, random routing), GPT-OSS-20B TP8: TKG MX T = 1 / 8 / 16 / 32 / 64: 22.3 /
# 89.0 / 123.1 / 134.5 / 208.1 us (LNC 1; the rule: 22.2 / 92.4 / 123.7 / 130.9 / 208.1), 17.5 / 53.6 / 72.8 / 76.9
# / 123.1 us (LNC 2; the rule is ~8 % low there); router + CTE MX (narrow tiles: every expert has ~8-32 rows) at
# T = 65..256: 268-276 us (LNC 1; rule 269), 146-149 us (LNC 2; rule 138), flat in T there. Measured crossover:
# LNC 1 between T = 65 (split 230 < 269 us) and 72 (297 > 268), LNC 2 between 65 (141 < 147) and 72 (177 > 146);
# the rule switches at T = 69 (LNC 1) and 66 (LNC 2) (68 / 66 at the layer's block-aligned I = 384). GPT-OSS-120B
# TP16 LNC 1: split T = 96 908.9 us (rule 863), T = 128 1303.6 (1305); router + CTE 774.3 (773), 826.7 (798): the
# rule switches at T = 74. Kernel launches (15 us each, assumed) are in the rule, not in these kernel-body figures:
# equal counts up to T = 128. Re-measure when either kernel changes.
MX_CALL_FIXED_S = 6e-6         # per TKG call and core: routing prologue, x quantisation, store
# per expert and token, the MX TKG's compute: a part growing with H (the fp32 accumulate, the per-expert operand
# handling) and one with H·I (matmuls, activation), fitted to two modelled points on trn3 (T = 64, all experts):
# 20B TP8 (I 360) (208.1 - 6) us / 32 / 64 = 0.0987 us, 120B TP16 (I 180) (651.8 - 6) us / 128 / 64 = 0.0789 us
MX_EXPERT_TOKEN_H_S = 0.0591e-6    # x H / 3072
MX_EXPERT_TOKEN_HI_S = 0.0396e-6   # x H·I / (3072 · 360)
CTE_ROUTER_S = 8e-6            # the router kernel before the CTE call (modelled 7.1 .. 12 us at T = 65 .. 256)
MX_TKG_EFF = 0.86              # MX TKG expert bytes / memory roof over its modelled stream time (T = 1..32, LNC 1)
# CTE MX per tile: its bytes at CTE_MX_EFF of the roof + CTE_TILE_S (DMA latencies, the 128-token MX compute),
# fitted to T = 128 LNC 1 (narrow tiles): 20B TP8 260.9 us / 32 tiles (2.95 MB each), 120B TP16 816.3 us / 128 (2.11 MB)
CTE_MX_EFF = 0.90
CTE_TILE_S = 1.93e-6
CTE_TILE_ROWS = 128            # moe_cte's token tile; an expert's last <= 64 rows go in a narrow tile (HALF_ROWS)
CTE_NARROW_ROWS = 64


def tkg_mx_pieces(T, max_tokens):
    """Token counts of the TKG calls a T-token decode is split into (<= max_tokens each)."""
    return [max_tokens] * (T // max_tokens) + ([T % max_tokens] if T % max_tokens else [])


def mx_decode_costs(T, E, k, H, inter, target="trn3", lnc=1, max_tokens=64):
    """(t_split, t_cte): modelled seconds of a T-token MXFP4 decode as TKG calls of <= max_tokens, or as the router
    kernel + one moe_cte call (rule above; kernel launches included)."""
    hw = hardware(target).core
    launch = hw.launch_overhead_s

    t_w = expert_bytes(H, inter, mx=True) / (hw.memory_bytes_per_s * MX_TKG_EFF)
    t_tok = MX_EXPERT_TOKEN_H_S * H / 3072 + MX_EXPERT_TOKEN_HI_S * H * inter / (3072 * 360)

    def tkg(t):
        n_sel = expected_touched(t, E, k)
        t_sel, t_all = MX_ROUTE_LATENCY_S + n_sel * (t_w + MX_SLOT_OVERHEAD_S), E * t_w
        n = n_sel if t_sel < t_all else E
        return lnc * MX_CALL_FIXED_S + max(min(t_sel, t_all), n * t * t_tok) / lnc + launch

    t_split = sum(tkg(p) for p in tkg_mx_pieces(T, max_tokens))
    n = expected_touched(T, E, k)
    rows = T * k / n                                    # per touched expert (uniform routing)
    full, last = divmod(rows, CTE_TILE_ROWS)
    moved = CTE_TILE_ROWS * full + (0 if last == 0 else CTE_NARROW_ROWS if last <= CTE_NARROW_ROWS else CTE_TILE_ROWS)
    t_bytes = n * (expert_bytes(H, inter, mx=True) + 3 * moved * H * 2)
    tiles = n * (full + (last > 0))
    t_cte = CTE_ROUTER_S + 2 * launch + (t_bytes / (hw.memory_bytes_per_s * CTE_MX_EFF) + tiles * CTE_TILE_S) / lnc
    return t_split, t_cte


def choose_mx_decode_route(T, E, k, H, inter, target="trn3", lnc=1, max_tokens=64):
    """"tkg" (one call, or calls of <= max_tokens) or "cte" (router + one moe_cte call) for a T-token MXFP4 decode:
    always "tkg" up to max_tokens, above it the cheaper of `mx_decode_costs`."""
    if T <= max_tokens:
        return "tkg"
    t_split, t_cte = mx_decode_costs(T, E, k, H, inter, target, lnc, max_tokens)
    return "cte" if t_cte < t_split else "tkg"
