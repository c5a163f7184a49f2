"""`NkiTensor`: an allocation's storage plus a strided view, with the indexing rules of nki-api.md §3.3.

Element address = offset + sum(strides[k] * i_k) in the allocation's flat storage (in elements of the view's
dtype). On-chip (SBUF/PSUM) tensors keep dim 0 as the partition dim and stay at least 2-D; HBM tensors drop
integer-indexed dims (at least 1-D). Views share storage and cost nothing; `.ap()` addresses the base storage
directly. Indices are bounds-checked (stricter than NumPy's clamping of slices): an out-of-range slice is a bug.
"""

import itertools
import math
import warnings

import numpy as np

from . import dtypes as dt
from .errors import NkiTensorTruthWarning, NkiValidationError
from .frontend import parser_frontend

_BINARY_OP_ERROR = "binary operators on tensors not supported. Use nki.isa directly (or nl.add, nl.multiply, ...)."


_REGISTER_IDS = itertools.count(1)


class VirtualRegister:
    """A 32-bit engine register (`nisa.register_alloc`). Its value is the interpreter's current value.

    For the cost model a register is a pseudo-allocation (buffer "reg", alloc_id -id): register_alloc / move / load
    record a write of it, and a view whose address uses it (nl.ds, `.ap(scalar_offset=...)`, an index) records it
    as an address dependency, so the instruction waits for the register's last writer (`writer` = its seq)."""

    __slots__ = ("value", "name", "frozen", "id", "writer", "_access")

    def __init__(self, state=None, frozen=False, name=None):
        self.value = 0 if state is None else int(state)
        self.name = name
        self.frozen = frozen
        self.id = next(_REGISTER_IDS)
        self.writer = None      # seq of the last recorded instruction that wrote the register (None: never)
        self._access = None     # cached pseudo-Access (nkisim.runtime.access_of)

    # Python control flow on a register. Under the 0.7 tracer the value is not known while the kernel is built:
    # AWS's VirtualRegister page says `if`/`while`/`int()`/`range()` on a register raise TypeError. Under the 0.6
    # parser (NKI_COMPILER_FRONTEND=custom) `while reg:` is a runtime loop while the register is nonzero.
    def __bool__(self):
        if parser_frontend():
            return self.value != 0
        raise TypeError(_register_control_flow("bool()/if/while"))

    def __index__(self):
        if parser_frontend():
            return self.value
        raise TypeError(_register_control_flow("int()/range()/indexing by Python"))

    __int__ = __index__

    def __repr__(self):
        return f"VirtualRegister({self.value})"


def _register_control_flow(what):
    return (f"VirtualRegister in Python {what}: under the NKI 0.7 tracer a register's value is not known while the "
            "kernel is built. Use nl.fori_loop(lower, upper, body) for counted loops and nl.while_loop(init, body) "
            "for data-dependent loops; use the register as a loop bound or as a scalar_offset / nl.ds start "
            "(NKI_COMPILER_FRONTEND=custom keeps the 0.6 parser, where `while reg:` loops on the device)")


class DynSlice:
    """`nl.ds(start, size)`: a slice of `size` elements from `start` (an int, a register or a 1x1 tensor)."""

    __slots__ = ("start", "size", "step")

    def __init__(self, start, size, step=1):
        self.start = start
        self.size = size
        self.step = step

    def __repr__(self):
        return f"nl.ds({self.start}, {self.size})"


def ds(start, size):
    return DynSlice(start, size)


def contiguous_strides(shape):
    """Row-major element strides of a dense tensor of `shape`."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return strides


def scalar_value(x, what):
    """Current integer value of a compile-time int, a register, or a 1-element tensor (dynamic offsets)."""
    if isinstance(x, VirtualRegister):
        if getattr(x, "is_comparison", False):   # nisa.NkiScalar comparison results are traced but unusable
            raise TypeError(f"{what}: the result of an NkiScalar comparison is traced but cannot be used")
        return x.value
    if isinstance(x, NkiTensor):
        if x.size != 1:
            raise NkiValidationError(f"{what}: a dynamic offset tensor must hold 1 element, got shape {x.shape}")
        return int(np.asarray(read(x)).reshape(-1)[0])
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return int(x)
    raise NkiValidationError(f"{what}: expected an int, a VirtualRegister or a 1x1 tensor, got {type(x).__name__}")


class Indirect:
    """Per-partition row offsets for gather/scatter (`.ap(vector_offset=...)`, `vector_select`)."""

    __slots__ = ("index", "row_elems", "rows")

    def __init__(self, index, row_elems, rows):
        self.index = index          # NkiTensor (P, 1) of row numbers, read when the instruction executes
        self.row_elems = row_elems  # elements per indexed row of the base tensor
        self.rows = rows            # number of rows in the base (bound for oob_mode)


def _check_offset_width(alloc, x, what):
    """AWS nki.isa.scalar_load: a scalar of either width may address memory, but "on an SBUF or PSUM operand the
    offset must be nl.int32" (a 64-bit offset there is rejected rather than narrowed); HBM takes either width."""
    if getattr(x, "dtype", None) is dt.int64 and alloc.buffer.on_chip:
        raise NkiValidationError(f"{what}: an nl.int64 offset cannot address on-chip tensor '{alloc.name}' "
                                 f"({alloc.buffer.name}); use an nl.int32 scalar")


def _dynamic(x):
    """The register or 1-element tensor behind a dynamic offset, else None (compile-time ints)."""
    return x if isinstance(x, (VirtualRegister, NkiTensor)) else None


class NkiTensor:
    __slots__ = ("alloc", "shape", "strides", "offset", "dtype", "gather", "_npv", "_access", "_regs", "_free",
                 "_chip", "_psv", "_ew")

    def __init__(self, alloc, shape, strides, offset, dtype=None, indirect=None, regs=None):
        self.alloc = alloc
        self.shape = tuple(map(int, shape))
        self.strides = tuple(map(int, strides))
        self.offset = int(offset)
        self.dtype = dtype if dtype is not None else alloc.dtype
        self.gather = indirect
        self._npv = None      # cached NumPy view (views are immutable; storage is never reallocated)
        self._access = None   # cached cost-model footprint (nkisim.runtime.access_of)
        # registers / 1-element tensors this view's offset was computed from (nl.ds(reg, n), scalar_offset=reg,
        # t[reg]); the cost model makes instructions on the view wait for their producers. None when static.
        self._regs = regs
        # Facts of the (immutable) view computed once, on first use by an instruction: elements per partition, and
        # the on-chip partition-range problem ("" when none; nkisim.isa._common.on_chip).
        self._free = None
        self._chip = None
        self._psv = None     # cached PSUM written-state view (nkisim.isa._common.psum_state_view)
        self._ew = None      # fp32 elementwise-operand facts, or False (nkisim.isa._common.ew_operand)

    # ---- attributes of the real NkiTensor -------------------------------------------------------------------
    @property
    def buffer(self):
        return self.alloc.buffer

    @property
    def name(self):
        return self.alloc.name

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return math.prod(self.shape)

    @property
    def itemsize(self):
        return self.dtype.itemsize

    @property
    def base_tensor(self):
        """The whole tensor this view was taken from (its allocation, in the allocation's dtype). Not in AWS's
        published stub, but the nki-library reads it on plain kernel arguments and SBUF tiles (core/moe/moe_tkg
        gate_up_projection_mx.py: `weight.base_tensor`, then `.view(weight.dtype)` of a copy in the base dtype)."""
        a = self.alloc
        return NkiTensor(a, a.shape, contiguous_strides(a.shape), 0, a.dtype)

    @property
    def data(self):
        # NKI 0.7: a tensor is its own operand, as `grid.data` is a grid's (AWS's nl.tiles examples call
        # `nl.ndarray(...).data`)
        return self

    @property
    def alloc_site(self):
        return self.alloc.site

    def __repr__(self):
        return f"NkiTensor(name={self.name!r}, shape={self.shape}, dtype={self.dtype!r}, buffer={self.buffer!r})"

    def __len__(self):
        return self.shape[0]

    def __bool__(self):
        # `if tile:` is a presence test (always true): AWS's hardware-tested nki-library writes
        # `if params.expert_params and params.expert_params.expert_index:` (core/mlp/mlp_tkg/mlp_tkg_constants.py),
        # so the real toolchain accepts it. It never reads the tensor's data, which exists only on the device:
        # say so (once per call site) for code that means to branch on the values.
        warnings.warn(
            f"truth value of NkiTensor '{self.name}' {self.shape} (`if tile:` / `bool(tile)`) is always True: it tests "
            "that the tensor exists, not its contents, which exist only on the device. Write `tile is not None` for "
            "a presence test; to branch on the data, load it with nisa.scalar_load / nisa.register_load and use "
            "nl.fori_loop / nl.while_loop, or select with nisa ops (affine_select, tensor_copy_predicated)",
            NkiTensorTruthWarning, stacklevel=2)
        return True

    # Tensors carry no arithmetic in NKI 0.6: reject operators instead of silently computing in NumPy.
    def _no_op(self, *_):
        raise TypeError(_BINARY_OP_ERROR)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _no_op
    __floordiv__ = __mod__ = __pow__ = __matmul__ = __and__ = __or__ = __xor__ = __neg__ = _no_op
    __lt__ = __le__ = __gt__ = __ge__ = _no_op
    __iadd__ = __isub__ = __imul__ = _no_op

    def __setitem__(self, key, value):
        raise TypeError("NkiTensor does not support item assignment in NKI 0.6; write with an nki.isa op "
                        "(nisa.tensor_copy / nisa.dma_copy / nisa.memset)")

    def __iter__(self):
        raise TypeError("NkiTensor is not iterable; index it with integers, slices or nl.ds")

    def _with(self, shape, strides, offset, regs=None):
        if self._regs:
            regs = self._regs + regs if regs else self._regs
        return NkiTensor(self.alloc, shape, strides, offset, self.dtype, None, regs)

    # ---- indexing -----------------------------------------------------------------------------------------
    def __getitem__(self, key):
        if key.__class__ is tuple and self.gather is None and len(key) == len(self.shape):
            view = self._plain_slices(key)
            if view is not None:
                return view
        self._no_indirect("indexing")
        if not isinstance(key, tuple):
            key = (key,)
        if any(k is Ellipsis for k in key):
            i = next(j for j, k in enumerate(key) if k is Ellipsis)
            fill = self.ndim - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1:]
        if len(key) > self.ndim:
            raise IndexError(f"too many indices for tensor '{self.name}' of shape {self.shape}: {len(key)}")
        key = key + (slice(None),) * (self.ndim - len(key))
        shape, strides, offset, ints, regs = [], [], self.offset, [], None
        for d, (k, n, s) in enumerate(zip(key, self.shape, self.strides)):
            if isinstance(k, (slice, DynSlice)):
                start, size, step = _slice_bounds(k, n, d, self)
                if k.__class__ is DynSlice and k.start.__class__ is not int and _dynamic(k.start) is not None:
                    regs = (regs or ()) + (k.start,)
                elif k.__class__ is slice and (isinstance(k.start, VirtualRegister)
                                               or isinstance(k.stop, VirtualRegister)):
                    regs = (regs or ()) + tuple(v for v in (k.start, k.stop) if isinstance(v, VirtualRegister))
                offset += start * s
                shape.append(size)
                strides.append(s * step)
            elif isinstance(k, NkiTensor) and k.size != 1:
                raise IndexError("tensor indices (advanced indexing) are not supported in NKI 0.6; use slices, "
                                 "nl.ds, .ap(vector_offset=...) or .vector_select")
            else:
                if isinstance(k, (int, np.integer)):
                    i = int(k)
                else:
                    i = scalar_value(k, f"index of dim {d}")
                    regs = (regs or ()) + (k,)
                if i < 0:
                    i += n
                if not 0 <= i < n:
                    raise IndexError(f"index {k} is out of range for dim {d} of size {n} (tensor '{self.name}')")
                offset += i * s
                ints.append(len(shape))
                shape.append(1)
                strides.append(s)
        keep = set()
        if self.buffer.on_chip:
            keep.add(0)  # partition dim always stays
            free_left = sum(1 for j in range(1, len(shape)) if j not in ints)
            if free_left == 0:
                free_ints = [j for j in ints if j > 0]
                if free_ints:
                    keep.add(free_ints[-1])
        elif len(ints) == len(shape):
            keep.add(ints[-1])
        drop = set(ints) - keep
        shape = [x for j, x in enumerate(shape) if j not in drop]
        strides = [x for j, x in enumerate(strides) if j not in drop]
        if regs:
            for r in regs:
                _check_offset_width(self.alloc, r, "dynamic index / nl.ds start")
        return self._with(shape, strides, offset, regs)

    def _plain_slices(self, key):
        """Fast path of __getitem__ for a slice per dim with in-range compile-time bounds and step 1 (the common
        tile cut); None sends anything else (ints, nl.ds, steps, negative or out-of-range bounds) to the general
        path, which also raises the errors."""
        offset, shape = self.offset, []
        for k, n, s in zip(key, self.shape, self.strides):
            if k.__class__ is not slice or (k.step is not None and k.step != 1):
                return None
            start, stop = k.start, k.stop
            start = 0 if start is None else start
            stop = n if stop is None else stop
            if start.__class__ is not int or stop.__class__ is not int or not 0 <= start <= stop <= n:
                return None
            offset += start * s
            shape.append(stop - start)
        return self._with(shape, self.strides, offset)

    # ---- view methods (NKI 0.5+) --------------------------------------------------------------------------
    def slice(self, dim, start, end, step=1):
        n = self.shape[dim]
        if not (isinstance(start, (int, np.integer)) and isinstance(end, (int, np.integer))
                and 0 <= start < end <= n) or not (isinstance(step, (int, np.integer)) and step >= 1):
            raise NkiValidationError(f"slice(dim={dim}, start={start}, end={end}, step={step}): needs "
                                     f"0 <= start < end <= {n} and step >= 1 (C31)")
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim, index):
        i = scalar_value(index, "select index")
        key = [slice(None)] * self.ndim
        key[dim] = index if _dynamic(index) is not None else i
        return self[tuple(key)]

    def permute(self, dims):
        dims = tuple(dims)
        if sorted(dims) != list(range(self.ndim)):
            raise ValueError(f"permute dims {dims} is not a permutation of {self.ndim} dims")
        if self.buffer.on_chip and dims[0] != 0:
            raise NkiValidationError(f"permute{dims}: an on-chip view cannot move the partition dim (dim 0); "
                                     "use nc_transpose / dma_transpose to move data across partitions")
        return self._with([self.shape[d] for d in dims], [self.strides[d] for d in dims], self.offset)

    def broadcast(self, dim, size):
        if self.shape[dim] != 1:
            raise ValueError(f"broadcast(dim={dim}): dim has size {self.shape[dim]}, must be 1")
        if self.buffer.on_chip and dim == 0:
            raise NkiValidationError("broadcast(dim=0): cannot broadcast across partitions")
        shape, strides = list(self.shape), list(self.strides)
        shape[dim], strides[dim] = int(size), 0
        return self._with(shape, strides, self.offset)

    def expand_dim(self, dim):
        if self.buffer.on_chip and dim == 0:
            raise NkiValidationError("expand_dim(0): the partition dim of an on-chip tensor cannot move")
        shape, strides = list(self.shape), list(self.strides)
        shape.insert(dim, 1)
        strides.insert(dim, 0)
        return self._with(shape, strides, self.offset)

    def squeeze_dim(self, dim):
        if self.shape[dim] != 1:
            raise ValueError(f"squeeze_dim({dim}): dim has size {self.shape[dim]}, must be 1")
        if self.buffer.on_chip and (dim == 0 or self.ndim <= 2):
            raise NkiValidationError(f"squeeze_dim({dim}): on-chip tensors keep the partition dim and stay >= 2-D")
        shape, strides = list(self.shape), list(self.strides)
        del shape[dim], strides[dim]
        return self._with(shape, strides, self.offset)

    def reshape_dim(self, dim, shape):
        shape = [int(x) for x in shape]
        if math.prod(shape) != self.shape[dim]:
            raise ValueError(f"reshape_dim({dim}, {shape}): sizes multiply to {math.prod(shape)}, "
                             f"dim has {self.shape[dim]}")
        if self.buffer.on_chip and dim == 0 and len(shape) != 1:
            raise NkiValidationError("reshape_dim(0): the partition dim cannot be split")
        inner = [self.strides[dim]]
        for n in reversed(shape[1:]):
            inner.insert(0, inner[0] * n)
        return self._with(self.shape[:dim] + tuple(shape) + self.shape[dim + 1:],
                          self.strides[:dim] + tuple(inner) + self.strides[dim + 1:], self.offset)

    def flatten_dims(self, start_dim, end_dim):
        s, e = start_dim % self.ndim, end_dim % self.ndim
        if self.buffer.on_chip and s == 0 and e > 0:
            raise NkiValidationError("flatten_dims: the partition dim cannot be merged with free dims")
        for d in range(s, e):
            if self.strides[d] != self.strides[d + 1] * self.shape[d + 1]:
                raise ValueError(f"flatten_dims({start_dim}, {end_dim}): dims {d} and {d + 1} are not contiguous")
        n = math.prod(self.shape[s:e + 1])
        return self._with(self.shape[:s] + (n,) + self.shape[e + 1:],
                          self.strides[:s] + (self.strides[e],) + self.strides[e + 1:], self.offset)

    def reshape(self, shape):
        shape = [int(x) for x in (shape if isinstance(shape, (tuple, list)) else (shape,))]
        if shape.count(-1) == 1:
            known = math.prod([x for x in shape if x != -1])
            shape[shape.index(-1)] = self.size // known if known else 0
        if math.prod(shape) != self.size:
            raise ValueError(f"reshape {self.shape} -> {tuple(shape)} changes the element count "
                             f"({self.size} vs {math.prod(shape)})")
        if self.buffer.on_chip:
            if shape[0] != self.shape[0]:
                raise NkiValidationError(f"reshape {self.shape} -> {tuple(shape)}: an on-chip reshape must keep the "
                                         "partition dim")
            if not self.is_contiguous():
                raise ValueError(f"reshape of non-contiguous view {self.shape} strides {self.strides}")
            free = [1]
            for n in reversed(shape[1:]):
                free.insert(0, free[0] * n)
            return self._with(shape, [self.strides[0]] + free[1:], self.offset)
        if not self.is_contiguous():
            raise ValueError(f"reshape of non-contiguous view {self.shape} strides {self.strides}")
        st = [1]
        for n in reversed(shape[1:]):
            st.insert(0, st[0] * n)
        return self._with(shape, st, self.offset)

    def rearrange(self, src_pattern, dst_pattern, fixed_sizes=None):
        """einops-style view: `t.rearrange('p (a b)', 'p b a', {'a': 4})`."""
        src = _parse_pattern(src_pattern)
        dst = _parse_pattern(dst_pattern)
        sizes = dict(fixed_sizes or {})
        if len(src) != self.ndim:
            raise ValueError(f"rearrange: pattern {src_pattern!r} has {len(src)} dims, tensor has {self.ndim}")
        v, names = self, []
        for d in reversed(range(len(src))):
            group = src[d]
            if len(group) > 1:
                unknown = [g for g in group if g not in sizes]
                known = math.prod([sizes[g] for g in group if g in sizes])
                if len(unknown) > 1:
                    raise ValueError(f"rearrange: sizes of {unknown} needed in fixed_sizes")
                if unknown:
                    sizes[unknown[0]] = v.shape[d] // known
                v = v.reshape_dim(d, [sizes[g] for g in group])
            names = list(group) + names
        order = [names.index(g) for group in dst for g in group]
        v = v.permute(order)
        d = 0
        for group in dst:
            if len(group) > 1:
                v = v.flatten_dims(d, d + len(group) - 1)
            d += 1
        return v

    def vector_select(self, dim, vector_offset):
        if dim != 0:
            raise NkiValidationError(f"vector_select(dim={dim}): dim must be 0 (C31)")
        if self.buffer.on_chip:
            raise NkiValidationError(f"vector_select: only HBM tensors can be vector-selected; '{self.name}' is in "
                                     f"{self.buffer.name} (C31)")
        if self.gather is not None:
            raise NkiValidationError("vector_select: the view is already indirect; only one dynamic select per "
                                     "tensor (C31)")
        v = self.ap([[self.strides[0], vector_offset.shape[0]]] + [[s, n] for s, n in
                                                                   zip(self.strides[1:], self.shape[1:])],
                    offset=self.offset, vector_offset=vector_offset)
        v._regs = self._regs
        return v

    def view(self, dtype):
        d = dt.as_dtype(dtype)
        if d is self.dtype:
            return self
        if self.gather is not None:
            raise NkiValidationError(f"view({d.name}): not supported on an indirect (vector-selected) view (C31)")
        if self.strides and self.strides[-1] != 1 and self.shape[-1] != 1:
            raise NkiValidationError(f"view({d.name}): the last dim of the tensor must be contiguous")
        num, den = self.dtype.itemsize, d.itemsize
        last = self.shape[-1] * num
        if last % den or (self.offset * num) % den or any((s * num) % den for s in self.strides[:-1]):
            raise NkiValidationError(f"view({d.name}): last dim of {self.shape[-1]} x {num} B is not a multiple "
                                     f"of {den} B, or the view is not {den}-byte aligned")
        self.alloc.flat(d)
        return NkiTensor(self.alloc, self.shape[:-1] + (last // den,),
                         tuple(s * num // den for s in self.strides[:-1]) + (1,), self.offset * num // den, d,
                         None, self._regs)

    reinterpret_cast = view

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        """Access pattern over the storage: loop nest reading flat[offset + sum(i_k * s_k)] (offset=None: view's)."""
        if scalar_offset is not None and vector_offset is not None:
            raise NkiValidationError(".ap(): vector_offset and scalar_offset are mutually exclusive; pass one "
                                     "(C24)")
        base = self.alloc
        d = dt.as_dtype(dtype) if dtype is not None else base.dtype
        pattern = [[int(s), int(n)] for s, n in pattern]
        if base.buffer.on_chip:
            # Strides count elements of the access dtype: with dtype= a partition spans free*itemsize/new_itemsize.
            free_bytes = math.prod(base.shape[1:]) * base.dtype.itemsize
            free = free_bytes // d.itemsize if free_bytes % d.itemsize == 0 else free_bytes / d.itemsize
            if pattern[0][0] != free:
                # AWS's AP deep dive ("Composition and .ap on a view"): .ap() interprets pattern and offset against
                # the storage, ignoring the shape/strides/offset of the view it is called on -- so a step equal to a
                # narrower view's width is still a step over storage rows, and says so.
                hint = ""
                if tuple(self.shape) != tuple(base.shape) and pattern[0][0] == math.prod(self.shape[1:]):
                    hint = (f"; {pattern[0][0]} is the width of the view .ap() was called on, but .ap() addresses "
                            f"the storage (row of {free}), not the view")
                raise NkiValidationError(
                    f".ap() on on-chip tensor '{base.name}': the partition stride {pattern[0][0]} must equal the "
                    f"tensor's free size {free} (C14){hint}"
                )
            if len(pattern) - 1 > 4:
                raise NkiValidationError(f".ap(): {len(pattern) - 1} free-dim levels exceed the hardware's 4 (C14)")
        regs = None
        if offset is not None:
            off = int(offset)        # an explicit offset counts from the start of the storage (AWS's AP deep dive)
        else:
            # AWS 0.7 (NkiTensor.ap docstring; language guide, "Low-level raw access pattern"): offset=None inherits
            # the current view's storage offset, converted to elements of the access dtype.
            view_bytes = self.offset * self.dtype.itemsize
            if view_bytes % d.itemsize:
                raise NkiValidationError(f".ap(dtype={d.name}): the view's storage offset of {view_bytes} B is not a "
                                         f"multiple of the {d.name} element size; pass offset= explicitly")
            off = view_bytes // d.itemsize
            regs = self._regs        # a register-addressed view keeps its register dependency
        # AWS: indirect_dim is the "dimension in self.shape whose stride scales the indirect scalar/vector offset" --
        # the tensor .ap() is called on, which may be a reshape of the allocation (TensorView exposes a stride the
        # allocation lacks by reshaping it), in units of the access dtype.
        if scalar_offset is not None or vector_offset is not None:
            if not 0 <= indirect_dim < self.ndim:
                raise NkiValidationError(f".ap(indirect_dim={indirect_dim}): the tensor has {self.ndim} dims")
            unit = self.strides[indirect_dim] * self.dtype.itemsize
            if unit % d.itemsize:
                raise NkiValidationError(f".ap(indirect_dim={indirect_dim}): stride of {unit} B is not a multiple of "
                                         f"the {d.name} element size")
            unit //= d.itemsize
        if scalar_offset is not None:
            _check_offset_width(base, scalar_offset, ".ap(scalar_offset=...)")
            off += scalar_value(scalar_offset, ".ap scalar_offset") * unit
            if _dynamic(scalar_offset) is not None:
                regs = (regs or ()) + (scalar_offset,)
        shape = [n for _, n in pattern]
        strides = [s for s, _ in pattern]
        if d is not base.dtype:
            base.flat(d)
        indirect = None
        if vector_offset is not None:
            if indirect_dim != 0:
                raise NkiValidationError(f".ap(vector_offset=...): indirect_dim must be 0, got {indirect_dim}")
            # one index per partition: (P, 1), or (P, 1, 1) as an .ap() column of an index tile (the library's
            # router_topk scatter passes `.ap([[k, P], [1, 1], [1, 1]])`)
            if not isinstance(vector_offset, NkiTensor) or math.prod(vector_offset.shape[1:]) != 1:
                raise NkiValidationError(".ap(vector_offset=...) must be a (P, 1) tensor of row indices (one index per "
                                         f"partition), got shape {getattr(vector_offset, 'shape', None)}")
            indirect = Indirect(vector_offset, unit, self.shape[indirect_dim])
            strides[0] = 0
        return NkiTensor(base, shape, strides, off, d, indirect, regs)

    def indirect(self, index, num_elem=None):
        raise NkiValidationError(".indirect() tensor indirection (Trn3) is not supported by nkisim yet")

    def is_indirect(self):
        return self.gather is not None

    def is_contiguous(self):
        expect = 1
        start = 1 if self.buffer.on_chip else 0
        for n, s in zip(reversed(self.shape[start:]), reversed(self.strides[start:])):
            if n != 1 and s != expect:
                return False
            expect *= n
        return True

    def get_pattern(self):
        return [[s, n] for s, n in zip(self.strides, self.shape)]

    def _no_indirect(self, what):
        if self.gather is not None:
            raise NkiValidationError(f"{what} of an indirect (vector_offset) view is not supported")


def _slice_bounds(k, n, d, t):
    if isinstance(k, DynSlice):
        start = scalar_value(k.start, "nl.ds start")
        size = int(k.size)
        if start < 0 or size < 0 or start + size > n:
            raise IndexError(f"nl.ds({start}, {size}) is out of range for dim {d} of size {n} (tensor '{t.name}')")
        return start, size, 1
    step = 1 if k.step is None else int(k.step)
    if step == 0:
        raise IndexError("slice step cannot be zero")
    if isinstance(k.start, VirtualRegister) or isinstance(k.stop, VirtualRegister):
        # A slice bounded by device values (NKI 0.7 NkiScalars, `t[r:r + 128]`): the size must still be known while
        # tracing, i.e. stop = start + a constant (tracked by NkiScalar.affine). Otherwise use nl.ds(start, size).
        a, b = getattr(k.start, "affine", None), getattr(k.stop, "affine", None)
        if a is None or b is None or a[0] is not b[0] or step != 1:
            raise IndexError(f"slice {k.start!r}:{k.stop!r} on dim {d} of tensor '{t.name}' has a size that is not "
                             "known while the kernel is traced; a device-value slice needs stop = start + constant "
                             "(t[r:r + 128]) and step 1, or use nl.ds(start, size)")
        start, stop = scalar_value(k.start, "slice start"), scalar_value(k.stop, "slice stop")
        if not 0 <= start <= stop <= n:
            raise IndexError(f"slice [{start}:{stop}] (device values) is out of range for dim {d} of size {n} "
                             f"(tensor '{t.name}')")
        return start, stop - start, 1
    for name, v in (("start", k.start), ("stop", k.stop)):
        if v is not None and not isinstance(v, (int, np.integer)):
            raise IndexError(f"slice {name} must be a compile-time int (use nl.ds for dynamic starts), got {v!r}")
        if v is not None and not -n <= int(v) <= n:
            raise IndexError(f"slice {name}={v} is out of range for dim {d} of size {n} (tensor '{t.name}')")
    start, stop, step = slice(k.start, k.stop, step).indices(n)
    size = max(0, -(-(stop - start) // step)) if step > 0 else max(0, -(-(start - stop) // -step))
    return start, size, step


def _parse_pattern(p):
    groups, cur, depth = [], None, 0
    for tok in p.replace("(", " ( ").replace(")", " ) ").split():
        if tok == "(":
            cur, depth = [], depth + 1
        elif tok == ")":
            groups.append(tuple(cur))
            cur, depth = None, depth - 1
        elif cur is not None:
            cur.append(tok)
        else:
            groups.append((tok,))
    return groups


# ---- element access used by the ISA implementations --------------------------------------------------------

def np_view(t: NkiTensor) -> np.ndarray:
    """A NumPy view (no copy) of a strided tensor, in its storage dtype."""
    v = t._npv
    if v is not None:
        return v
    flat = t.alloc.flat(t.dtype)
    isz = flat.itemsize
    try:
        v = t._npv = np.ndarray(t.shape, dtype=flat.dtype, buffer=flat, offset=t.offset * isz,
                          strides=tuple([s * isz for s in t.strides]))
        return v
    except (ValueError, TypeError) as e:
        raise NkiValidationError(f"view of '{t.name}' shape {t.shape} strides {t.strides} offset {t.offset} falls "
                                 f"outside its allocation of {flat.size} elements") from e


def _indirect_addresses(t: NkiTensor, op: str, oob_mode_skip: bool):
    ind = t.gather
    idx = np.asarray(read(ind.index)).reshape(-1).astype(np.int64)
    if idx.shape[0] != t.shape[0]:
        raise NkiValidationError(f"{op}: vector_offset has {idx.shape[0]} indices, the access pattern "
                                 f"{t.shape[0]} partitions")
    valid = (idx >= 0) & (idx < ind.rows)
    if not oob_mode_skip and not valid.all():
        bad = idx[~valid][0]
        raise NkiValidationError(f"{op}: indirect index {bad} is out of bounds for '{t.name}' with {ind.rows} rows "
                                 "(oob_mode=error)")
    grid = np.zeros(t.shape[1:], dtype=np.int64) + t.offset
    for axis, (n, s) in enumerate(zip(t.shape[1:], t.strides[1:])):
        shp = [1] * (t.ndim - 1)
        shp[axis] = n
        grid = grid + (np.arange(n, dtype=np.int64) * s).reshape(shp)
    addrs = idx.reshape((-1,) + (1,) * (t.ndim - 1)) * ind.row_elems + grid
    return addrs, valid


def _strided_addresses(t: NkiTensor) -> np.ndarray:
    """Flat element address of every element of a (non-indirect) view: offset + sum(i_k * stride_k)."""
    addrs = np.full(t.shape, t.offset, dtype=np.int64)
    for axis, (n, s) in enumerate(zip(t.shape, t.strides)):
        shp = [1] * t.ndim
        shp[axis] = n
        addrs = addrs + (np.arange(n, dtype=np.int64) * s).reshape(shp)
    return addrs


def strided_valid(t: NkiTensor) -> np.ndarray | None:
    """Element mask of a view whose dynamic start address puts part of it outside its allocation, else None.

    AWS (nisa.dma_copy): with a dynamic start address "out-of-bound address checking is turned on automatically";
    oob_mode=skip silently skips the out-of-bounds accesses, so only the in-bounds elements move.
    """
    if t.gather is not None:
        return None
    size = t.alloc.flat(t.dtype).size
    addrs = _strided_addresses(t)
    valid = (addrs >= 0) & (addrs < size)
    return None if valid.all() else valid


def read(t: NkiTensor, op: str = "read", oob_skip: bool = False):
    """Values of a tensor in storage dtype (a view when strided; a gathered copy when indirect).

    With oob_skip, out-of-bounds elements of a strided view read as 0 (callers keep their destination there)."""
    if t.gather is None:
        if oob_skip and (valid := strided_valid(t)) is not None:
            flat = t.alloc.flat(t.dtype)
            return np.where(valid, flat[np.where(valid, _strided_addresses(t), 0)], 0).astype(flat.dtype)
        return np_view(t)
    flat = t.alloc.flat(t.dtype)
    addrs, valid = _indirect_addresses(t, op, oob_skip)
    return flat[np.where(valid.reshape((-1,) + (1,) * (t.ndim - 1)), addrs, 0)]


def indirect_valid_rows(t: NkiTensor, op: str):
    """Which partitions of an indirect view address an in-bounds row (for oob_mode=skip)."""
    return _indirect_addresses(t, op, True)[1]


def write(t: NkiTensor, values, op: str = "write", oob_skip: bool = False):
    """Store values (already cast to t's storage dtype, broadcastable to t.shape) into the tensor."""
    alloc = t.alloc
    alloc.written = True
    if t.gather is None:
        if oob_skip and (valid := strided_valid(t)) is not None:
            alloc.flat(t.dtype)[_strided_addresses(t)[valid]] = np.broadcast_to(values, t.shape)[valid]
            return
        np_view(t)[...] = values
        return
    flat = alloc.flat(t.dtype)
    addrs, valid = _indirect_addresses(t, op, oob_skip)
    vals = np.broadcast_to(values, t.shape)
    flat[addrs[valid]] = vals[valid]
