"""The useful work of one block for one rank (declared to the cost model, so MFU counts only what the block needs).

QKV projection (2 S H 3 nh d), O-projection (2 S nh d H) and attention over the key pairs the images really hold:
QK^T and PV are 2 * 2 * nh * d * n^2 for an image of n patches (padding rows and other images' keys excluded).
"""


def useful_flops(S, H, num_heads, head_dim, sizes):
    hd = num_heads * head_dim
    return 2.0 * S * H * 3 * hd + 2.0 * S * hd * H + 4.0 * hd * sum(n * n for n in sizes)


def attention_flops(num_heads, head_dim, sizes):
    """QK^T + PV over the images' own keys only (attention_cte's useful work on the same block)."""
    return 4.0 * num_heads * head_dim * sum(n * n for n in sizes)
