"""vLLM's OpenAI server with the plugin and UCMPatchConnector, over HTTP (issue #17).

What a user runs: ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve``
CLI needs a distribution named ``vllm``) on loopback and a free port, the local store in a
fresh directory, requests through the ``openai`` client, ``GET /metrics`` scraped. The
driver is scripts/serve_demo.py (``make serve-demo`` runs the same functions).

Per model, two servers on one store: the first computes the prompt (its blocks are
dumped) and serves it again from vLLM's own prefix cache; the restarted one serves it from
the store. Expected numbers come from the servers themselves: the block size from
``vllm:cache_config_info``, the prompt is two full blocks and a partial one. Two shapes:
tiny Qwen3 (attention only, float32, vLLM's API / engine-core / worker processes) and tiny
Qwen3-Next laid out like the real checkpoint (3 GDN layers per attention layer, several
mamba groups; bf16, the engine in the server process: see scripts/serve_demo.settings).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import REPO
from tests.support import load_script
from ucm_patch.connector import vllm_metrics as connector_metrics
from ucm_patch.hooks.stores import make_store

pytestmark = pytest.mark.vllm


sd = load_script("serve_demo")
BLOCKS = 2  # whole stored chunks in the prompt (plus a partial block)


@pytest.fixture(scope="module", params=["tiny-qwen3-sharp", "tiny-qwen3-next-3to1"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = REPO / "models" / request.param
    work = tmp_path_factory.mktemp(f"serve-{request.param}")
    runs = sd.run(model, work, blocks=BLOCKS)
    runs["model"] = request.param
    # Payload bytes the store holds (both tiers, opened as the server's connector does).
    store = make_store({"local_path": str(work / "store")})
    runs["stored_payload_bytes"] = sum(at.size for at in store.placements())
    store.close()
    runs["dtype"] = sd.settings(model)[0]
    return runs


def _total(m: dict[str, Any], family: str) -> float:
    return sd.value(m, family, f"{family}_total")


def test_restarted_server_hits_the_store_like_vllms_own_cache(served: Any) -> None:
    first, restarted = served["first"], served["restarted"]
    size = sd.block_size(first["after"])
    unit = sd.hit_unit(first["after"])
    assert sd.block_size(restarted["after"]) == size
    assert first["computed"]["prompt_tokens"] == BLOCKS * unit + size // 3
    # first server: nothing external; its rerun hits vLLM's own prefix cache
    local = _total(first["after"], "vllm:prefix_cache_hits") - _total(
        first["middle"], "vllm:prefix_cache_hits"
    )
    assert local == BLOCKS * unit
    assert _total(first["after"], sd.EXTERNAL_HITS) == 0
    # restarted server: the same tokens come from the store
    assert _total(restarted["after"], sd.EXTERNAL_HITS) == BLOCKS * unit
    assert _total(restarted["after"], "vllm:prefix_cache_hits") == 0


def test_logprobs_equal_the_first_servers(served: Any) -> None:
    restored = served["restarted"]["restored"]["token_logprobs"]
    assert restored == served["first"]["cached"]["token_logprobs"]
    if served["dtype"] == "float32":  # bf16: a one-pass prefill differs in the last bits
        assert restored == served["first"]["computed"]["token_logprobs"]


def test_metrics_show_the_connector_families_with_vllms_labels(served: Any) -> None:
    for run in ("first", "restarted"):
        metrics = served[run]["after"]
        for family in connector_metrics.family_names():
            assert family in metrics, f"{family} missing from /metrics of the {run} server"
            labels = metrics[family]["labels"]
            assert labels.get("model_name") == sd.SERVED_NAME and labels.get("engine") == "0"


def test_metrics_count_dumps_and_loads(served: Any) -> None:
    first, restarted = served["first"]["after"], served["restarted"]["after"]
    unit = sd.hit_unit(first)
    completed = _total(first, "vllm:ucm_dumps_completed")
    assert completed > 0 and _total(first, "vllm:ucm_dumps_failed") == 0
    assert _total(first, "vllm:ucm_dumps_submitted") == completed
    assert _total(first, "vllm:ucm_dump_bytes") > 0
    hist = "vllm:ucm_dump_duration_seconds"
    assert sd.value(first, hist, f"{hist}_count") == completed
    assert first["vllm:ucm_store_used_bytes"]["samples"]["vllm:ucm_store_used_bytes"] > 0
    assert _total(restarted, "vllm:ucm_hit_tokens") == BLOCKS * unit
    assert _total(restarted, "vllm:ucm_load_bytes") > 0
    assert _total(restarted, "vllm:ucm_load_errors") == 0
    assert _total(restarted, "vllm:ucm_dumps_submitted") == 0  # loaded blocks: not again


def test_a_rerun_from_vllms_prefix_cache_dumps_nothing_again(served: Any) -> None:
    """The first server's rerun of the prompt is served by vLLM's own prefix cache: its
    blocks are in the store already, so every byte the server reports dumped is a byte
    the store holds (before: the rerun dumped the whole prefix a second time)."""
    dumped = _total(served["first"]["after"], "vllm:ucm_dump_bytes")
    assert dumped == served["stored_payload_bytes"] > 0


def test_connector_start_line_is_in_vllms_log_format(served: Any) -> None:
    log = served["first"]["log"]
    line = next(x for x in log.splitlines() if "UCMPatchConnector worker: store=local(" in x)
    assert "INFO" in line and "[kv_connector.py:" in line and "load_mode=" in line
    assert "key fingerprint" in line


def test_periodic_stats_line_in_vllms_logger(served: Any) -> None:
    """vLLM's own periodic stats logger prints the connector's interval summary
    (``UCMConnectorStats.reduce``), rate-limited to its logging interval."""
    lines = [x for x in served["first"]["log"].splitlines() if "KV Transfer metrics:" in x]
    assert lines, "no periodic connector stats line"
    assert any("dumps_completed=" in x and "dump_bytes=" in x for x in lines), lines
