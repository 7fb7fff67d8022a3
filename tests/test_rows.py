"""Storage rows from real vLLM 0.32 KVCacheConfig objects, and row-by-row loading.

The hybrid configs are produced by vLLM's own grouping and allocation code
(``get_kv_cache_groups`` + ``get_kv_cache_config_from_groups``) from real
``FullAttentionSpec`` / ``MambaSpec`` layer specs, in both a layer-outer (LBHNC) and a
block-outer (BLHNC) layout, so a change in how vLLM lays out hybrid caches breaks these
tests instead of silently breaking the dump rule.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)

from ucm_patch.connector.rows import RowLoader, RowMap
from ucm_patch.hooks.device import CpuDevice
from ucm_patch.hooks.device_choice import make_device


def attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def gdn(i: int) -> str:
    return f"model.layers.{i}.linear_attn"


def qwen3_next_like(num_layers: int, layout: str) -> KVCacheConfig:
    """Every 4th layer full attention, the rest GDN (Qwen3-Next's 3:1 pattern)."""
    specs: dict[str, Any] = {}
    for i in range(num_layers):
        if i % 4 == 3:
            specs[attn(i)] = FullAttentionSpec(
                block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
            )
        else:
            specs[gdn(i)] = MambaSpec(
                block_size=16, shapes=((3, 64), (4, 16, 16)), dtypes=(torch.bfloat16,) * 2
            )
    config = VllmConfig()
    config.cache_config.kv_cache_layout = layout
    groups = get_kv_cache_groups(config, specs)
    return get_kv_cache_config_from_groups(config, groups, 1 << 24)


def layer_name(i: int) -> str:
    return attn(i) if i % 4 == 3 else gdn(i)


def test_qwen3_next_layer_outer_layout_gives_one_row_per_4_layers() -> None:
    cfg = qwen3_next_like(48, "LBHNC")
    assert len(cfg.kv_cache_groups) == 4, "vLLM groups 12 attention + 3x12 GDN layers"
    rows = RowMap.from_kv_cache_config(cfg)
    assert len(rows) == 12
    for r, row in enumerate(rows.rows):
        assert row.layers == tuple(layer_name(i) for i in range(4 * r, 4 * r + 4))
        assert row.save_layer == attn(4 * r + 3)
    # Dump exactly once per row, at its last layer; never at the other three.
    dumps = [(name, rows.dump_row(name)) for name in map(layer_name, range(48))]
    assert [(n, r) for n, r in dumps if r >= 0] == [(attn(4 * r + 3), r) for r in range(12)]
    assert rows.row(gdn(5)) == 1
    with pytest.raises(ValueError, match=r"'model\.layers\.99\.mlp'"):
        rows.row("model.layers.99.mlp")


def test_block_outer_packed_layout_is_a_single_row() -> None:
    """BLHNC packs every group into one block: all layers alias, dump once at the end."""
    cfg = qwen3_next_like(8, "BLHNC")
    assert len(cfg.kv_cache_groups) == 2  # vLLM's packed grouping for mixed page sizes
    rows = RowMap.from_kv_cache_config(cfg)
    assert len(rows) == 1
    assert rows.rows[0].layers == tuple(layer_name(i) for i in range(8))
    assert rows.save_layers() == [attn(7)]


def test_uniform_model_has_one_row_per_layer() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    config = VllmConfig()
    for layout in ("LBHNC", "BLHNC"):
        config.cache_config.kv_cache_layout = layout
        names = [attn(i) for i in range(6)]
        groups = get_kv_cache_groups(config, dict.fromkeys(names, spec))
        cfg = get_kv_cache_config_from_groups(config, groups, 1 << 22)
        rows = RowMap.from_kv_cache_config(cfg)
        assert [row.layers for row in rows.rows] == [(n,) for n in names], layout


def test_hand_built_config_and_non_transfer_groups() -> None:
    """Real KVCacheConfig objects built directly; a non-transferable group is not dumped."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16)
    page = spec.page_size_bytes
    names_a = ["m.layers.0.attn", "m.layers.2.attn"]
    names_b = ["m.layers.1.attn", "m.layers.3.attn"]
    names_c = ["m.layers.4.replica"]
    cfg = KVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * 20, layers=names_a, layer_stride=page * 10, block_stride=page
            ),
            KVCacheTensor(
                size=page * 20, layers=names_b, layer_stride=page * 10, block_stride=page
            ),
            KVCacheTensor(
                size=page * 20, layers=names_c, layer_stride=page * 10, block_stride=page
            ),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(names_a, spec),
            KVCacheGroupSpec(names_b, spec),
            KVCacheGroupSpec(names_c, spec, enable_kv_transfer=False),
        ],
    )
    rows = RowMap.from_kv_cache_config(cfg)
    assert [row.layers for row in rows.rows] == [
        ("m.layers.0.attn", "m.layers.1.attn"),
        ("m.layers.2.attn", "m.layers.3.attn"),
    ]
    assert rows.dump_row("m.layers.4.replica") == -1
    everything = RowMap.from_kv_cache_config(cfg, transfer_only=False)
    assert everything.rows[0].layers == ("m.layers.0.attn", "m.layers.1.attn", "m.layers.4.replica")


def test_vllm_ascend_018_shared_by_shape() -> None:
    """vLLM-Ascend 0.18 (vLLM 0.18 era) KVCacheTensor(size, shared_by): stand-in objects,
    since that class shape no longer exists in the installed vLLM."""
    tensors = [
        types.SimpleNamespace(size=1, shared_by=[gdn(4), attn(7), gdn(5), gdn(6)]),
        types.SimpleNamespace(size=1, shared_by=[gdn(0), gdn(1), gdn(2), attn(3)]),
    ]
    groups = [types.SimpleNamespace(layer_names=[layer_name(i) for i in range(8)])]
    cfg = types.SimpleNamespace(kv_cache_tensors=tensors, kv_cache_groups=groups)
    rows = RowMap.from_kv_cache_config(cfg)
    assert [row.save_layer for row in rows.rows] == [attn(3), attn(7)]
    assert rows.row(gdn(5)) == 1


def test_bad_inputs_name_the_culprit() -> None:
    with pytest.raises(ValueError, match=r"'lm_head'.*layer_order"):
        RowMap([["lm_head"]])
    assert RowMap([["b", "a"]], layer_order=["a", "b"]).rows[0].layers == ("a", "b")
    with pytest.raises(ValueError, match="layer_order lacks"):
        RowMap([["a"]], layer_order=["b"])
    with pytest.raises(ValueError, match=r"'x\.1'.*rows 0 and 1"):
        RowMap([["x.1"], ["x.1", "x.2"]])
    cfg = qwen3_next_like(8, "LBHNC")
    cfg.kv_cache_tensors.pop()
    with pytest.raises(ValueError, match="in no kv_cache_tensors entry"):
        RowMap.from_kv_cache_config(cfg)
    with pytest.raises(ValueError, match="kv_cache_tensors\\[0\\]"):
        RowMap.from_kv_cache_config(
            types.SimpleNamespace(kv_cache_tensors=[object()], kv_cache_groups=[])
        )


# ---------------------------------------------------------------------------------------
# Row-by-row loading with prefetch
# ---------------------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.log: list[str] = []

    def submit(self, row: int) -> str:
        self.log.append(f"submit {row}")
        return f"h{row}"

    def wait(self, row: int, handle: str) -> None:
        assert handle == f"h{row}"
        self.log.append(f"wait {row}")


def loader_for(depth: int, rows: int = 5) -> tuple[RowLoader, Recorder, RowMap]:
    row_map = RowMap([[f"l.{2 * r}", f"l.{2 * r + 1}"] for r in range(rows)])
    rec = Recorder()
    return RowLoader(row_map, rec.submit, rec.wait, depth=depth), rec, row_map


def test_loader_prefetches_depth_rows_and_waits_only_at_the_target_layer() -> None:
    loader, rec, _ = loader_for(depth=2)
    loader.start()
    assert rec.log == ["submit 0", "submit 1"]
    loader.on_layer("l.0")  # row 0: wait, then keep 2 rows in flight
    assert rec.log[2:] == ["wait 0", "submit 2"]
    loader.on_layer("l.1")  # same row: already loaded, no wait
    loader.on_layer("l.0")  # MTP-style re-entry: no second wait
    assert rec.log[4:] == []
    loader.on_layer("l.2")
    loader.on_layer("l.4")
    loader.on_layer("l.6")
    loader.on_layer("l.8")
    assert rec.log[4:] == [
        "wait 1", "submit 3", "wait 2", "submit 4", "wait 3", "wait 4",
    ]  # fmt: skip
    loader.on_layer("not.a.kv.layer")
    loader.drain()
    assert rec.log.count("wait 4") == 1


def test_loader_depth_one_and_leftovers_are_drained_not_lost() -> None:
    loader, rec, _ = loader_for(depth=1, rows=3)
    loader.start()
    loader.on_layer("l.0")
    assert rec.log == ["submit 0", "wait 0", "submit 1"]
    # The step ends early (e.g. pipeline stage boundary): the next start() waits row 1.
    loader.start()
    assert rec.log[3:] == ["wait 1", "submit 0"]
    loader.on_layer("l.4")  # out of order: submitted on demand, then waited
    assert rec.log[5:] == ["submit 2", "wait 2"]
    with pytest.raises(ValueError, match="depth"):
        RowLoader(RowMap([["l.0"]]), rec.submit, rec.wait, depth=0)


def test_loader_failed_wait_is_not_retried() -> None:
    calls: list[int] = []

    def wait(row: int, handle: Any) -> None:
        calls.append(row)
        raise TimeoutError(f"row {row}")

    loader = RowLoader(RowMap([["l.0"], ["l.1"]]), lambda r: r, wait, depth=1)
    loader.start()
    with pytest.raises(TimeoutError):
        loader.on_layer("l.0")
    loader.on_layer("l.0")
    assert calls == [0]


def test_make_device_follows_vllm_platform() -> None:
    """vLLM's current_platform on this host is CPU, so the factory picks the CPU device."""
    assert type(make_device()) is CpuDevice
