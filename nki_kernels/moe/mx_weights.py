"""MXFP4 expert weights for the CTE kernel's trn3 MX path: the OCP MX numerics in torch (the reference's side) and
the kernel's packed HBM layout (host side).

Format (OCP MX, as GPT-OSS ships its experts): every 32 consecutive elements along a projection's contraction dim (H
for gate/up, I for down) share one E8M0 scale (value 2**(s - 127)); each element is an E2M1 (FP4) code. Here a
projection is given as codes [E, K, N] (uint8, one E2M1 code per element, K the contraction) and scales
[E, ceil(K / 32), N] (uint8): GPT-OSS's checkpoint holds the same data as `blocks` [E, N, K / 32, 16] (two codes per
byte) and `scales` [E, N, K / 32], i.e. transposed.

Kernel layout (`nisa.nc_matmul_mx` contracts 128 partitions x 4 lanes of x4 words = 512 elements per matmul, with one
scale per 8 partitions x 4 lanes): contraction element j of a 512-chunk sits in partition k = 8 (j // 32) + j % 8,
lane q = (j % 32) // 8, so each scale group (8 partitions x 4 lanes) is exactly one 32-element MX block. Packed:
words [E, 128, KC, N] (float4_e2m1fn_x4 storage, lane q in nibble q) and scales [E, 16, KC, N] (group g = k // 8 of
chunk c is block 16 c + g); K is zero-padded to KC * 512. Activations are quantised on chip (`nisa.quantize_mx`,
MXFP8 e4m3) in the same element order; `mx_quantize_torch` models that rounding.
"""

import numpy as np
import torch

BLOCK = 32            # elements per MX scale block (OCP MX)
CHUNK = 512           # contraction elements per nc_matmul_mx: 128 partitions x 4 lanes
SCALE_BIAS = 127
FP8_E4M3_EMAX, FP8_E4M3_MAX = 8, 448.0     # largest exponent / value of float8_e4m3fn
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def dequantize(codes, scales):
    """codes [E, K, N] (E2M1 codes), scales [E, ceil(K/32), N] (E8M0) -> fp32 [E, K, N]."""
    codes = torch.as_tensor(np.asarray(codes)).long()
    s = torch.as_tensor(np.asarray(scales)).float()
    factor = torch.exp2(s - SCALE_BIAS).repeat_interleave(BLOCK, dim=1)[:, :codes.shape[1]]
    return FP4_VALUES[codes] * factor


def mx_quantize_torch(x, dim=-1):
    """MXFP8 (e4m3) fake quantisation of x along `dim` in 32-element blocks (zero-padded), as nisa.quantize_mx
    rounds (OCP rule: shared exponent = the block's largest fp32 exponent field - 8; data / 2**(shared - 127)
    clamped to +-448, rounded to nearest even) -> fp32 of x's shape, the values the MX matmul multiplies."""
    x = x.float().movedim(dim, -1)
    n = x.shape[-1]
    pad = (-n) % BLOCK
    xp = torch.nn.functional.pad(x, (0, pad)).reshape(*x.shape[:-1], -1, BLOCK)
    exp = (xp.contiguous().view(torch.int32) >> 23) & 0xFF
    shared = exp.amax(dim=-1, keepdim=True) - FP8_E4M3_EMAX
    factor = torch.exp2((shared - SCALE_BIAS).double())
    q = (xp.double() / factor).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).float().to(torch.float8_e4m3fn)
    byte = shared.clamp(0, 255)           # the stored scale byte (E8M0)
    out = (q.float().double() * torch.exp2((byte - SCALE_BIAS).double())).float()
    return out.reshape(*x.shape[:-1], -1)[..., :n].movedim(-1, dim)


def pack(codes, scales):
    """codes [E, K, N], scales [E, ceil(K/32), N] -> (words [E, 128, KC, N] uint16, scales [E, 16, KC, N] uint8) in
    the kernel layout (module docstring), K zero-padded to KC * 512 (scale byte 127 for padding blocks)."""
    codes = np.asarray(codes, np.uint16)
    scales = np.asarray(scales, np.uint8)
    E, K, N = codes.shape
    KC = -(-K // CHUNK)
    c = np.zeros((E, KC * CHUNK, N), np.uint16)
    c[:, :K] = codes
    s = np.full((E, KC * CHUNK // BLOCK, N), SCALE_BIAS, np.uint8)
    s[:, :scales.shape[1]] = scales
    # element j = 512 c + 32 g + 8 q + r  ->  partition 8 g + r, lane q
    c = c.reshape(E, KC, 16, 4, 8, N)                       # [E, c, g, q, r, N]
    words = np.zeros((E, KC, 16, 8, N), np.uint16)
    for q in range(4):
        words |= c[:, :, :, q] << np.uint16(4 * q)
    words = words.reshape(E, KC, 128, N).transpose(0, 2, 1, 3)     # [E, 128, KC, N]
    sc = s.reshape(E, KC, 16, N).transpose(0, 2, 1, 3)              # [E, 16, KC, N]
    return np.ascontiguousarray(words), np.ascontiguousarray(sc)


def random_mxfp4(E, K, N, seed=0):
    """Random MXFP4 weights: codes [E, K, N] uniform over E2M1 (mean square 12.625), scales [E, ceil(K/32), N]
    around 2**-log2(sqrt(12.625 K)) (+-1), so that a K-long dot product of O(1) inputs stays O(1)."""
    g = np.random.default_rng(seed)
    scale_exp = -int(round(np.log2(np.sqrt(12.625 * K))))
    codes = g.integers(0, 16, (E, K, N)).astype(np.uint8)
    scales = (SCALE_BIAS + scale_exp + g.integers(-1, 2, (E, -(-K // BLOCK), N))).astype(np.uint8)
    return codes, scales


def unpack(words, scales):
    """pack's inverse, dequantised: kernel-layout words [E, 128, KC, N] and scales [E, 16, KC, N] → fp32
    [E, KC * 512, N] (the contraction zero-padded to KC * 512)."""
    w = np.asarray(words).view(np.ndarray).astype(np.uint16)
    E, _, KC, N = w.shape
    w = w.transpose(0, 2, 1, 3).reshape(E, KC, 16, 8, N)                         # [E, c, g, r, N]
    codes = np.stack([(w >> np.uint16(4 * q)) & 0xF for q in range(4)], axis=3)   # [E, c, g, q, r, N]
    sc = np.asarray(scales).transpose(0, 2, 1, 3).reshape(E, KC * 16, N)
    return dequantize(codes.reshape(E, KC * CHUNK, N), sc)


def _shape(t):
    return tuple(int(s) for s in t.shape)


def packed_weights_error(H, w_gate_up, w_down, w_gate_up_scale, w_down_scale, op):
    """The first problem with MXFP4 weights in the kernel layout (pack's) for hidden size H, as a message naming
    the argument and the limit, or None. w_gate_up [E, 128, H/512, 2I] and w_down [E, 128, KDm >= I/512, H] words,
    scales [E, 16, chunks, N]."""
    if w_down_scale is None:
        return f"{op}: w_gate_up_scale given without w_down_scale (MXFP4 needs both projections' scales)"
    if H % CHUNK:
        return f"{op}: H={H} must be a multiple of {CHUNK} with MXFP4 weights"
    gu, d = _shape(w_gate_up), _shape(w_down)
    if len(gu) != 4 or gu[1:3] != (128, H // CHUNK) or gu[3] % 2:
        return f"{op}: w_gate_up (MXFP4 words) must be [E, 128, H/512={H // CHUNK}, 2I], got shape {gu}"
    if len(d) != 4 or d[0] != gu[0] or d[1] != 128 or d[3] != H or d[2] * CHUNK < gu[3] // 2:
        return f"{op}: w_down (MXFP4 words) must be [E={gu[0]}, 128, KDm >= I/512, H={H}], got shape {d}"
    for name, w, sc in (("w_gate_up", gu, w_gate_up_scale), ("w_down", d, w_down_scale)):
        want = (w[0], 16, w[2], w[3])
        if _shape(sc) != want:
            return f"{op}: {name}_scale must be [E, 16, chunks, N] = {want}, got shape {_shape(sc)}"
    return None


def dequantized_weights(w_gate_up, w_down, w_gate_up_scale, w_down_scale):
    """MXFP4 kernel-layout weights → the references' fp32 w_gate_up [E, H, 2, I] and w_down [E, I, H]."""
    E, _, _, two_i = _shape(w_gate_up)
    inter = two_i // 2
    gu = unpack(w_gate_up, w_gate_up_scale)
    return gu.reshape(E, gu.shape[1], 2, inter), unpack(w_down, w_down_scale)[:, :inter]


def logical_weights(w_gate_up, w_down, w_gate_up_scale, w_down_scale, backend):
    """The references' w_gate_up [E, H, 2, I] and w_down [E, I, H] for MXFP4 kernel-layout weights: dequantised
    (dequantized_weights) for the "torch" backend, else data-less meta tensors of those shapes — the entries' shape
    checks need only the shapes, and dequantising every expert on the host at each kernel call would cost more than
    the call (20B TP8: ~100M weights a layer)."""
    if backend == "torch":
        return dequantized_weights(w_gate_up, w_down, w_gate_up_scale, w_down_scale)
    E, _, kc, two_i = _shape(w_gate_up)
    H = _shape(w_down)[3]
    return (torch.empty(E, kc * CHUNK, 2, two_i // 2, device="meta"),
            torch.empty(E, two_i // 2, H, device="meta"))


def packed_bytes(K, N):
    """HBM bytes of one expert projection (contraction K, N outputs) in MXFP4: 4-bit codes and one scale byte per
    32 elements (the checkpoint's bytes; pack's layout adds the zero padding of K to 512)."""
    return K * N // 2 + -(-K // BLOCK) * N
