"""NKI 0.7 tile and block grids: `nl.tiles`, `nl.blocks`, `nl.alloc_tiles`, `nl.alloc_blocks`, `nl.NkiGrid`,
`nl.NkiTileGrid`, `nl.NkiBlockGrid` (AWS's nki.language pages, latest / v2.33).

A grid is a view that addresses a tensor in tile (or block) coordinates. What the pages fix, and this module does:
- `tile_shape` (>= 2 dims) applies to the trailing dims of the element extent; dims before it stay untiled and are
  indexed one slab (one element) at a time;
- `shape` counts tiles (blocks); boundary tiles are kept and clamped to the exact extent (`element_shape`,
  `is_remainder`);
- integer indexing consumes a coordinate but keeps a grid; slices with a positive step select cells;
- `data` is the one NkiTensor operand of the whole selection when one view can express it
  (`is_data_representable`), else an error;
- creating or indexing a grid allocates nothing and emits no instruction;
- `blocks` groups `block_shape` tiles per tiled dim; `tiles(block_grid)` exposes the tiles of the selected blocks;
- `alloc_tiles` / `alloc_blocks` own one allocation: in HBM the compact logical extent; in SBUF / PSUM a "dense
  rank-two capacity layout": `tile_shape[0]` partitions, every tile slot side by side along the free dim in
  row-major tile order, each slot the nominal (unclamped) tile size.
What the pages leave open (nkisim's choice, documented in DESIGN.md): the physical slot order of the capacity layout
(row-major over untiled slabs then tiles), `data` of a capacity-layout selection (one partition-tile row, slots
consecutive, only the last one clamped, rank-2 tiles; or any single tile), and `data` of a view over an existing
tensor (consecutive cells along every dim). Other selections report `is_data_representable == False`.
"""

import math

from .errors import NkiValidationError
from .memory import check_buffer
from .tensor import NkiTensor


def _exact_ints(name, value, min_rank=1):
    if not isinstance(value, tuple) or not all(type(v) is int for v in value):
        raise TypeError(f"{name}={value!r} must be a tuple of exact Python ints")
    if len(value) < min_rank:
        raise ValueError(f"{name}={value} needs at least {min_rank} dims")
    if any(v <= 0 for v in value):
        raise ValueError(f"{name}={value} has a nonpositive entry")
    return value


class _Store:
    """Where the elements live: a view layout over an NkiTensor of the element extent, or the SBUF/PSUM capacity
    layout of alloc_tiles / alloc_blocks (`backing` is [tile_shape[0], slots * prod(tile_shape[1:])])."""

    def __init__(self, element_shape, tile_shape, tensor=None, backing=None):
        self.element_shape = tuple(element_shape)
        self.tile_shape = tuple(tile_shape)
        self.tensor = tensor
        self.backing = backing
        self.prefix = len(element_shape) - len(tile_shape)
        self.counts = tuple(-(-e // t) for e, t in zip(element_shape[self.prefix:], tile_shape))

    def extent(self, tdim, tile):
        """Clamped element extent of tile `tile` along tiled dim `tdim`."""
        n, t = self.element_shape[self.prefix + tdim], self.tile_shape[tdim]
        return min(t, n - tile * t)

    def slot(self, prefix_idx, tile_idx):
        """Row-major slot of one tile in the capacity layout (untiled slabs first, then tiles)."""
        k = 0
        for i, n in zip(prefix_idx, self.element_shape[:self.prefix]):
            k = k * n + i
        for i, n in zip(tile_idx, self.counts):
            k = k * n + i
        return k


class NkiGrid:
    """Base of tile and block grids: a selection of cells over a `_Store`.

    `units[d]` lists the selected cells along global dim d (untiled prefix dims first, then tiled dims); a cell is a
    tuple of tile indices (one tile for tile grids, `block_shape[d]` tiles for block grids, one slab for prefix dims).
    `consumed[d]` marks dims fixed by integer indexing (not counted in `shape`)."""

    def __init__(self, store, units, consumed):
        self._store = store
        self._units = tuple(tuple(u) for u in units)
        self._consumed = tuple(consumed)

    # ---- attributes -----------------------------------------------------------------------------------------
    @property
    def buffer(self):
        return self._base().buffer

    @property
    def dtype(self):
        return self._base().dtype

    @property
    def tile_shape(self):
        return self._store.tile_shape

    @property
    def shape(self):
        return tuple(len(u) for u, c in zip(self._units, self._consumed) if not c)

    def _tiles(self, d):
        return [t for cell in self._units[d] for t in cell]

    @property
    def element_shape(self):
        st, out = self._store, []
        for d in range(len(self._units)):
            tiles = self._tiles(d)
            out.append(len(tiles) if d < st.prefix else sum(st.extent(d - st.prefix, t) for t in tiles))
        return tuple(out)

    @property
    def is_remainder(self):
        st = self._store
        return any(st.extent(d - st.prefix, t) < st.tile_shape[d - st.prefix]
                   for d in range(st.prefix, len(self._units)) for t in self._tiles(d))

    @property
    def index_step_elements(self):
        """Source elements per step of each (unconsumed) grid coordinate; None where the step is not uniform."""
        st, out = self._store, []
        for d, (cells, c) in enumerate(zip(self._units, self._consumed)):
            if c:
                continue
            firsts = [cell[0] for cell in cells]
            steps = {b - a for a, b in zip(firsts, firsts[1:])}
            step = steps.pop() if len(steps) == 1 else (len(cells[0]) if len(cells) == 1 else None)
            unit = 1 if d < st.prefix else st.tile_shape[d - st.prefix]
            out.append(None if step is None else step * unit)
        return tuple(out)

    @property
    def is_data_representable(self):
        return self._data_view() is not None

    @property
    def data(self):
        view = self._data_view()
        if view is None:
            raise ValueError(f"{type(self).__name__}.data: the selection {self.element_shape} cannot be expressed as "
                             "one tensor view (is_data_representable is False); index single tiles and use their "
                             ".data, or copy the cells one by one")
        return view

    # ---- data views -------------------------------------------------------------------------------------------
    def _base(self):
        return self._store.tensor if self._store.tensor is not None else self._store.backing

    def _data_view(self):
        st = self._store
        ranges = []
        for d in range(len(self._units)):
            tiles = self._tiles(d)
            if any(b != a + 1 for a, b in zip(tiles, tiles[1:])):
                return None           # gaps between the selected cells
            ranges.append(tiles)
        if st.tensor is not None:     # a view over the element extent: one slice per dim
            key = []
            for d, tiles in enumerate(ranges):
                if d < st.prefix:
                    key.append(slice(tiles[0], tiles[-1] + 1))
                else:
                    t = st.tile_shape[d - st.prefix]
                    key.append(slice(tiles[0] * t, tiles[0] * t + self.element_shape[d]))
            return st.tensor[tuple(key)]
        return self._capacity_view(ranges)

    def _capacity_view(self, ranges):
        st = self._store
        tiled = ranges[st.prefix:]
        if any(len(r) != 1 for r in ranges[:st.prefix]) or len(tiled[0]) != 1:
            return None               # several slabs, or several partition tiles: no single on-chip view
        if any(len(r) != 1 for r in tiled[1:-1]):
            return None
        free_tile = math.prod(st.tile_shape[1:])
        slots = [st.slot([r[0] for r in ranges[:st.prefix]], [r[0] for r in tiled[:-1]] + [t]) for t in tiled[-1]]
        p_ext = st.extent(0, tiled[0][0])
        backing = st.backing
        row = backing.strides[0]
        offset = backing.offset + slots[0] * free_tile
        if len(st.tile_shape) == 2:
            last = [st.extent(1, t) for t in tiled[-1]]
            if any(e != st.tile_shape[1] for e in last[:-1]):
                return None           # a clamped tile in the middle of the run
            return backing.ap([[row, p_ext], [1, sum(last)]], offset=offset)
        if len(tiled[-1]) != 1:
            return None
        inner = [st.extent(k, tiled[k][0]) for k in range(1, len(st.tile_shape))]
        strides = [math.prod(st.tile_shape[k + 1:]) for k in range(1, len(st.tile_shape))]
        return backing.ap([[row, p_ext]] + [[s, n] for s, n in zip(strides, inner)], offset=offset)

    # ---- indexing -------------------------------------------------------------------------------------------
    def __getitem__(self, key):
        if not isinstance(key, tuple):
            key = (key,)
        free = [d for d, c in enumerate(self._consumed) if not c]
        if len(key) > len(free):
            raise IndexError(f"too many indices for a grid of shape {self.shape}: {len(key)}")
        units, consumed = list(self._units), list(self._consumed)
        for d, k in zip(free, key):
            if isinstance(k, slice):
                if k.step is not None and k.step <= 0:
                    raise ValueError(f"grid slices need a positive step, got {k.step}")
                units[d] = units[d][k]
                if not units[d]:
                    raise IndexError(f"grid slice {k} selects no cell of dim {d} (size {len(self._units[d])})")
            elif type(k) is int:
                n = len(units[d])
                if not -n <= k < n:
                    raise IndexError(f"grid index {k} is out of range for a dim of {n} cells")
                units[d] = (units[d][k],)
                consumed[d] = True
            else:
                raise TypeError(f"grid indices are Python ints or slices, got {type(k).__name__} (grid coordinates are "
                                "compile-time; address device values through .data with nl.ds / .ap)")
        return type(self)._like(self, units, consumed)

    @classmethod
    def _like(cls, other, units, consumed):
        g = cls.__new__(cls)
        NkiGrid.__init__(g, other._store, units, consumed)
        if hasattr(other, "_block_shape"):
            g._block_shape = other._block_shape
        return g

    def __repr__(self):
        return (f"{type(self).__name__}(shape={self.shape}, tile_shape={self.tile_shape}, "
                f"element_shape={self.element_shape}, buffer={self.buffer!r})")


class NkiTileGrid(NkiGrid):
    """A tensor view navigated in tile coordinates (from nl.tiles, nl.alloc_tiles, or tiles(block_grid))."""


class NkiBlockGrid(NkiGrid):
    """A tensor view navigated in block coordinates: each cell groups `block_shape` tiles per tiled dim."""

    @property
    def block_shape(self):
        return self._block_shape


def _tile_units(store):
    pre = [tuple((i,) for i in range(n)) for n in store.element_shape[:store.prefix]]
    return pre + [tuple((t,) for t in range(n)) for n in store.counts]


def _group(units, prefix, block_shape):
    out = list(units[:prefix])
    for d, b in enumerate(block_shape):
        tiles = [t for cell in units[prefix + d] for t in cell]
        out.append(tuple(tuple(tiles[i:i + b]) for i in range(0, len(tiles), b)))
    return out


def _store_for(tensor, tile_shape):
    tile_shape = _exact_ints("tile_shape", tile_shape, 2)
    if len(tile_shape) > tensor.ndim:
        raise ValueError(f"tile_shape={tile_shape} has more dims than the tensor {tensor.shape}")
    if tensor.buffer.on_chip and len(tile_shape) != tensor.ndim:
        raise ValueError(f"tile_shape={tile_shape}: an on-chip tensor {tensor.shape} has no untiled dims (untiled "
                         "leading dims exist only in HBM)")
    return _Store(tensor.shape, tile_shape, tensor=tensor)


def tiles(source, *, tile_shape=None):
    """A tile grid over a tensor, or the tiles of a (tile or block) grid's selection."""
    if isinstance(source, NkiTensor):
        if tile_shape is None:
            raise TypeError("nl.tiles(tensor): tile_shape is required for a tensor source")
        st = _store_for(source, tile_shape)
        return NkiTileGrid(st, _tile_units(st), [False] * len(st.element_shape))
    if isinstance(source, NkiGrid):
        if tile_shape is not None and tuple(tile_shape) != source.tile_shape:
            return tiles(source.data, tile_shape=tile_shape)   # re-tiling works on the selection's one operand
        units = [tuple((t,) for cell in u for t in cell) for u in source._units]
        consumed = source._consumed
        if isinstance(source, NkiBlockGrid):
            # block -> tile transition: the interior tiles of the selected block(s) become coordinates again
            prefix = source._store.prefix
            consumed = consumed[:prefix] + (False,) * (len(consumed) - prefix)
        return NkiTileGrid(source._store, units, consumed)
    raise TypeError(f"nl.tiles: source must be an NkiTensor, NkiTileGrid or NkiBlockGrid, got {type(source).__name__}")


def blocks(source, *, tile_shape=None, block_shape):
    """A block grid: `block_shape` tiles per block along every tiled dim (partial final blocks kept)."""
    grid = tiles(source, tile_shape=tile_shape)
    block_shape = _exact_ints("block_shape", block_shape)
    if len(block_shape) != len(grid.tile_shape):
        raise ValueError(f"block_shape={block_shape} must have the rank of tile_shape={grid.tile_shape}")
    g = NkiBlockGrid(grid._store, _group(grid._units, grid._store.prefix, block_shape), grid._consumed)
    g._block_shape = block_shape
    return g


def _allocate(tile_shape, element_shape, buffer, dtype, address, name):
    from .language import ndarray
    tile_shape = _exact_ints("tile_shape", tile_shape, 2)
    element_shape = _exact_ints("element_shape", element_shape)
    if len(tile_shape) > len(element_shape):
        raise ValueError(f"tile_shape={tile_shape} has a greater rank than element_shape={element_shape}")
    try:
        buf = check_buffer(buffer)
    except NkiValidationError as e:
        raise TypeError(f"buffer: {e}") from None
    if not buf.on_chip:
        t = ndarray(element_shape, dtype, buffer=buf, name=name, address=address)
        return _Store(element_shape, tile_shape, tensor=t)
    if len(tile_shape) != len(element_shape):
        raise ValueError(f"element_shape={element_shape}: {buf.name} tile grids have no untiled leading dims")
    if tile_shape[0] > 128:
        raise ValueError(f"tile_shape[0]={tile_shape[0]} exceeds the 128 partitions of {buf.name}")
    st = _Store(element_shape, tile_shape)
    slots = math.prod(st.counts)
    st.backing = ndarray((tile_shape[0], slots * math.prod(tile_shape[1:])), dtype, buffer=buf, name=name,
                         address=address)
    return st


def alloc_tiles(*, tile_shape, element_shape, buffer, dtype, address=None, name=""):
    """New uninitialised storage organised as a grid of tiles (HBM: compact extent; SBUF/PSUM: capacity layout)."""
    st = _allocate(tile_shape, element_shape, buffer, dtype, address, name)
    return NkiTileGrid(st, _tile_units(st), [False] * len(st.element_shape))


def alloc_blocks(*, tile_shape, block_shape, element_shape, buffer, dtype, address=None, name=""):
    """alloc_tiles' geometry plus a block level above it (grouping does not change the physical tile order)."""
    return blocks(alloc_tiles(tile_shape=tile_shape, element_shape=element_shape, buffer=buffer, dtype=dtype,
                              address=address, name=name), block_shape=block_shape)


def empty_like_grid(grid, dtype, buffer, name="", address=None):
    """A new grid of `grid`'s geometry: the selected cells packed densely in fresh storage, the same tile shape,
    block grouping and navigation shape (dims consumed by integer indexing stay consumed)."""
    shape = grid.element_shape
    if isinstance(grid, NkiBlockGrid):
        fresh = alloc_blocks(tile_shape=grid.tile_shape, block_shape=grid.block_shape, element_shape=shape,
                             buffer=buffer, dtype=dtype, address=address, name=name)
    else:
        fresh = alloc_tiles(tile_shape=grid.tile_shape, element_shape=shape, buffer=buffer, dtype=dtype,
                            address=address, name=name)
    if any(grid._consumed):
        fresh = fresh[tuple(0 if c else slice(None) for c in grid._consumed)]
    return fresh
