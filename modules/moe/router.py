"""The MoE router: replicated fp32-logit top-k over E experts (no collectives: every rank holds the whole router)."""

from __future__ import annotations

import torch
from torch import nn

from modules.loading.loaders import replicated_weight_loader, set_weight_loader
from modules.moe.loaders import router_weight_loader
from modules.moe.shape import MoEShape
from nki_kernels.entry import to_torch as as_torch
from nki_kernels.moe import ROUTER_MODES
from nki_kernels.moe import router as router_entry


class MoERouter(nn.Module):
    """weight [Hp, E] (the kernels' layout; loaded from the checkpoint's [E, H] with zero rows for the hidden pad),
    bias [E]. mode "gpt_oss": top-k on logits then softmax over the k; "softmax_topk": softmax then top-k (optionally
    renormalised). forward(x [T, Hp]) → (logits [T, E] fp32, expert_index [T, k], affinities [T, k] fp32).
    backend: the kernel entry's ("auto" | "nki" | "nkisim" | "torch")."""

    def __init__(self, shape: MoEShape, mode: str = "gpt_oss", renormalize: bool = False, bias: bool = True,
                 dtype: torch.dtype = torch.bfloat16, backend: str = "auto") -> None:
        super().__init__()
        if mode not in ROUTER_MODES:
            raise ValueError(f"MoERouter: mode must be one of {ROUTER_MODES}, got {mode!r}")
        self.shape, self.mode, self.renormalize, self.backend = shape, mode, renormalize, backend
        self.top_k = shape.top_k
        self.weight = nn.Parameter(torch.zeros(shape.hidden_padded, shape.experts, dtype=dtype), requires_grad=False)
        set_weight_loader(self.weight, router_weight_loader(shape))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(shape.experts, dtype=dtype), requires_grad=False)
            set_weight_loader(self.bias, replicated_weight_loader())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if x.dim() != 2 or x.shape[1] != self.shape.hidden_padded:
            raise ValueError(f"MoERouter: x must be [T, hidden_padded={self.shape.hidden_padded}], got "
                             f"{tuple(x.shape)}")
        out = router_entry(x, self.weight, self.bias, top_k=self.top_k, mode=self.mode,
                           renormalize=self.renormalize, backend=self.backend)
        return tuple(as_torch(t) for t in out)
