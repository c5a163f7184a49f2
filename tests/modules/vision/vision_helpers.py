"""Shared by the vision-encoder tests: a tiny Qwen3-VL vision config, a random HF-layout safetensors checkpoint, test
images, and an independent reference forward (HF Qwen3VLVisionModel's algorithm on the unpacked, per-image sequence
with dense per-frame attention, fp32 from the checkpoint's bf16 weights)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from modules.vision import HF_PREFIX, ImageGrid, VisionEncoderConfig

# Smallest shapes the kernel accepts (hidden a multiple of 128, blocks of 128 rows); 4 heads so TP 4 holds one head.
TINY = VisionEncoderConfig(depth=3, hidden_size=128, num_heads=4, intermediate_size=256, out_hidden_size=64,
                           in_channels=3, patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                           num_position_embeddings=64, deepstack_visual_indexes=(0, 1))
BLOCK = 128
# Frames 120, 96, 64, 24, 16, 16 (one 2-frame video): first-fit decreasing packs them into 3 blocks of 128, so the
# block count is not a multiple of dp 2 or 4 and padding blocks appear in every DP mode.
GRIDS = [ImageGrid(1, 8, 8), ImageGrid(1, 4, 6), ImageGrid(2, 4, 4), ImageGrid(1, 10, 12), ImageGrid(1, 8, 12)]


def random_tensors(cfg: VisionEncoderConfig, seed: int = 0, prefix: str = HF_PREFIX) -> dict[str, torch.Tensor]:
    """Every vision-tower tensor of an HF Qwen3-VL checkpoint (names and shapes), random bf16."""
    g = torch.Generator().manual_seed(seed)
    H, inter, M, out = cfg.hidden_size, cfg.intermediate_size, cfg.merged_hidden, cfg.out_hidden_size

    def w(*shape, scale=None):
        scale = scale if scale is not None else 1 / math.sqrt(shape[-1])
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    def norm(n):
        return {"weight": (1 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16), "bias": w(n, scale=0.1)}

    t = {"patch_embed.proj.weight": w(H, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size,
                                      scale=1 / math.sqrt(cfg.patch_dim)),
         "patch_embed.proj.bias": w(H, scale=0.1), "pos_embed.weight": w(cfg.num_position_embeddings, H, scale=0.5)}
    for i in range(cfg.depth):
        p = f"blocks.{i}."
        for n in ("norm1", "norm2"):
            t.update({f"{p}{n}.{k}": v for k, v in norm(H).items()})
        t.update({f"{p}attn.qkv.weight": w(3 * H, H), f"{p}attn.qkv.bias": w(3 * H, scale=0.1),
                  f"{p}attn.proj.weight": w(H, H), f"{p}attn.proj.bias": w(H, scale=0.1),
                  f"{p}mlp.linear_fc1.weight": w(inter, H), f"{p}mlp.linear_fc1.bias": w(inter, scale=0.1),
                  f"{p}mlp.linear_fc2.weight": w(H, inter), f"{p}mlp.linear_fc2.bias": w(H, scale=0.1)})
    mergers = ["merger."] + [f"deepstack_merger_list.{j}." for j in range(len(cfg.deepstack_visual_indexes))]
    for j, p in enumerate(mergers):
        t.update({f"{p}norm.{k}": v for k, v in norm(H if j == 0 else M).items()})
        t.update({f"{p}linear_fc1.weight": w(M, M), f"{p}linear_fc1.bias": w(M, scale=0.1),
                  f"{p}linear_fc2.weight": w(out, M), f"{p}linear_fc2.bias": w(out, scale=0.1)})
    return {prefix + k: v for k, v in t.items()}


def write_checkpoint(cfg: VisionEncoderConfig, directory: Path, seed: int = 0) -> Path:
    """A two-file HF-style checkpoint directory: the vision tower plus a language-model tensor the encoder must
    ignore."""
    tensors = random_tensors(cfg, seed)
    directory.mkdir(parents=True, exist_ok=True)
    keys = sorted(tensors)
    half = len(keys) // 2
    save_file({k: tensors[k] for k in keys[:half]}, str(directory / "model-00001-of-00002.safetensors"))
    rest = {k: tensors[k] for k in keys[half:]}
    rest["model.language_model.embed_tokens.weight"] = torch.zeros(8, 16, dtype=torch.bfloat16)
    save_file(rest, str(directory / "model-00002-of-00002.safetensors"))
    return directory


def random_pixels(cfg: VisionEncoderConfig, grids, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(x.tokens for x in grids), cfg.patch_dim, generator=g).to(torch.bfloat16)


# ---- independent reference ----------------------------------------------------------------------------------------
def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _to_merge_order(x, t, h, w, m):
    return x.reshape(h // m, m, w // m, m, -1).permute(0, 2, 1, 3, 4).reshape(h * w, -1).repeat(t, 1)


def _pos_embed(table, side, t, h, w, m):
    """Bilinear sample of the side x side table at an h x w grid spanning it corner to corner, point by point."""
    tab = table.reshape(side, side, -1)
    out = torch.empty(h, w, tab.shape[-1])
    for r in range(h):
        y = r * (side - 1) / (h - 1) if h > 1 else 0.0
        y0 = int(math.floor(y))
        y1, fy = min(y0 + 1, side - 1), y - y0
        for c in range(w):
            x = c * (side - 1) / (w - 1) if w > 1 else 0.0
            x0 = int(math.floor(x))
            x1, fx = min(x0 + 1, side - 1), x - x0
            out[r, c] = ((1 - fy) * (1 - fx) * tab[y0, x0] + (1 - fy) * fx * tab[y0, x1]
                         + fy * (1 - fx) * tab[y1, x0] + fy * fx * tab[y1, x1])
    return _to_merge_order(out, t, h, w, m)


def _rotary(cfg, t, h, w):
    dim = cfg.head_dim // 2
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    table = torch.outer(torch.arange(max(h, w), dtype=torch.float64), inv)
    rows = torch.arange(h)[:, None].expand(h, w).reshape(-1)
    cols = torch.arange(w)[None, :].expand(h, w).reshape(-1)
    ids = torch.stack([rows, cols], -1).float()
    ids = _to_merge_order(ids, t, h, w, cfg.spatial_merge_size).long()
    emb = table[ids].flatten(1)
    emb = torch.cat([emb, emb], -1)
    return emb.cos().float(), emb.sin().float()


def reference_forward(tensors, cfg: VisionEncoderConfig, pixels, grids, prefix: str = HF_PREFIX) -> torch.Tensor:
    """The fat output [merged tokens, out_hidden * (1 + deepstack)] in fp32."""
    def W(k):
        return tensors[prefix + k].float()

    H, nh, hd, m = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.spatial_merge_size
    x = pixels.float() @ W("patch_embed.proj.weight").reshape(H, -1).T + W("patch_embed.proj.bias")
    pos, cos, sin, seg = [], [], [], []
    for g in grids:
        pos.append(_pos_embed(W("pos_embed.weight"), cfg.num_grid_per_side, g.t, g.h, g.w, m))
        c, s = _rotary(cfg, g.t, g.h, g.w)
        cos.append(c)
        sin.append(s)
        seg += [g.h * g.w] * g.t
    x = x + torch.cat(pos)
    cos, sin = torch.cat(cos)[:, None], torch.cat(sin)[:, None]

    def ln(v, p):
        return F.layer_norm(v, (v.shape[-1],), W(p + ".weight"), W(p + ".bias"), cfg.layer_norm_eps)

    def merger(v, p, post):
        v = ln(v.reshape(-1, cfg.merged_hidden), p + "norm") if post else ln(v, p + "norm").reshape(
            -1, cfg.merged_hidden)
        v = F.gelu(v @ W(p + "linear_fc1.weight").T + W(p + "linear_fc1.bias"))
        return v @ W(p + "linear_fc2.weight").T + W(p + "linear_fc2.bias")

    deep = []
    for i in range(cfg.depth):
        p = f"blocks.{i}."
        y = ln(x, p + "norm1")
        qkv = (y @ W(p + "attn.qkv.weight").T + W(p + "attn.qkv.bias")).reshape(-1, 3, nh, hd)
        q, k, v = qkv.unbind(1)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        outs, start = [], 0
        for n in seg:                                   # attention never crosses a frame
            sl = slice(start, start + n)
            a = torch.softmax(torch.einsum("qhd,khd->hqk", q[sl], k[sl]) / math.sqrt(hd), -1)
            outs.append(torch.einsum("hqk,khd->qhd", a, v[sl]).reshape(n, H))
            start += n
        x = x + torch.cat(outs) @ W(p + "attn.proj.weight").T + W(p + "attn.proj.bias")
        y = F.gelu(ln(x, p + "norm2") @ W(p + "mlp.linear_fc1.weight").T + W(p + "mlp.linear_fc1.bias"),
                   approximate="tanh")
        x = x + y @ W(p + "mlp.linear_fc2.weight").T + W(p + "mlp.linear_fc2.bias")
        if i in cfg.deepstack_visual_indexes:
            j = cfg.deepstack_visual_indexes.index(i)
            deep.append(merger(x, f"deepstack_merger_list.{j}.", True))
    return torch.cat([merger(x, "merger.", False), *deep], -1)


def assert_bf16_close(got: torch.Tensor, ref: torch.Tensor, what: str, rtol: float = 2e-2) -> float:
    """|got - ref| <= rtol * max|ref| elementwise (a bf16-level tolerance scaled to the output's magnitude)."""
    got, ref = got.float(), ref.float()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rtol * scale, f"{what}: max |error| {err:.4g} > {rtol} x max|ref| {scale:.4g}"
    return err / scale
