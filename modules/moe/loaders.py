"""GPT-OSS MoE weight loaders: HF checkpoint layout → the kernels' layout, reading only this rank's I-shard.

Checkpoint layout (verified against HF transformers ``models/gpt_oss/modeling_gpt_oss.py`` — ``GptOssTopKRouter``
and ``GptOssExperts`` — and ``integrations/mxfp4.py`` — ``Mxfp4GptOssExperts``, ``convert_moe_packed_tensors`` —
read through the search tool, huggingface/transformers; keys under ``model.layers.N.mlp.``):

    router.weight               [E, H]            logits = x @ weight.T + bias
    router.bias                 [E]
    experts.gate_up_proj        [E, H, 2I]        gate = [..., ::2], up = [..., 1::2] (interleaved)
    experts.gate_up_proj_bias   [E, 2I]           interleaved the same way
    experts.down_proj           [E, I, H]
    experts.down_proj_bias      [E, H]
  MXFP4 form (the published checkpoints; biases and router stay bf16):
    experts.gate_up_proj_blocks [E, 2I, H/32, 16] uint8, two E2M1 nibbles a byte, low nibble first
    experts.gate_up_proj_scales [E, 2I, H/32]     uint8 E8M0
    experts.down_proj_blocks    [E, H, I/32, 16]
    experts.down_proj_scales    [E, H, I/32]
  The published HF checkpoints (openai/gpt-oss-20b and -120b, ``model.safetensors.index.json``) carry exactly these
  keys, e.g. ``model.layers.0.mlp.experts.gate_up_proj_blocks`` (several public loaders found by the search tool read
  them by these names; OpenAI's ``original/`` variant uses other names and is not handled here).
  convert_moe_packed_tensors dequantises blocks [E, R, G, 16] to [E, R, G·32] and transposes the last two axes, so
  the MXFP4 rows are the bf16 tensor's last axis: gate_up rows keep the gate/up interleave, down rows are H.

Kernel layout (``nki_kernels/moe/moe_torch.py``): w_router [Hp, E], w_gate_up [E, Hp, 2, Is] (gate 0, up 1; the
MoE layer holds it tiled, [E, 128, Hp/128, 2·Is], ``nki_kernels/moe/gate_up_layout.py``: gate_up_weight_loader(tiled=
True) tiles this rank's slice), b_gate_up [E, 2, Is], w_down [E, Is, Hp], b_down [E, Hp]; Hp = padded hidden, Is =
this rank's padded I-shard.

Rank r holds the real intermediate columns ``shape.i_range(r)``; an interleaved gate_up slice of those columns is the
contiguous range [2·start, 2·stop) of the checkpoint's 2I axis, so one slice read serves both gate and up. MXFP4
down_proj is blocked along I: the rank reads the blocks covering its columns (whole blocks: an unaligned shard reads
at most one extra block at each end, none when I-shards are block-aligned, see ``mx_aligned_intermediate``) and
dequantises them to the parameter dtype on load (bf16 on trn2, which has no MX matmul; E2M1 × 2^k is exact in bf16).

Packed MXFP4 (``MoELayer(expert_format="mxfp4")``, trn3): the ``mx_*_loader``s keep the experts MXFP4 and convert the
rank's blocks/scales slices straight into the kernels' packed layout (``nki_kernels/moe/mx_weights.py``: words
[E, 128, K/512, N] int16 = float4_e2m1fn_x4 storage, element j of a 512-chunk on partition 8 (j // 32) + j % 8 in
nibble (j % 32) // 8; scales [E, 16, K/512, N] uint8, group g of chunk c = block 16 c + g), nibbles and bytes moved,
never dequantised. The contraction K (H for gate/up, I for down) is zero-padded to whole 512-chunks (zero codes,
scale 127 as ``mx_weights.pack``); N = gate columns then up columns of the rank's I-shard (gate/up) or Hp (down).
Each rank's I-shard must lie on 32-element MX blocks (``mx_shard_error``): with the I padding of
``mx_aligned_intermediate`` every shard starts on a block and reads exactly its own blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from modules.loading.loaders import slice_shape
from modules.moe.shape import MX_BLOCK, MoEShape, mx_aligned_intermediate
from nki_kernels.moe.gate_up_layout import tile_gate_up
from nki_kernels.moe.moe_torch import E8M0_BIAS, E8M0_NAN, FP4_E2M1_VALUES

MX_BYTES = MX_BLOCK // 2  # two E2M1 values a byte

GPT_OSS_MLP_KEY = "model.layers.{layer}.mlp."
GPT_OSS_NORM_KEY = "model.layers.{layer}.post_attention_layernorm.weight"


def _check_shape(src: Any, expect: tuple[int, ...], what: str) -> None:
    got = slice_shape(src)
    if tuple(got) != tuple(expect):
        raise ValueError(f"{what}: checkpoint shape {tuple(got)} != expected {tuple(expect)}")


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] == size:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _mx_sources(sources: Any, what: str) -> tuple[Any, Any] | None:
    """(blocks, scales) for an MXFP4 source mapping, None for a plain tensor."""
    if not isinstance(sources, Mapping):
        return None
    if set(sources) == {"blocks", "scales"}:
        return sources["blocks"], sources["scales"]
    if len(sources) == 1:
        return None
    raise ValueError(f"{what}: sources must be one tensor or the roles blocks/scales, got {sorted(sources)}")


def _plain(sources: Any) -> Any:
    return next(iter(sources.values())) if isinstance(sources, Mapping) else sources


def _check_mx_pair(blocks: Any, scales: Any, experts: int, rows: int, cols: int, what: str) -> None:
    """blocks [E, rows, cols/32, 16] and scales [E, rows, cols/32] for an MXFP4 weight whose blocked axis is cols."""
    if cols % MX_BLOCK:
        raise ValueError(f"{what}: the MXFP4-blocked dimension {cols} is not a multiple of {MX_BLOCK}")
    _check_shape(blocks, (experts, rows, cols // MX_BLOCK, MX_BYTES), f"{what}_blocks")
    _check_shape(scales, (experts, rows, cols // MX_BLOCK), f"{what}_scales")


_BYTE = torch.arange(256)
_FP4 = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
_LOW_VALUE, _HIGH_VALUE = _FP4[_BYTE & 0x0F], _FP4[_BYTE >> 4]  # byte → value of its low / high nibble


def dequant_mxfp4_rows_last(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks [E, *R, G, 16] and scales [E, *R, G] (R: row axes, any strides) → fp32 [E, G·32, *R]: the
    values of ``dequant_mxfp4`` (bit for bit: same table, same ldexp scale) with the blocked axis moved in front
    of the row axes.

    Why: the kernels want the blocked axis (H for gate_up, I for down) before the rows, i.e. the transpose of the
    checkpoint's layout. Transposing the blocks (one element per 8 outputs) and writing the low/high nibble
    values of each byte straight to their two output rows (two table lookups with strided outputs) is several
    times faster than dequantising in the checkpoint's order and then transposing the fp32 result (a strided copy
    of every output element)."""
    E, G, nr = blocks.shape[0], blocks.shape[-2], blocks.dim() - 3
    rows = tuple(range(1, nr + 1))
    b = blocks.permute(0, nr + 1, nr + 2, *rows).contiguous().to(torch.int64)     # [E, G, 16, *R], uint8 moved
    vals = torch.empty(*b.shape[:3], 2, *b.shape[3:], dtype=torch.float32)        # [E, G, 16, 2, *R]
    torch.take(_LOW_VALUE, b, out=vals[:, :, :, 0])                                # even element of each pair
    torch.take(_HIGH_VALUE, b, out=vals[:, :, :, 1])                               # odd element
    exp = scales.permute(0, nr + 1, *rows).to(torch.int32) - E8M0_BIAS            # [E, G, *R]
    scale = torch.ldexp(torch.ones(exp.shape, dtype=torch.float32), exp)
    scale.masked_fill_(scales.permute(0, nr + 1, *rows) == E8M0_NAN, float("nan"))
    vals = vals.view(E, G, 2 * MX_BYTES, *vals.shape[4:]).mul_(scale[:, :, None])
    return vals.view(E, G * MX_BLOCK, *vals.shape[3:])


# ---- packed MXFP4 (the kernels' layout, no dequantisation) ---------------------------------------------------------
MX_CHUNK = 512                    # contraction elements per nc_matmul_mx (mx_weights.CHUNK)
MX_CHUNK_BLOCKS = MX_CHUNK // MX_BLOCK
MX_PAD_SCALE = E8M0_BIAS          # scale code of padding blocks (2^0; their codes are 0), as mx_weights.pack


def mx_shard_error(shape: MoEShape, op: str = "MoELayer") -> str | None:
    """Why ``shape`` cannot hold packed MXFP4 experts (None when it can): the packed layout needs whole 512-element
    H chunks and every rank's I-shard on 32-element MX block boundaries."""
    if shape.hidden_padded % MX_CHUNK:
        return (f"{op}: expert_format='mxfp4' needs hidden_padded % {MX_CHUNK} == 0 (whole nc_matmul_mx chunks), got "
                f"hidden_padded={shape.hidden_padded}; leave hidden_padded at its default (H rounded up to 512)")
    if shape.intermediate % MX_BLOCK:
        return (f"{op}: expert_format='mxfp4' needs the checkpoint's intermediate={shape.intermediate} to be a "
                f"multiple of the MX block ({MX_BLOCK})")
    if shape.i_per_rank % MX_BLOCK:
        return (f"{op}: expert_format='mxfp4' needs every rank's I-shard on {MX_BLOCK}-element MX blocks, but "
                f"intermediate_padded={shape.intermediate_padded} / tp_size={shape.tp_size} = {shape.i_per_rank} "
                f"columns a rank is not a multiple of {MX_BLOCK}; build the shape with intermediate_padded="
                f"mx_aligned_intermediate({shape.intermediate}, {shape.tp_size}) = "
                f"{mx_aligned_intermediate(shape.intermediate, shape.tp_size)}")
    return None


def mx_packed_shapes(shape: MoEShape) -> dict[str, tuple[int, ...]]:
    """Shapes of this rank's packed MXFP4 expert tensors: words and scales of gate/up (K = Hp, N = 2·Is) and down
    (K = Is zero-padded to whole 512-chunks, N = Hp)."""
    E, Hp, Is = shape.experts, shape.hidden_padded, shape.i_per_rank
    kc, kd = -(-Hp // MX_CHUNK), -(-Is // MX_CHUNK)
    return {"w_gate_up": (E, 128, kc, 2 * Is), "w_gate_up_scale": (E, 16, kc, 2 * Is),
            "w_down": (E, 128, kd, Hp), "w_down_scale": (E, 16, kd, Hp)}


def _pad_value(t: torch.Tensor, dim: int, size: int, value: int) -> torch.Tensor:
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_full(shape, value)], dim=dim)


def mx_pack_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Checkpoint MXFP4 blocks [E, N, G, 16] uint8 (G a multiple of 16: whole 512-chunks; element 2m of a block in
    the low nibble of byte m) → the kernels' words [E, 128, G/16, N] int16 (float4_e2m1fn_x4 storage).

    Element 8q + r of block g (q: lane, r: row in the 8-partition group) is the (r % 2) nibble of byte 4q + r // 2
    and goes to nibble q of the word on partition 8g + r: bytes [.., q, s] give the elements r = 2s (low nibble)
    and 2s + 1 (high); lanes 0-1 form the word's low byte, lanes 2-3 its high byte (little-endian int16 view)."""
    E, N, G, _ = blocks.shape
    if G % MX_CHUNK_BLOCKS:
        raise ValueError(f"mx_pack_blocks: blocks per row G={G} must be a multiple of {MX_CHUNK_BLOCKS}")
    b = blocks.reshape(E, N, G, 4, 4)                                           # [.., q, s]
    nib = torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(E, N, G, 4, 8)        # [.., q, r]
    lo = nib[..., 0, :] | (nib[..., 1, :] << 4)                                 # lanes 0, 1 → bits 0-7
    hi = nib[..., 2, :] | (nib[..., 3, :] << 4)                                 # lanes 2, 3 → bits 8-15
    words = torch.stack([lo, hi], dim=-1).view(torch.int16)                     # [E, N, G, 8, 1] (little-endian)
    return words.reshape(E, N, G // MX_CHUNK_BLOCKS, 128).permute(0, 3, 2, 1).contiguous()


def mx_pack_scales(scales: torch.Tensor) -> torch.Tensor:
    """Checkpoint E8M0 scales [E, N, G] uint8 (G a multiple of 16) → the kernels' [E, 16, G/16, N] uint8."""
    E, N, G = scales.shape
    if G % MX_CHUNK_BLOCKS:
        raise ValueError(f"mx_pack_scales: blocks per row G={G} must be a multiple of {MX_CHUNK_BLOCKS}")
    return scales.reshape(E, N, G // MX_CHUNK_BLOCKS, MX_CHUNK_BLOCKS).permute(0, 3, 2, 1).contiguous()


def _mx_source(sources: Any, role: str, what: str) -> Any:
    if isinstance(sources, Mapping):
        if role in sources:
            return sources[role]
        if len(sources) != 1:
            raise ValueError(f"{what}: sources must be the checkpoint's {role} tensor, got roles {sorted(sources)}")
    return _plain(sources)


def _check_mx_loader_shape(shape: MoEShape) -> None:
    err = mx_shard_error(shape, "packed MXFP4 loader")
    if err:
        raise ValueError(err)


def mx_gate_up_loader(shape: MoEShape, part: str):
    """gate_up_proj_blocks [E, 2I, H/32, 16] (part "blocks") or gate_up_proj_scales [E, 2I, H/32] (part "scales")
    → this rank's packed w_gate_up words [E, 128, Hp/512, 2·Is] or w_gate_up_scale [E, 16, Hp/512, 2·Is]: rows
    2i + j of the rank's columns i (j: gate 0 / up 1, one contiguous slice) reordered to N = j·Is + i, the I-shard
    zero-padded to Is, H to Hp."""
    if part not in ("blocks", "scales"):
        raise ValueError(f"mx_gate_up_loader: part must be 'blocks' or 'scales', got {part!r}")
    E, H, inter = shape.experts, shape.hidden, shape.intermediate
    Is, G = shape.i_per_rank, shape.hidden_padded // MX_BLOCK
    _check_mx_loader_shape(shape)
    what = f"gate_up_proj_{part}"

    def load(sources: Any, rank: int) -> torch.Tensor:
        src = _mx_source(sources, part, what)
        if H % MX_BLOCK:
            raise ValueError(f"{what}: the MXFP4-blocked dimension H={H} is not a multiple of {MX_BLOCK}")
        tail = (H // MX_BLOCK, MX_BYTES) if part == "blocks" else (H // MX_BLOCK,)
        _check_shape(src, (E, 2 * inter, *tail), what)
        start, stop = shape.i_range(rank)
        n = stop - start
        raw = src[:, 2 * start:2 * stop] if n else torch.zeros(E, 0, *tail, dtype=torch.uint8)
        t = raw.reshape(E, n, 2, *tail).transpose(1, 2)                          # [E, 2, n, G, (16)]
        pad = 0 if part == "blocks" else MX_PAD_SCALE
        t = _pad_value(_pad_value(t, 2, Is, pad), 3, G, pad).reshape(E, 2 * Is, G, *tail[1:])
        return mx_pack_blocks(t) if part == "blocks" else mx_pack_scales(t)

    return load


def mx_down_loader(shape: MoEShape, part: str):
    """down_proj_blocks [E, H, I/32, 16] (part "blocks") or down_proj_scales [E, H, I/32] (part "scales") → this
    rank's packed w_down words [E, 128, ceil(Is/512), Hp] or w_down_scale [E, 16, ceil(Is/512), Hp]: the rank's own
    blocks (its shard starts on a block), zero blocks up to whole 512-chunks, H rows zero-padded to Hp."""
    if part not in ("blocks", "scales"):
        raise ValueError(f"mx_down_loader: part must be 'blocks' or 'scales', got {part!r}")
    E, H, inter, Hp = shape.experts, shape.hidden, shape.intermediate, shape.hidden_padded
    _check_mx_loader_shape(shape)
    G = -(-shape.i_per_rank // MX_CHUNK) * MX_CHUNK_BLOCKS
    what = f"down_proj_{part}"

    def load(sources: Any, rank: int) -> torch.Tensor:
        src = _mx_source(sources, part, what)
        tail = (MX_BYTES,) if part == "blocks" else ()
        _check_shape(src, (E, H, inter // MX_BLOCK, *tail), what)
        start, stop = shape.i_range(rank)
        g0, g1 = start // MX_BLOCK, stop // MX_BLOCK            # exact: mx_shard_error guarantees the alignment
        t = src[:, :, g0:g1] if g1 > g0 else torch.zeros(E, H, 0, *tail, dtype=torch.uint8)
        pad = 0 if part == "blocks" else MX_PAD_SCALE
        t = _pad_value(_pad_value(t, 2, G, pad), 1, Hp, pad)
        return mx_pack_blocks(t) if part == "blocks" else mx_pack_scales(t)

    return load


def router_weight_loader(shape: MoEShape):
    """router.weight [E, H] → [Hp, E] (transposed, zero rows for the hidden padding); replicated."""

    def load(sources: Any, rank: int) -> torch.Tensor:
        src = _plain(sources)
        _check_shape(src, (shape.experts, shape.hidden), "router.weight [E, H]")
        return _pad(src[:, :].t(), 0, shape.hidden_padded)

    return load


def hidden_vector_loader(shape: MoEShape, what: str):
    """A replicated tensor whose last axis is H (down_proj_bias [E, H], the norm weight [H]) → zero-padded to Hp."""

    def load(sources: Any, rank: int) -> torch.Tensor:
        src = _plain(sources)
        got = slice_shape(src)
        if not got or got[-1] != shape.hidden or (len(got) == 2 and got[0] != shape.experts):
            want = (shape.experts, shape.hidden) if len(got) == 2 else (shape.hidden,)
            raise ValueError(f"{what}: checkpoint shape {tuple(got)} != expected {want}")
        return _pad(src[...] if isinstance(src, torch.Tensor) else src[:], -1, shape.hidden_padded)

    return load


def gate_up_weight_loader(shape: MoEShape, tiled: bool = False):
    """gate_up_proj [E, H, 2I] (or its MXFP4 blocks/scales) → this rank's w_gate_up [E, Hp, 2, Is], or with tiled the
    kernels' tiled layout [E, 128, Hp/128, 2·Is] of that slice (gate_up_layout.tile_gate_up: what MoELayer holds)."""
    E, H, inter = shape.experts, shape.hidden, shape.intermediate

    def load(sources: Any, rank: int) -> torch.Tensor:
        start, stop = shape.i_range(rank)
        n = stop - start
        mx = _mx_sources(sources, "gate_up_proj")
        if mx is None:
            src = _plain(sources)
            _check_shape(src, (E, H, 2 * inter), "gate_up_proj [E, H, 2I]")
            # Interleaved columns 2i (gate), 2i+1 (up) of this rank's i: one contiguous slice.
            raw = src[:, :, 2 * start:2 * stop] if n else torch.zeros(E, H, 0)
            w = raw.reshape(E, H, n, 2).permute(0, 1, 3, 2)                          # [E, H, 2, n]
        else:
            blocks, scales = mx
            _check_mx_pair(blocks, scales, E, 2 * inter, H, "gate_up_proj")
            if n:
                # Rows 2i + j (i: this rank's column, j: gate 0 / up 1) viewed as [j, i]: dequantised straight
                # into [E, H, 2, n], no fp32 transpose.
                b = blocks[:, 2 * start:2 * stop].reshape(E, n, 2, H // MX_BLOCK, MX_BYTES).transpose(1, 2)
                sc = scales[:, 2 * start:2 * stop].reshape(E, n, 2, H // MX_BLOCK).transpose(1, 2)
                w = dequant_mxfp4_rows_last(b, sc)                                    # [E, H, 2, n]
            else:
                w = torch.zeros(E, H, 2, 0)
        w = _pad(_pad(w, 3, shape.i_per_rank), 1, shape.hidden_padded)
        return tile_gate_up(w) if tiled else w

    return load


def gate_up_bias_loader(shape: MoEShape):
    """gate_up_proj_bias [E, 2I] (interleaved) → this rank's b_gate_up [E, 2, Is]."""
    E = shape.experts

    def load(sources: Any, rank: int) -> torch.Tensor:
        src = _plain(sources)
        _check_shape(src, (E, 2 * shape.intermediate), "gate_up_proj_bias [E, 2I]")
        start, stop = shape.i_range(rank)
        n = stop - start
        raw = src[:, 2 * start:2 * stop] if n else torch.zeros(E, 0)
        return _pad(raw.reshape(E, n, 2).permute(0, 2, 1), 2, shape.i_per_rank)

    return load


def down_weight_loader(shape: MoEShape):
    """down_proj [E, I, H] (or its MXFP4 blocks/scales [E, H, I/32, ...]) → this rank's w_down [E, Is, Hp]."""
    E, H, inter = shape.experts, shape.hidden, shape.intermediate

    def load(sources: Any, rank: int) -> torch.Tensor:
        start, stop = shape.i_range(rank)
        n = stop - start
        mx = _mx_sources(sources, "down_proj")
        if mx is None:
            src = _plain(sources)
            _check_shape(src, (E, inter, H), "down_proj [E, I, H]")
            w = src[:, start:stop, :] if n else torch.zeros(E, 0, H)
        else:
            blocks, scales = mx
            _check_mx_pair(blocks, scales, E, H, inter, "down_proj")
            if n:
                # Whole blocks covering [start, stop): scales are per block, so a block is the unit of reading.
                g0, g1 = start // MX_BLOCK, -(-stop // MX_BLOCK)
                cols = dequant_mxfp4_rows_last(blocks[:, :, g0:g1], scales[:, :, g0:g1])  # [E, (g1-g0)·32, H]
                off = start - g0 * MX_BLOCK
                w = cols[:, off:off + n]                                                # [E, n, H]
            else:
                w = torch.zeros(E, 0, H)
        return _pad(_pad(w, 1, shape.i_per_rank), 2, shape.hidden_padded)

    return load


def gpt_oss_moe_mappings(layer: int, mxfp4: bool, norm: bool = False, prefix: str = "",
                         packed: bool = False) -> dict[str, Any]:
    """Parameter name (of an ``MoELayer`` under ``prefix``) → GPT-OSS checkpoint key, or role → key for MXFP4.
    packed: the layer keeps its experts MXFP4 (``expert_format="mxfp4"``): words and scales are parameters of their
    own, each mapped to its one checkpoint tensor (needs an MXFP4 checkpoint)."""
    mlp = GPT_OSS_MLP_KEY.format(layer=layer)
    ex = mlp + "experts."
    if packed and not mxfp4:
        raise ValueError("gpt_oss_moe_mappings: packed=True (expert_format='mxfp4') needs an MXFP4 checkpoint "
                         f"({ex}gate_up_proj_blocks / _scales); this one has bf16 experts: use expert_format='bf16'")

    def mx_or_plain(name: str) -> str | dict[str, str]:
        return {"blocks": f"{ex}{name}_blocks", "scales": f"{ex}{name}_scales"} if mxfp4 else ex + name

    out: dict[str, Any] = {
        "router.weight": mlp + "router.weight", "router.bias": mlp + "router.bias",
        "w_gate_up": mx_or_plain("gate_up_proj"), "b_gate_up": ex + "gate_up_proj_bias",
        "w_down": mx_or_plain("down_proj"), "b_down": ex + "down_proj_bias",
    }
    if packed:
        for name in ("gate_up_proj", "down_proj"):
            p = "w_" + name.split("_proj")[0]
            out[p], out[p + "_scale"] = ex + name + "_blocks", ex + name + "_scales"
    if norm:
        out["gamma"] = GPT_OSS_NORM_KEY.format(layer=layer)
    return {prefix + k: v for k, v in out.items()}


def gpt_oss_checkpoint_is_mxfp4(checkpoint, layer: int) -> bool:
    """True when the checkpoint ships layer's experts as MXFP4 blocks/scales, False for plain tensors."""
    ex = GPT_OSS_MLP_KEY.format(layer=layer) + "experts."
    if f"{ex}gate_up_proj_blocks" in checkpoint:
        return True
    if f"{ex}gate_up_proj" in checkpoint:
        return False
    raise KeyError(f"checkpoint has neither {ex}gate_up_proj nor {ex}gate_up_proj_blocks (layer {layer})")
