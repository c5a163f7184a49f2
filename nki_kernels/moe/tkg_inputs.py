"""Inputs of the MoE TKG kernel at a rank shard's shapes: random bf16 tensors in `moe_tkg(...)`'s argument layout and
the shard of a model spec. Shared by the kernel's tests and the bench (which must not import tests/); host-side only.
"""

import torch


def tkg_shard(spec, tp, pad_to=512, **extra):
    """Keyword shape of one tensor-parallel rank of an MoE `spec` (a modules.model_specs.TextModelSpec, duck-typed:
    this layer does not import modules/): H = hidden padded to a multiple of `pad_to` (hidden_actual = the real
    one), E all experts (TP without EP), k, I = the rank's slice of the expert intermediate size. `extra` overrides."""
    H = -(-spec.hidden // pad_to) * pad_to
    shard = dict(H=H, E=spec.experts, top_k=spec.top_k, inter=spec.intermediate // tp,
                 hidden_actual=spec.hidden if H != spec.hidden else None)
    shard.update(extra)
    return shard


def make_tkg_inputs(T, H, E, top_k, inter, hidden_actual=None, seed=0, gamma=True, biases=True, skew=None,
                    dtype=torch.bfloat16):
    """(args, kwargs) for moe_tkg(*args, **kwargs). Scales keep every projection O(1) (gate/up ~ N(0, 1), so the
    clamped SwiGLU's limits are reached by a few percent of the entries).

    skew: None (random routing); "one" = every token's top-k is the same k experts 0..k-1 (the other experts get
    no token); "hot" = expert E-1 is every token's first choice, the rest random."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, sc=1.0):
        return (torch.randn(*shape, generator=g) * sc).to(dtype)

    x = r(T, H)
    if hidden_actual:
        x[:, hidden_actual:] = 0
    n = hidden_actual or H
    w_router = r(H, E, sc=n ** -0.5)
    b_router = torch.randn(E, generator=g) * 0.1
    if skew == "one":
        b_router[:top_k] += 40.0 - 8.0 * torch.arange(top_k, dtype=torch.float32)   # order 0..k-1, gaps >> noise
    elif skew == "hot":
        b_router[E - 1] += 30.0
    elif skew is not None:
        raise ValueError(f"skew={skew!r} must be None, 'one' or 'hot'")
    args = (x, w_router, r(E, H, 2, inter, sc=n ** -0.5), r(E, inter, H, sc=inter ** -0.5))
    kw = dict(top_k=top_k, b_router=b_router.to(dtype) if biases or skew else None,
              b_gate_up=r(E, 2, inter, sc=0.1) if biases else None, b_down=r(E, H, sc=0.1) if biases else None,
              gamma=(1 + 0.1 * torch.randn(H, generator=g)).to(dtype) if gamma else None, hidden_actual=hidden_actual)
    return args, kw
