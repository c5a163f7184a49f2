"""Torch attention cores shared by the prefill and decode blocks: GQA, optional per-head sinks (GPT-OSS: a sink
logit joins the softmax denominator only) and an optional sliding window (key j visible from query position p iff
j <= p and, with a window W > 0, j > p - W — the decode kernel's rule). Scores and softmax in fp32."""

from __future__ import annotations

import torch


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """scores [..., heads, q, k] (masked entries -inf); sinks [heads] or None."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    both = torch.cat([scores, sink], dim=-1)
    return torch.softmax(both, dim=-1)[..., :-1]


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    ok = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
    if window:
        ok &= k_pos.unsqueeze(-2) > q_pos.unsqueeze(-1) - window
    return ok


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None,
                     window: int = 0, scale: float | None = None) -> torch.Tensor:
    """Prefill: q [T, nq, d], k/v [T, nkv, d] at positions 0..T-1 → [T, nq, d] in q.dtype."""
    t, nq, d = q.shape
    g = nq // k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    kf = k.float().repeat_interleave(g, dim=1).transpose(0, 1)  # [nq, T, d]
    vf = v.float().repeat_interleave(g, dim=1).transpose(0, 1)
    scores = (q.float().transpose(0, 1) @ kf.transpose(1, 2)) * scale  # [nq, T, T]
    pos = torch.arange(t)
    scores = scores.masked_fill(~_visible(pos, pos, window), float("-inf"))
    return (_softmax_with_sinks(scores, sinks) @ vf).transpose(0, 1).to(q.dtype)


def cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     sinks: torch.Tensor | None = None, window: int = 0, scale: float | None = None) -> torch.Tensor:
    """Decode, one new token per sequence: q [B, nq, d] at positions [B]; caches [B, nkv, S_max, d] already hold
    the new keys at those positions → [B, nq, d]. Rows a query cannot see are excluded by selection (a stale
    NaN in an unused cache row never reaches the output)."""
    b, nq, d = q.shape
    g = nq // k_cache.shape[1]
    scale = d ** -0.5 if scale is None else scale
    kf = k_cache.float().repeat_interleave(g, dim=1)  # [B, nq, S, d]
    vf = v_cache.float().repeat_interleave(g, dim=1)
    visible = _visible(positions.view(b, 1), torch.arange(k_cache.shape[2]).expand(b, -1), window)  # [B, 1, S]
    scores = (kf @ q.float().unsqueeze(-1)).squeeze(-1) * scale  # [B, nq, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    p = _softmax_with_sinks(scores.unsqueeze(-2), sinks).squeeze(-2)  # [B, nq, S]
    vf = torch.where(visible.unsqueeze(-1), vf, 0.0)
    return (p.unsqueeze(-2) @ vf).squeeze(-2).to(q.dtype)
