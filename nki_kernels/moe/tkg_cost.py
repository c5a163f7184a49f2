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
