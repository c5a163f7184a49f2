"""Per-patch position inputs of the Qwen3-VL vision tower, computed on the host for one image (grid t x h x w).

Patches arrive in the HF processor's order: frame-major, then merge groups row-major, then the
spatial_merge_size x spatial_merge_size patches of a group row-major — so the merger's 4 consecutive rows are one
2x2 square. Both functions return rows in that order.

- Learned position embedding: the side x side table is sampled at the image's h x w grid by bilinear blending of
  the 4 corner entries (indices + weights; the encoder does the weighted gather on device).
- 2D rotary: half of the rotary frequencies rotate with the patch row, half with the column; cos/sin are
  [tokens, head_dim] in rotate-half layout (the frequency vector repeated twice).
"""

from __future__ import annotations

import torch


def _merge_order(x: torch.Tensor, t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """[h*w, ...] row-major → [t*h*w, ...] in the processor's (frame, group row, group col, row, col) order."""
    tail = x.shape[1:]
    x = x.reshape(h // merge, merge, w // merge, merge, *tail).transpose(1, 2).reshape(h * w, *tail)
    return x.repeat(t, *([1] * len(tail)))


def pos_embed_blend(t: int, h: int, w: int, num_grid_per_side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Corner indices [t*h*w, 4] (int64) and bilinear weights [t*h*w, 4] (fp32) into the learned table.

    Corners are (floor row, floor col), (floor, ceil), (ceil, floor), (ceil, ceil) of the image grid mapped
    linearly onto [0, side - 1], as in HF Qwen3VLVisionModel.fast_pos_embed_interpolate.
    """
    side = num_grid_per_side
    hs = torch.linspace(0, side - 1, h)
    ws = torch.linspace(0, side - 1, w)
    h0, w0 = hs.long(), ws.long()
    h1, w1 = (h0 + 1).clamp(max=side - 1), (w0 + 1).clamp(max=side - 1)
    dh, dw = (hs - h0)[:, None], (ws - w0)[None, :]
    idx = torch.stack([h0[:, None] * side + w0[None], h0[:, None] * side + w1[None],
                       h1[:, None] * side + w0[None], h1[:, None] * side + w1[None]], dim=-1).reshape(h * w, 4)
    wt = torch.stack([(1 - dh) * (1 - dw), (1 - dh) * dw, dh * (1 - dw), dh * dw], dim=-1).reshape(h * w, 4)
    return _merge_order(idx, t, h, w, merge), _merge_order(wt.float(), t, h, w, merge)


def rotary_cos_sin(t: int, h: int, w: int, head_dim: int, merge: int,
                   theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [t*h*w, head_dim] fp32 for the 2D rotary embedding (rotate-half layout)."""
    rot = head_dim // 2                               # rotary table width; rows and columns get rot/2 each
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    rows = torch.arange(h)[:, None].expand(h, w).reshape(-1)
    cols = torch.arange(w)[None, :].expand(h, w).reshape(-1)
    freqs = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)   # [h*w, rot]
    emb = _merge_order(torch.cat([freqs, freqs], dim=-1), t, h, w, merge)
    return emb.cos(), emb.sin()
