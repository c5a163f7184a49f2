"""Backend plumbing shared by every kernel's functional entry (decode attention, vision attention, MoE router / TKG /
CTE): backend names and resolution, host-side tensor conversion. The argument checks live beside each kernel (one
source for each kernel's limits)."""

import numpy as np

import nkisim

BACKENDS = ("auto", "nki", "nkisim", "torch")


def resolve_backend(op, backend):
    """'auto' → 'nki' when AWS's real package serves `import nki`, else 'nkisim'; a kernel backend that cannot run
    here is refused by name before any work."""
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend={backend!r} must be one of {BACKENDS}")
    if backend == "auto":
        return "nkisim" if nkisim.active() else "nki"
    if backend == "nkisim" and not nkisim.active():
        raise RuntimeError(f"{op}: backend='nkisim' needs nkisim to serve `import nki` (set NKISIM=1 before importing)")
    if backend == "nki" and nkisim.active():
        raise RuntimeError(f"{op}: backend='nki' needs AWS's real nki package; `import nki` is served by nkisim here")
    return backend


def to_torch(x):
    """torch tensors pass through; NumPy arrays (bfloat16 included) become torch tensors; None stays None."""
    if x is None:
        return None
    import torch
    if isinstance(x, torch.Tensor):
        return x
    a = np.asarray(x)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a)


def as_int32(name, t):
    """int32 / int64 index tensors (torch or NumPy; int64 is torch's default) as int32, after the host checks have
    bounded their values; None stays None; any other dtype is an error naming the argument."""
    if t is None:
        return None
    dtype = dtype_name(t)
    if dtype == "int32":
        return t
    if dtype != "int64":
        raise ValueError(f"{name} must be int32 or int64, got {dtype}")
    if isinstance(t, np.ndarray):
        return t.astype(np.int32)
    import torch
    return t.to(torch.int32)


def shape_of(x):
    return None if x is None else tuple(int(d) for d in x.shape)


def dtype_name(x):
    return str(x.dtype).replace("torch.", "")


def distributed_world():
    """Context of an nkisim launch whose collectives span torch.distributed workers: inside an initialised default
    process group of several processes, this process's launches are rank dist.get_rank() of an nkisim world of
    dist.get_world_size() ranks (nkisim.process_world; each collective's records travel by all_gather_object);
    otherwise a plain launch."""
    import contextlib
    try:
        import torch.distributed as dist
    except ImportError:
        return contextlib.nullcontext()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return contextlib.nullcontext()

    def exchange(obj):
        got = [None] * dist.get_world_size()
        dist.all_gather_object(got, obj)
        return got
    return nkisim.process_world(dist.get_rank(), dist.get_world_size(), exchange)
