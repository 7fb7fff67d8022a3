"""Layer -> storage row mapping for hybrid models, and row-by-row prefetched loading.

A *storage row* is a set of layers whose KV-cache pages alias the same bytes. vLLM's hybrid
KV-cache manager (Qwen3-Next: 12 full-attention + 36 GDN layers) lets one KV-cache group of
each kind share every backing tensor: "cache groups overlay each other, which is sound
because a block ID is owned by one group at a time" (``KVCacheTensor`` docstring, vLLM
0.32). With 4 groups of 12 layers, layer *i* of each group lands in the same bytes, so
there are 12 rows of 4 layers each.

Where the rows come from (:meth:`RowMap.from_kv_cache_config`):

* vLLM >= 0.32: ``KVCacheTensor(size, layers, layer_stride, block_stride, offset)``; layer
  ``layers[l]`` starts at ``offset + l * layer_stride`` in every tensor of the same
  allocation. Layers whose byte ranges ``[start, start + layer_stride)`` overlap belong to
  one row (connected components), which is right for layer-outer layouts (a layer owns a
  contiguous region) and block-outer ones (the ranges are positions inside one block).
* Older vLLM and vLLM-Ascend 0.18: ``KVCacheTensor(size, shared_by=[layer names])``: each
  tensor's ``shared_by`` is one row.

**Dump rule: once per row, at the row's last layer (in forward order).** Why: all layers of
a row write the same bytes (each into the blocks its group owns), so dumping at every layer
would copy the same row several times (4x on Qwen3-Next) — and dumping at an earlier layer
would miss the writes of the row's later layers. The last layer is the first point where
every writer of the row has run; on one stream, that layer's KV-ready event also covers
the earlier layers' writes. This is UCM's ``row_save_layer = max(layer id)`` rule (#984),
stated here because its review asked for it to be documented.

**Load rule:** :class:`RowLoader` submits ``depth`` rows ahead and, when the forward pass
reaches a layer, waits only for that layer's row (then tops the prefetch up again); layers
whose row is already loaded do not wait at all.

Forward order defaults to the layer index parsed from each name (all integers in the name,
compared as a tuple, e.g. ``model.layers.7.self_attn.attn`` -> (7,)); pass ``layer_order``
when names carry no index.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

_INT = re.compile(r"\d+")


@dataclass(frozen=True)
class StorageRow:
    """One storage row: its id and its layers in forward order."""

    index: int
    layers: tuple[str, ...]

    @property
    def save_layer(self) -> str:
        """The layer at which this row is dumped (the last one in forward order)."""
        return self.layers[-1]


class RowMap:
    """Layers grouped into storage rows, rows ordered by their first layer's position."""

    def __init__(self, rows: Iterable[Iterable[str]], layer_order: Sequence[str] | None = None):
        groups = [list(dict.fromkeys(r)) for r in rows]
        groups = [g for g in groups if g]
        seen: dict[str, int] = {}
        for gi, group in enumerate(groups):
            for layer in group:
                if layer in seen:
                    raise ValueError(
                        f"RowMap: layer {layer!r} appears in rows {seen[layer]} and {gi}"
                    )
                seen[layer] = gi
        position = _forward_positions(seen, layer_order)
        ordered = sorted(
            (sorted(group, key=position.__getitem__) for group in groups),
            key=lambda group: position[group[0]],
        )
        self.rows: tuple[StorageRow, ...] = tuple(
            StorageRow(i, tuple(group)) for i, group in enumerate(ordered)
        )
        self.row_of: dict[str, int] = {
            layer: row.index for row in self.rows for layer in row.layers
        }
        #: save layer -> its row (what :meth:`dump_row` looks up; a hot caller may bind it)
        self.save_row_of: dict[str, int] = {row.save_layer: row.index for row in self.rows}

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, layer_name: str) -> int:
        """The row of ``layer_name``; ValueError naming it when it has none."""
        try:
            return self.row_of[layer_name]
        except KeyError:
            raise ValueError(f"RowMap: layer {layer_name!r} is in no storage row") from None

    def dump_row(self, layer_name: str) -> int:
        """Row to dump after ``layer_name`` ran, or -1 when it is not a row's last layer.

        Hot path (once per layer per step): one dict lookup.
        """
        return self.save_row_of.get(layer_name, -1)

    def save_layers(self) -> list[str]:
        """Each row's dump layer, in row order."""
        return [row.save_layer for row in self.rows]

    @classmethod
    def from_kv_cache_config(
        cls,
        kv_cache_config: Any,
        layer_order: Sequence[str] | None = None,
        transfer_only: bool = True,
    ) -> RowMap:
        """Rows from a vLLM ``KVCacheConfig`` (see the module docstring for both shapes).

        ``transfer_only`` keeps layers of groups with ``enable_kv_transfer`` (vLLM 0.32;
        older groups lack the flag and are all kept): ephemeral replicas are not dumped.
        """
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        tensors = getattr(kv_cache_config, "kv_cache_tensors", None)
        if groups is None or tensors is None:
            raise ValueError(
                "RowMap.from_kv_cache_config: kv_cache_config needs kv_cache_groups and "
                f"kv_cache_tensors, got {type(kv_cache_config).__name__}"
            )
        grouped: set[str] = set()
        keep: set[str] = set()
        for group in groups:
            grouped.update(group.layer_names)
            if not transfer_only or getattr(group, "enable_kv_transfer", True):
                keep.update(group.layer_names)
        components = _alias_components(tensors)
        placed = {layer for comp in components for layer in comp}
        missing = sorted(grouped - placed)
        if missing:
            raise ValueError(
                "RowMap.from_kv_cache_config: layers in kv_cache_groups but in no "
                f"kv_cache_tensors entry: {missing[:5]}"
            )
        rows = [[layer for layer in comp if layer in keep] for comp in components]
        return cls(rows, layer_order)


class RowLoader:
    """Loads rows in forward order, ``depth`` rows in flight, waiting only when needed.

    ``submit(row) -> handle`` starts a row's load; ``wait(row, handle)`` blocks until it is
    done. Per step: :meth:`start` (from ``start_load_kv``), :meth:`on_layer` (from
    ``wait_for_layer_load``), :meth:`drain` at the end (``wait_for_save``) so no load is
    left running into the next step. A row is waited for at most once per step, so MTP
    layers that re-enter a loaded row cost one list lookup.
    """

    _IDLE, _SUBMITTED, _WAITED = 0, 1, 2

    def __init__(
        self,
        row_map: RowMap,
        submit: Callable[[int], Any],
        wait: Callable[[int, Any], None],
        depth: int = 2,
    ) -> None:
        if depth < 1:
            raise ValueError(f"RowLoader depth must be >= 1 (rows in flight), got depth={depth!r}")
        self.row_map = row_map
        self.depth = depth
        self._submit = submit
        self._wait = wait
        n = len(row_map)
        self._row_of = row_map.row_of
        self._state = bytearray(n)
        self._handles: list[Any] = [None] * n
        self._next = 0  # lowest row index never submitted this step

    def start(self) -> None:
        """Begin a step: finish leftovers of the previous one, then prefetch ``depth`` rows."""
        self.drain()
        self._state[:] = bytes(len(self._state))
        self._next = 0
        self._top_up(self.depth - 1)

    def on_layer(self, layer_name: str) -> None:
        """Before ``layer_name`` runs: make sure its row is loaded (waits only here)."""
        row = self._row_of.get(layer_name)
        if row is None:
            return
        state = self._state[row]
        if state == self._WAITED:
            return
        if state == self._IDLE:
            self._handles[row] = self._submit(row)
            self._state[row] = self._SUBMITTED
            if row >= self._next:
                self._next = row + 1
        handle = self._handles[row]
        self._handles[row] = None
        self._state[row] = self._WAITED  # set first: a failing wait is not retried
        self._wait(row, handle)
        self._top_up(row + self.depth)

    def drain(self) -> None:
        """Wait for every submitted, not yet waited row (end of step)."""
        for row, state in enumerate(self._state):
            if state == self._SUBMITTED:
                handle = self._handles[row]
                self._handles[row] = None
                self._state[row] = self._WAITED
                self._wait(row, handle)

    def _top_up(self, last_row: int) -> None:
        end = min(last_row, len(self._state) - 1)
        while self._next <= end:
            row = self._next
            self._next = row + 1
            if self._state[row] == self._IDLE:
                self._handles[row] = self._submit(row)
                self._state[row] = self._SUBMITTED


def _alias_components(tensors: Sequence[Any]) -> list[list[str]]:
    """Groups of layer names whose KV bytes alias, from either KVCacheTensor shape."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[rb] = ra

    spans: list[tuple[int, int, str]] = []
    for i, tensor in enumerate(tensors):
        shared_by = getattr(tensor, "shared_by", None)
        layers = getattr(tensor, "layers", None)
        if layers is not None:
            stride = tensor.layer_stride
            offset = getattr(tensor, "offset", 0)
            if stride <= 0:
                raise ValueError(
                    f"RowMap: kv_cache_tensors[{i}].layer_stride={stride!r} must be > 0"
                )
            for li, layer in enumerate(layers):
                parent.setdefault(layer, layer)
                spans.append((offset + li * stride, offset + (li + 1) * stride, layer))
        elif shared_by is not None:
            names = list(shared_by)
            for layer in names:
                parent.setdefault(layer, layer)
            for layer in names[1:]:
                union(names[0], layer)
        else:
            raise ValueError(
                f"RowMap: kv_cache_tensors[{i}] ({type(tensor).__name__}) has neither "
                "'layers' (vLLM >= 0.32) nor 'shared_by' (older vLLM)"
            )
    # Sweep the byte ranges: each range joins the component of every range it overlaps.
    spans.sort()
    reach_end = -1
    reach_layer = ""
    for start, end, layer in spans:
        if start < reach_end:
            union(reach_layer, layer)
        if end > reach_end:
            reach_end, reach_layer = end, layer
    comps: dict[str, list[str]] = {}
    for layer in parent:
        comps.setdefault(find(layer), []).append(layer)
    return list(comps.values())


def _forward_positions(
    layers: Iterable[str], layer_order: Sequence[str] | None
) -> dict[str, tuple[Any, ...]]:
    """Sort key per layer: its index in ``layer_order``, else the integers in its name."""
    if layer_order is not None:
        pos = {name: (i,) for i, name in enumerate(layer_order)}
        missing = [name for name in layers if name not in pos]
        if missing:
            raise ValueError(f"RowMap: layer_order lacks layers {missing[:5]}")
        return pos
    out: dict[str, tuple[Any, ...]] = {}
    for name in layers:
        ints = tuple(int(x) for x in _INT.findall(name))
        if not ints:
            raise ValueError(
                f"RowMap: cannot tell the forward position of layer {name!r} (no index in "
                "its name); pass layer_order"
            )
        out[name] = (ints, name)
    return out
