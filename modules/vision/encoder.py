"""Qwen3-VL vision encoder over block-packed inputs with vision TP and block-level DP (the vision seed's flow).

Forward (every rank receives the same full PackedVision):
  0. DP scatter: keep this rank's num_blocks / dp blocks (dp > 1 only).
  1. Patch embedding + learned position embedding (4-corner bilinear blend) → [blocks, block_size, hidden].
  2. Transformer layers (LayerNorm, block-packed attention kernel, GELU MLP; TP all-reduces on the vision TP group);
     after each deepstack layer its merger extracts that layer's merged features.
  3. Final merger → [blocks, block_size / merge_unit, out_hidden]. Merged rows of padding are zeroed here, so a
     padding block produces zero outputs.
  4. DP all-gather of the main and deepstack features over the vision DP group (dp > 1 only) → [num_blocks, ...].
  5. Unpack to per-image order with unpack_indices (same on every rank) → [merged_seq_len, out_hidden].
  6. Fat output: main and deepstack features concatenated on the feature dim → [merged_seq_len, out_hidden * (1 + n)].
Groups: ``tp_group`` is the vision TP group (the text TP group itself when the sizes match, see
modules/parallel/state.py); ``dp_group`` is the vision DP column group, None when dp is 1.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from modules.config import VISION_BLOCK_ALIGN
from modules.loading.checkpoint import SafetensorsCheckpoint
from modules.parallel.transition import dp_gather_blocks, dp_scatter_blocks
from modules.vision.config import VisionEncoderConfig
from modules.vision.layers import PatchEmbed, PatchMerger, VisionBlock, _replicated
from modules.vision.packing import PackedVision
from nki_kernels.vision import BACKENDS as ATTENTION_BACKENDS

HF_PREFIX = "model.visual."


class Qwen3VLVisionEncoder(nn.Module):
    """backend selects the attention kernel's implementation ("torch": its reference; "nkisim": the NKI kernel on
    the interpreter; "nki": on a NeuronCore; "auto": nki when importable, else nkisim); lnc=2 runs each block's kernel
    on a two-core logical NeuronCore. dtype is the activations' and weights' (the kernel's inputs are bf16)."""

    def __init__(self, cfg: VisionEncoderConfig, tp_group, dp_group=None, backend: str = "auto",
                 dtype: torch.dtype = torch.bfloat16, lnc: int = 1) -> None:
        super().__init__()
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"Qwen3VLVisionEncoder: backend={backend!r}; choose from {ATTENTION_BACKENDS}")
        if lnc not in (1, 2):
            raise ValueError(f"Qwen3VLVisionEncoder: lnc={lnc!r} must be 1 or 2 (cores per logical NeuronCore)")
        if dp_group is not None and dp_group.world_size == 1:
            dp_group = None                     # the seed creates vision DP groups only for dp > 1
        cfg.check_tp(tp_group.world_size)
        self.cfg, self.tp_group, self.dp_group, self.dtype, self.lnc = cfg, tp_group, dp_group, dtype, lnc
        self.patch_embed = PatchEmbed(cfg, dtype)
        self.pos_embed = nn.Module()
        self.pos_embed.weight = _replicated((cfg.num_position_embeddings, cfg.hidden_size), dtype)
        self.blocks = nn.ModuleList([VisionBlock(cfg, tp_group, backend, dtype, lnc) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, tp_group, postshuffle_norm=False, dtype=dtype)
        self.deepstack_merger_list = nn.ModuleList(
            [PatchMerger(cfg, tp_group, postshuffle_norm=True, dtype=dtype) for _ in cfg.deepstack_visual_indexes])

    @classmethod
    def from_parallel_state(cls, cfg: VisionEncoderConfig, state, **kwargs) -> Qwen3VLVisionEncoder:
        """On the vision groups of ``modules.parallel.state.initialize_parallel_state(config, vision)``."""
        if state.vision_tp is None:
            raise ValueError("Qwen3VLVisionEncoder.from_parallel_state: the parallel state has no vision groups; "
                             "pass a VisionNeuronConfig to initialize_parallel_state")
        return cls(cfg, state.vision_tp, state.vision_dp, **kwargs)

    @property
    def dp_size(self) -> int:
        return 1 if self.dp_group is None else self.dp_group.world_size

    def load_checkpoint(self, path: str | Path | SafetensorsCheckpoint, prefix: str = HF_PREFIX) -> dict:
        """Load this rank's slices from an HF-layout safetensors checkpoint (file or directory)."""
        ckpt = path if isinstance(path, SafetensorsCheckpoint) else SafetensorsCheckpoint(path)
        names = [n for n, _ in self.named_parameters()]
        return ckpt.load_sharded(self.tp_group.rank_in_group, self.tp_group.world_size, self,
                                 mappings={n: prefix + n for n in names})

    def _check_inputs(self, p: PackedVision) -> None:
        cfg = self.cfg
        cfg.check_block_size(p.block_size)
        nb, bs = p.num_blocks, p.block_size
        if bs % (VISION_BLOCK_ALIGN * self.lnc):
            # LNC=2 splits each block's 128-row query tiles evenly between the two cores.
            raise ValueError(f"Qwen3VLVisionEncoder: block_size={bs} must be a multiple of "
                             f"{VISION_BLOCK_ALIGN * self.lnc} at lnc={self.lnc}")
        expect = {"pixel_values": (nb, bs, cfg.patch_dim), "pos_emb_idx": (nb, bs, 4), "pos_emb_weight": (nb, bs, 4),
                  "cos": (nb, bs, cfg.head_dim), "sin": (nb, bs, cfg.head_dim), "bound_min": (nb, bs),
                  "bound_max": (nb, bs)}
        for name, shape in expect.items():
            got = tuple(getattr(p, name).shape)
            if got != shape:
                raise ValueError(f"Qwen3VLVisionEncoder: {name} shape {got} != {shape}")
        if nb % self.dp_size:
            raise ValueError(f"Qwen3VLVisionEncoder: num_blocks={nb} is not a multiple of vision dp_size="
                             f"{self.dp_size}; pack with dp_size or select_vision_bucket (they pad)")

    def encode_blocks(self, t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Steps 1–3 on this rank's blocks (``PackedVision.block_tensors()`` sliced to them): the main merged features
        then one per deepstack layer, each [blocks, block_size / merge_unit, out_hidden], padding rows zero."""
        cfg = self.cfg
        x = self.patch_embed(t["pixel_values"])                             # step 1
        corners = self.pos_embed.weight[t["pos_emb_idx"]]                   # [blocks, bs, 4, hidden]
        x = x + (corners * t["pos_emb_weight"].to(corners.dtype)[..., None]).sum(-2)
        rope = (t["cos"], t["sin"], t["bound_min"], t["bound_max"])
        deepstack = []
        for i, blk in enumerate(self.blocks):                               # step 2
            x = blk(x, *rope)
            if i in cfg.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[cfg.deepstack_visual_indexes.index(i)](x))
        feats = [self.merger(x), *deepstack]                                # step 3
        # A merged row is real iff its first patch is (its whole group then is): padding gives exact zeros.
        valid = (t["bound_max"] > t["bound_min"])[:, ::cfg.merge_unit, None]
        return [f * valid.to(f.dtype) for f in feats]

    def forward(self, packed: PackedVision) -> torch.Tensor:
        """The fat output [merged_seq_len, out_hidden * (1 + deepstack layers)], identical on every rank."""
        self._check_inputs(packed)
        t = packed.block_tensors()
        if self.dp_group is not None:                                       # step 0
            t = {k: dp_scatter_blocks(v, self.dp_group) for k, v in t.items()}
        feats = self.encode_blocks(t)
        if self.dp_group is not None:                                       # step 4
            feats = [dp_gather_blocks(f, self.dp_group) for f in feats]
        idx = packed.unpack_indices                                         # step 5
        feats = [f.reshape(-1, self.cfg.out_hidden_size).index_select(0, idx) for f in feats]
        return torch.cat(feats, dim=-1)                                     # step 6

    def split_fat(self, fat: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(main features, [deepstack features per index]) from the fat output."""
        parts = fat.split(self.cfg.out_hidden_size, dim=-1)
        return parts[0], list(parts[1:])
