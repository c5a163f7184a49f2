"""Static limits of the block vision-attention kernel and the one check of its arguments' shapes and dtypes.

Shared by the kernel (at trace time, before any instruction) and the host entry `vision_block_attention` (before any
backend runs), so both reject the same inputs with the same message. Works on anything with `.shape` and `.dtype`
(torch tensors, NumPy arrays, kernel tensors): dtypes are compared by name.
"""

P = 128                  # SBUF partitions = TensorE contraction / stationary size (nl.tile_size.pmax on trn2/trn3)
MIN_BLOCK = P            # one query tile
MAX_BLOCK = 32 * P       # 4096: the largest block size the encoder uses (Qwen3-VL buckets 1024..4096)
MAX_HEAD_DIM = P         # head_dim lives on the partitions of Q^T / K^T
MAX_HEADS = 16           # heads on one rank (Qwen3-VL's 16 at vision TP 1)
MAX_HIDDEN = 32 * P      # hidden size: x^T of one query tile, [128, H/128, 128] bf16, and W_qkv stay in SBUF
HEAD_GROUPS = 4          # the kernel projects QKV and attends in up to 4 head groups (two groups alive at a time)
KEY_PAD_TILES = 3        # zero key tiles after the block (the kernel's narrowest key step may run past a range)
SCORE_BUFFERS = 2        # fp32 score buffers of the two-pass softmax, [S + pad keys] each: one (query tile, head)
#                          pair's first pass overlaps the previous pair's second pass (one buffer serialises them)
# SBUF bytes per partition the block's resident tensors may use (see resident_bytes); the rest of the target's usable
# SBUF (208 KiB per partition on trn2) holds the working tiles (probability tiles, x and qkv tiles): 16 KiB is
# enough for them (nkisim's capacity check passes at the largest resident sets, Qwen3-VL at TP 4 / 4096 and
# TP 1 / 1024).
RESIDENT_MAX = 192 * 1024


def dtype_name(dt):
    """'bfloat16', 'float32', 'int32', ... for torch, NumPy / ml_dtypes and nki dtypes."""
    return str(getattr(dt, "name", None) or dt).replace("torch.", "").split(".")[-1]


def resident_bytes(S, H, num_heads, head_dim):
    """SBUF bytes per partition of the tensors the kernel keeps resident for one block: x^T ([128, H/128, S] bf16),
    two head groups' Q^T / K^T ([d, 2g, S + pad] bf16) and V ([128, S/128 + pad, g*d] bf16), W_qkv
    ([128, H/128, 3*nh*d] bf16), W_o ([128, ceil(nh*d/128), H] bf16), the attention output ([128, S/128, nh*d])
    and the score buffers (SCORE_BUFFERS x [128, S + pad] fp32)."""
    hd = num_heads * head_dim
    g = -(-num_heads // HEAD_GROUPS)
    keys = S + KEY_PAD_TILES * P
    x_t = (H // P) * S * 2
    groups = 2 * (2 * g * keys * 2 + (keys // P) * g * head_dim * 2)
    weights = (H // P) * 3 * hd * 2 + -(-hd // P) * H * 2
    o = (S // P) * hd * 2
    scores = SCORE_BUFFERS * keys * 4
    return x_t + groups + weights + o + scores


def argument_error(x, w_qkv, b_qkv, cos, sin, bound_min, bound_max, w_o, num_heads, head_dim):
    """The first argument at fault, as a message naming it and the limit (None: all arguments are valid)."""
    if not isinstance(num_heads, int) or not 1 <= num_heads <= MAX_HEADS:
        return f"num_heads={num_heads!r} must be an int in 1..{MAX_HEADS} (heads on this rank)"
    if not isinstance(head_dim, int) or not (2 <= head_dim <= MAX_HEAD_DIM and head_dim % 2 == 0):
        return f"head_dim={head_dim!r} must be an even int in 2..{MAX_HEAD_DIM} (rotate-half needs two halves)"
    if len(x.shape) != 2:
        return f"x must be [S, H] (one block of packed patches), got shape {tuple(x.shape)}"
    S, H = x.shape
    if S % P or not MIN_BLOCK <= S <= MAX_BLOCK:
        return f"x: block size S={S} must be a multiple of {P} in {MIN_BLOCK}..{MAX_BLOCK}"
    if H % P or not P <= H <= MAX_HIDDEN:
        return f"x: hidden size H={H} must be a multiple of {P} in {P}..{MAX_HIDDEN}"
    if dtype_name(x.dtype) != "bfloat16":
        return f"x must be bfloat16, got {dtype_name(x.dtype)}"
    hd = num_heads * head_dim
    if tuple(w_qkv.shape) != (H, 3 * hd):
        return (f"w_qkv must be [H={H}, 3*num_heads*head_dim={3 * hd}] (q|k|v, head-major), got "
                f"{tuple(w_qkv.shape)}")
    if tuple(b_qkv.shape) != (3 * hd,):
        return f"b_qkv must be [3*num_heads*head_dim={3 * hd}], got {tuple(b_qkv.shape)}"
    if tuple(w_o.shape) != (hd, H):
        return f"w_o must be [num_heads*head_dim={hd}, H={H}], got {tuple(w_o.shape)}"
    for name, w in (("w_qkv", w_qkv), ("w_o", w_o)):
        if dtype_name(w.dtype) != "bfloat16":
            return f"{name} must be bfloat16 (matmul inputs are bf16), got {dtype_name(w.dtype)}"
    if dtype_name(b_qkv.dtype) not in ("bfloat16", "float32"):
        return f"b_qkv must be bfloat16 or float32, got {dtype_name(b_qkv.dtype)}"
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (S, head_dim):
            return f"{name} must be [S={S}, head_dim={head_dim}] (one row per token), got {tuple(t.shape)}"
        if dtype_name(t.dtype) != "float32":
            return f"{name} must be float32, got {dtype_name(t.dtype)}"
    for name, t in (("bound_min", bound_min), ("bound_max", bound_max)):
        if tuple(t.shape) != (S,):
            return f"{name} must be [S={S}] (one key range per query row), got {tuple(t.shape)}"
        if dtype_name(t.dtype) != "int32":
            return f"{name} must be int32, got {dtype_name(t.dtype)}"
    need = resident_bytes(S, H, num_heads, head_dim)
    if need > RESIDENT_MAX:
        return (f"S={S} x num_heads={num_heads} x head_dim={head_dim} (H={H}) needs {need} resident SBUF bytes per "
                f"partition, more than {RESIDENT_MAX}: use a smaller block or more vision TP ranks")
    return None


def bounds_error(bound_min, bound_max, S):
    """Host-side check of the bound values (the kernel sees them only as data): 0 <= bound_min, bound_max <= S.
    A row with bound_min >= bound_max is a padding row (empty range, zero output). Takes NumPy int arrays."""
    if bound_min.size and (bound_min.min() < 0 or bound_min.max() > S):
        return f"bound_min values must be in [0, S={S}], got [{bound_min.min()}, {bound_min.max()}]"
    if bound_max.size and (bound_max.min() < 0 or bound_max.max() > S):
        return f"bound_max values must be in [0, S={S}], got [{bound_max.min()}, {bound_max.max()}]"
    return None
