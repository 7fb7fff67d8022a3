"""Connector configuration, key layout and registration with vLLM (no engine).

A bad ``kv_connector_extra_config`` must stop the connector when vLLM builds it, with a
message naming the key and what is accepted; two models (or layouts) must never share
store keys; the plugin's registration must be idempotent and resolvable by vLLM's factory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    supports_hma,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)

from tests.support.connector_harness import kv_cache_config, vllm_config
from tests.support.fakes_store import FakeStore
from ucm_patch.connector import UCMPatchConnector, register_with_vllm
from ucm_patch.connector.config import (
    CHUNK_TOKENS,
    ConnectorConfigError,
    copy_threads,
    parse_connector_config,
)
from ucm_patch.connector.layout import KVLayout, LayoutError
from ucm_patch.connector.scheduler_side import choose_load_async


# -- configuration ------------------------------------------------------------------------
def test_defaults_use_a_local_store_in_the_user_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for empty in (None, {}):
        cfg = parse_connector_config(empty)
        assert cfg.store_kind == "local"
        assert cfg.store["local_path"] == str(tmp_path / "ucm_patch" / "kv")
        assert cfg.load_mode == "auto"
        assert cfg.load_workers == cfg.dump_workers == copy_threads()
        assert cfg.load_prefetch_rows == cfg.load_workers  # every load thread has a row


@pytest.mark.parametrize(
    ("cpus", "threads"), [(1, 2), (2, 2), (8, 2), (16, 4), (26, 6), (32, 8), (256, 8)]
)
def test_copy_threads_are_a_quarter_of_the_cpus_from_2_to_8(cpus: int, threads: int) -> None:
    assert copy_threads(cpus) == threads


def test_copy_threads_follow_the_cpus_this_process_may_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    assert copy_threads() == 4
    cfg = parse_connector_config({"load_workers": 3})
    assert (cfg.load_workers, cfg.load_prefetch_rows, cfg.dump_workers) == (3, 3, 4)
    cfg = parse_connector_config({"load_prefetch_rows": 1})
    assert (cfg.load_workers, cfg.load_prefetch_rows) == (4, 1)


def test_every_key_is_parsed() -> None:
    cfg = parse_connector_config(
        {
            "store": "local",
            "local_path": "/data/kv",
            "local_capacity_bytes": "2GiB",
            "namespace": "qwen3-0.6b@main",
            "load_mode": "async",
            "load_prefetch_rows": 3,
            "load_workers": 4,
            "dump_workers": 3,
            "dump_queue_capacity": 64,
            "dump_on_full": "wait",
            "dump_full_wait_s": 0.01,
            "blocking_finish": True,
        }
    )
    assert cfg.store["local_capacity_bytes"] == 2 << 30
    assert (cfg.namespace, cfg.load_mode, cfg.load_prefetch_rows) == ("qwen3-0.6b@main", "async", 3)
    assert (cfg.dump_workers, cfg.dump_queue_capacity, cfg.dump_on_full) == (3, 64, "wait")
    assert cfg.blocking_finish is True
    mooncake = parse_connector_config({"store": "mooncake", "mooncake_master": "10.0.0.5:50051"})
    assert mooncake.store_kind == "mooncake"
    assert mooncake.store["mooncake_master"] == "10.0.0.5:50051"


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        ({"load_mode": "eager"}, ["load_mode", "'layerwise'", "'eager'"]),
        ({"load_prefetch_rows": 0}, ["load_prefetch_rows", "[1, 64]"]),
        ({"load_workers": True}, ["load_workers"]),
        ({"dump_workers": "2"}, ["dump_workers"]),
        ({"dump_on_full": "block"}, ["dump_on_full", "'skip'"]),
        ({"dump_full_wait_s": -1}, ["dump_full_wait_s"]),
        ({"blocking_finish": "yes"}, ["blocking_finish"]),
        ({"namespace": ""}, ["namespace"]),
        ({"prefetch_rows": 2}, ["prefetch_rows", "accepted keys", "load_prefetch_rows"]),
        ({"store": "redis"}, ["store", "'local'", "'mooncake'"]),
        ({"local_pth": "/x"}, ["local_pth"]),
        ({"store": "mooncake", "local_path": "/x"}, ["local_path", "'local'"]),
        ({"local_capacity_bytes": "10GB"}, ["local_capacity_bytes", "GB"]),
        ({"store": "mooncake", "mooncake_master": "nohost"}, ["mooncake_master", "host:port"]),
    ],
)
def test_bad_key_or_value_names_it(extra: dict[str, Any], names: list[str]) -> None:
    with pytest.raises(ConnectorConfigError) as info:
        parse_connector_config(extra)
    for name in names:
        assert name in str(info.value)


def test_connector_refuses_bad_config_when_vllm_builds_it(store: FakeStore) -> None:
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConnectorConfigError, match="load_prefetch_rows"):
            UCMPatchConnector(vllm_config({"load_prefetch_rows": 100}), role, kv_cache_config())


def test_pipeline_parallel_is_refused_clearly(store: FakeStore) -> None:
    cfg = vllm_config()
    cfg.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(LayoutError, match="pipeline_parallel_size=2"):
        UCMPatchConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())


# -- layout and keys ----------------------------------------------------------------------
def layout(model: str = "tiny", extra: dict[str, Any] | None = None, tp: int = 1) -> KVLayout:
    cfg = vllm_config(extra, model=model, tp=tp)
    return KVLayout.from_vllm(cfg, kv_cache_config(), (extra or {}).get("namespace"), CHUNK_TOKENS)


def test_keys_depend_on_model_layout_and_rank() -> None:
    a = layout("org/model-a")
    assert a.fingerprint == layout("org/model-a").fingerprint  # both sides agree
    assert a.fingerprint != layout("org/model-b").fingerprint
    assert a.fingerprint != layout("org/model-a", tp=2).fingerprint
    same_weights = layout("/mnt/x/model-a", {"namespace": "model-a@v1"})
    assert (
        same_weights.fingerprint
        == layout("/opt/y/model-a", {"namespace": "model-a@v1"}).fingerprint
    )
    keys = {a.key("ab", 0, r, t) for r in range(2) for t in range(2)}
    assert len(keys) == 4
    assert a.keys_all_ranks("ab", 0) == [a.key("ab", 0, 0, 0), a.key("ab", 0, 1, 0)]
    tp2 = layout("org/model-a", tp=2)
    assert len(tp2.keys_all_ranks("ab", 0)) == 4  # a hit needs every rank's pages


def hybrid_config(mode: str = "align") -> tuple[KVCacheConfig, int]:
    """One GDN layer and one attention layer whose pages alias (vLLM 0.32 hybrid CPU)."""
    attn = FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=8, dtype=torch.float32)
    gdn = MambaSpec(
        block_size=8,
        shapes=((3, 16), (2, 4, 4)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode=mode,
        page_size_padded=attn.page_size_bytes,
    )
    page, num_blocks = attn.page_size_bytes, 16
    size = num_blocks * page
    tensors = [
        KVCacheTensor(
            size=size, layers=["model.layers.0.linear_attn"], layer_stride=size, block_stride=page
        ),
        KVCacheTensor(
            size=size,
            layers=["model.layers.1.self_attn.attn"],
            layer_stride=size,
            block_stride=page,
        ),
    ]
    groups = [
        KVCacheGroupSpec(["model.layers.0.linear_attn"], gdn),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], attn),
    ]
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups
    ), page


def test_hybrid_layout_one_row_two_group_kinds_async_loads() -> None:
    kvcc, page = hybrid_config()
    lay = KVLayout.from_vllm(vllm_config(block_size=8), kvcc, None, chunk_tokens=8)
    assert len(lay.rows) == 1  # both layers' pages alias: one storage row
    assert lay.rows.rows[0].save_layer == "model.layers.1.self_attn.attn"
    assert [g.kind for g in lay.groups] == ["mamba", "attention"]
    assert lay.row_page_bytes == (page,)
    assert lay.unit == 8
    assert not lay.layerwise_capable()
    assert choose_load_async(lay, "auto") is True
    with pytest.raises(ConnectorConfigError, match="load_mode"):
        choose_load_async(lay, "layerwise")
    assert choose_load_async(layout(), "auto") is False


# -- registration -------------------------------------------------------------------------
def test_register_with_vllm_is_idempotent_and_resolvable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    KVConnectorFactory._registry.pop("UCMPatchConnector", None)
    assert register_with_vllm() is True
    assert register_with_vllm() is False  # a second plugin call in the same process
    cls = KVConnectorFactory.get_connector_class_by_name("UCMPatchConnector")
    assert cls is UCMPatchConnector
    assert supports_hma(cls)  # vLLM keeps the hybrid KV-cache manager on
    by_path = KVConnectorFactory.get_connector_class(
        vllm_config().kv_transfer_config.__class__(
            kv_connector="UCMPatchConnector",
            kv_connector_module_path="ucm_patch.connector",
            kv_role="kv_both",
        )
    )
    assert by_path is UCMPatchConnector


def test_plugin_registers_the_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    from ucm_patch import plugin

    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    KVConnectorFactory._registry.pop("UCMPatchConnector", None)
    plugin._register_connector()
    assert "UCMPatchConnector" in KVConnectorFactory._registry


def test_role_mismatch_is_a_clear_error(store: FakeStore) -> None:
    sched = UCMPatchConnector(vllm_config(), KVConnectorRole.SCHEDULER, kv_cache_config())
    with pytest.raises(RuntimeError, match=r"wait_for_save.*SCHEDULER"):
        sched.wait_for_save()
    worker = UCMPatchConnector(vllm_config(), KVConnectorRole.WORKER, kv_cache_config())
    with pytest.raises(RuntimeError, match=r"build_connector_meta.*WORKER"):
        worker.build_connector_meta(None)
