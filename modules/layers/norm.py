"""Replicated RMSNorm and LayerNorm (no collectives: they are per token)."""

from __future__ import annotations

import torch
from torch import nn

from modules.loading.loaders import replicated_weight_loader, set_weight_loader


class RMSNorm(nn.Module):
    """RMSNorm over the real hidden size; the weight may be zero-padded to a hardware-aligned padded_size.

    Inputs may arrive padded (zeros beyond hidden_size): the mean square still divides by the real size, and
    the padded weight keeps the padding at zero.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, padded_size: int | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        padded_size = hidden_size if padded_size is None else padded_size
        if padded_size < hidden_size:
            raise ValueError(f"padded_size={padded_size} < hidden_size={hidden_size}")
        self.hidden_size, self.padded_size, self.eps = hidden_size, padded_size, eps
        weight = torch.zeros(padded_size, dtype=dtype)
        weight[:hidden_size] = 1
        self.weight = nn.Parameter(weight, requires_grad=False)
        set_weight_loader(self.weight, replicated_weight_loader(pad_to=padded_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] not in (self.hidden_size, self.padded_size):
            raise ValueError(f"last dim {x.shape[-1]} is neither hidden_size={self.hidden_size} nor "
                             f"padded_size={self.padded_size}")
        xf = x.float()
        var = xf.pow(2).sum(-1, keepdim=True) / self.hidden_size
        return (self.weight[: x.shape[-1]] * (xf * torch.rsqrt(var + self.eps))).to(x.dtype)


class LayerNorm(nn.Module):
    """Replicated LayerNorm with weight and bias (ViT encoders); statistics in fp32, output in the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        set_weight_loader(self.weight, replicated_weight_loader())
        set_weight_loader(self.bias, replicated_weight_loader())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"LayerNorm: last dim {x.shape[-1]} != hidden_size={self.hidden_size}")
        y = torch.nn.functional.layer_norm(x.float(), (self.hidden_size,), self.weight.float(), self.bias.float(),
                                           self.eps)
        return y.to(x.dtype)
