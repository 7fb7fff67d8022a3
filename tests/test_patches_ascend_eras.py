"""vLLM-Ascend records, era by era, through the real registry on stand-in vLLM-Ascend packages.

Each run is a child process (tests/standins/scenarios/era_*.py) with one stand-in era
(tests/standins/ascend_*) and the fake torch_npu (tests/standins/common) in front of
``sys.path``. The child builds ``Registry(records)`` from the real patch sets, activates it,
installs the stand-in connector (tests/support/standin_connector.py) as vLLM's active connector
(``kv_transfer_state._KV_CONNECTOR_AGENT``), sets a real ``ForwardContext`` and drives the
stand-ins the way vLLM / vLLM-Ascend call them (GDN through the installed vLLM's
``qwen_gdn_attention_core`` op). It prints one ordered log of cache writes, event records and
connector calls; these tests assert on it. The stand-ins' signatures are checked against the
real releases in tests/test_patches_ascend_standins.py.

Control runs switch the patches off (``UCM_SCENARIO_OFF``) and show the upstream behaviour
each patch changes, so every assertion below can fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.conftest import REPO, clean_env

STANDINS = REPO / "tests" / "standins"
ALL_OFF = "gdn_layerwise,reshape_cache_event,ascend_hook_bindings,ascend_sfa_wait"
GDN = "model.layers.0.linear_attn"

RUNS: dict[str, tuple[str, str, dict[str, str]]] = {
    "0.11": ("0_11", "era_0_11.py", {"UCM_PATCH_VLLM_VERSION": "0.11.0"}),
    "0.13": ("0_13", "era_0_13.py", {"UCM_PATCH_VLLM_VERSION": "0.13.0"}),
    "0.13-control": (
        "0_13",
        "era_0_13.py",
        {"UCM_PATCH_VLLM_VERSION": "0.13.0", "UCM_SCENARIO_OFF": ALL_OFF},
    ),
    "0.18-vllm-0.18.0": (
        "0_18",
        "era_0_18.py",
        {"UCM_PATCH_VLLM_ASCEND_VERSION": "0.18.0", "VLLM_VERSION": "0.18.0"},
    ),
    "0.18-vllm-0.18.1": (
        "0_18",
        "era_0_18.py",
        {"UCM_PATCH_VLLM_ASCEND_VERSION": "0.18.0", "VLLM_VERSION": "0.18.1"},
    ),
    "0.23-plugin-first": (
        "0_23",
        "era_0_23.py",
        {"UCM_PATCH_VLLM_ASCEND_VERSION": "0.23.0", "UCM_SCENARIO_ORDER": "plugin-first"},
    ),
    "0.23-late": (
        "0_23",
        "era_0_23.py",
        {"UCM_PATCH_VLLM_ASCEND_VERSION": "0.23.0", "UCM_SCENARIO_ORDER": "late"},
    ),
    "0.23-310p": (
        "0_23",
        "era_0_23.py",
        {
            "UCM_PATCH_VLLM_ASCEND_VERSION": "0.23.0",
            "UCM_SCENARIO_ORDER": "plugin-first",
            "UCM_STANDIN_SOC": "310p",
        },
    ),
}
# vLLM-Ascend main (tests/standins/ascend_main): newer than every ceiling; "allowed" opts in,
# "12711" adds the native GDN wait of vllm-ascend PR #12711.
_MAIN = {"UCM_PATCH_VLLM_ASCEND_VERSION": "0.26.0.dev0"}
_ALLOW = {"UCM_PATCH_ALLOW_UNTESTED": "1"}
_NATIVE_WAIT = {"UCM_STANDIN_NATIVE_WAIT": "1"}
RUNS.update(
    {
        "main": ("main", "era_main.py", _MAIN),
        "main-allowed": ("main", "era_main.py", {**_MAIN, **_ALLOW}),
        "main-12711": ("main", "era_main.py", {**_MAIN, **_NATIVE_WAIT}),
        "main-12711-allowed": ("main", "era_main.py", {**_MAIN, **_ALLOW, **_NATIVE_WAIT}),
    }
)


def run_scenario(era: str, script: str, extra: dict[str, str]) -> dict[str, Any]:
    # The repository root last: the scenarios' harness imports tests.support's stand-in
    # connector, and the stand-in packages must win over anything of the same name.
    path = f"{STANDINS / f'ascend_{era}'}:{STANDINS / 'common'}:{REPO}"
    # UCM_PATCH=0: ``import ucm_patch`` must not activate the process registry; the
    # scenario activates its own Registry(records).
    env = clean_env({"PYTHONPATH": path, "UCM_PATCH": "0", "VLLM_VERSION": "", **extra})
    proc = subprocess.run(
        [sys.executable, str(STANDINS / "scenarios" / script)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("UCM_RESULT ")]
    if proc.returncode != 0 or len(lines) != 1:
        pytest.fail(
            f"scenario {script} ({extra}) exited {proc.returncode}\n{proc.stdout[-3000:]}\n"
            f"{proc.stderr[-6000:]}"
        )
    return json.loads(lines[0].removeprefix("UCM_RESULT "))


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    """All scenario runs, three at a time (each imports vLLM: ~15 s)."""
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(run_scenario, *spec) for name, spec in RUNS.items()}
        return {name: f.result() for name, f in futures.items()}


def applied(result: dict[str, Any]) -> set[str]:
    return {rid for rid, state in result["states"].items() if state == "applied"}


def saves(log: list[list[Any]]) -> list[list[Any]]:
    return [e for e in log if e[0] == "save"]


def kinds(log: list[list[Any]]) -> list[str]:
    return [e[0] for e in log]


# -- every era ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", [n for n in RUNS if not n.endswith(("control", "main", "12711"))])
def test_no_record_fails_and_every_hook_binding_is_patched(runs, name):
    result = runs[name]
    failed = {k: v for k, v in result["final_states"].items() if v == "failed"}
    assert not failed, (failed, result["final_reasons"])
    assert result["bindings"], "the scenario imported no module binding the hooks"
    for binding, wrappers in result["bindings"].items():
        assert any(w.startswith("ascend_hook_bindings@") for w in wrappers), (binding, wrappers)


def test_control_leaves_bindings_and_gdn_untouched(runs):
    result = runs["0.13-control"]
    assert not applied(result)
    assert all(not w for w in result["bindings"].values())
    assert result["core_markers"] == []


# -- 0.11 -----------------------------------------------------------------------------------
def test_0_11_records_in_range(runs):
    assert applied(runs["0.11"]) == {
        "gdn_layerwise@ascend-0.11",
        "ascend_hook_bindings@ascend-0.11-attention-wait",
        "ascend_hook_bindings@ascend-0.11-attention-save",
        "ascend_hook_bindings@ascend-0.11-mla-wait",
        "ascend_hook_bindings@ascend-0.11-mla-save",
    }


def test_0_11_gdn_own_model_class_saves_the_virtual_engine_cache(runs):
    assert runs["0.11"]["gdn_step"] == [
        ["wait", GDN],
        ["write", f"gdn:{GDN}"],
        ["save", GDN, "ve1", "gdn_md", None, None],
    ]


def test_0_11_by_name_hooks_skip_steps_without_connector_metadata(runs):
    result = runs["0.11"]
    attn = "model.layers.1.self_attn.attn"
    assert result["attn_step"] == [
        ["wait", attn],
        ["write", "reshape_and_cache"],
        ["save", attn, "[k, v]", "md_dict", None, None],
    ]
    assert kinds(result["mla_step"]) == ["wait", "write", "save"]
    assert kinds(result["no_metadata"]) == ["write", "write", "write"]


# -- 0.13 -----------------------------------------------------------------------------------
def test_0_13_records_in_range(runs):
    assert applied(runs["0.13"]) == {
        "gdn_layerwise@ascend-0.13",
        "reshape_cache_event@ascend-0.13",
        "reshape_cache_event@ascend-0.13-cp",
        "reshape_cache_event@ascend-0.13-mla",
        "ascend_hook_bindings@ascend-0.11-mla-wait",
        "ascend_hook_bindings@ascend-0.11-mla-save",
        "ascend_hook_bindings@ascend-0.13-sfa-wait",
        "ascend_hook_bindings@ascend-0.13-sfa-save",
        "ascend_sfa_wait@ascend-0.13",
        "ascend_sfa_wait@ascend-0.13-dedupe",
    }


def test_0_13_wrapper_survives_the_worker_patch_reassignment(runs):
    result = runs["0.13"]
    # After patch_qwen3_next assigned its core onto vLLM's class, the class holds our
    # wrapper around exactly that Ascend function.
    assert result["core_markers"] == ["gdn_layerwise@ascend-0.13"]
    assert result["core_wraps_ascend"] is True
    expected = [["wait", GDN], ["write", f"gdn:{GDN}"], ["save", GDN, "ve1", "gdn_md", None, None]]
    assert result["gdn_op"] == expected  # the opaque GDN op -> _forward_core
    assert result["gdn_forward"] == expected  # the copied Ascend forward -> op -> core
    assert result["gdn_state_written"] == 8.0  # the saved ve1 cache is the one the core wrote
    assert runs["0.13-control"]["gdn_op"] == [["write", f"gdn:{GDN}"]]


def test_0_13_event_recorded_after_the_write_only_where_upstream_has_none(runs):
    result = runs["0.13"]
    # kv_producer: upstream records its own event; the wrapper leaves it alone.
    assert result["producer"]["log"] == [["write", "reshape_and_cache"], ["record", 1, "native"]]
    assert result["producer"]["records"] == 1
    # kv_consumer: no upstream event; ours is recorded right after the write.
    a0, a1 = result["consumer_a0"], result["consumer_a1"]
    assert a0["log"] == [["write", "reshape_and_cache"], ["record", a0["event"], "ucm"]]
    assert a1["log"] == [["write", "reshape_and_cache"], ["record", a1["event"], "ucm"]]
    assert a0["event"] != a1["event"] != 1  # per layer, never another layer's stale event
    nxt = result["consumer_a0_next_step"]  # next step: the layer's event is re-recorded
    assert (nxt["event"], nxt["records"]) == (a0["event"], 2)
    assert result["no_write"] == {"log": [], "event": None}  # no (key, value) cache: no write
    assert kinds(result["cp_producer"]["log"]) == ["write", "record"]
    assert result["cp_producer"]["log"][1][2] == "ucm"  # 0.13's CP impl records none
    control = runs["0.13-control"]
    assert control["consumer_a0"]["log"] == [["write", "reshape_and_cache"]]
    assert control["consumer_a1"]["event"] == control["producer"]["event"]  # stale


def test_0_13_mla_event_on_the_per_layer_metadata_before_the_save(runs):
    result = runs["0.13"]
    mla = "model.layers.3.mla"
    prefill, decode = result["mla_prefill"], result["mla_decode"]
    assert kinds(prefill) == ["wait", "write", "record", "save"]
    assert prefill[2][2] == "native"  # producer + prefill: upstream's own event
    assert prefill[3] == ["save", mla, "[mla.kv]", "mla_dict", prefill[2][1], 2]
    assert kinds(decode) == ["write", "record", "save"]  # decode-only: upstream has none
    assert decode[1][2] == "ucm"
    # UCM #1025 reads attn_metadata[layer].reshape_cache_event from the dict it is handed
    assert decode[2] == ["save", mla, "[mla.kv]", "mla_dict", decode[1][1], 1]
    assert result["kv_ready_layers"] == [mla]
    assert kinds(runs["0.13-control"]["mla_decode"]) == ["write", "save"]


def test_0_13_sfa_mlapo_branch_waits_exactly_once(runs):
    result, control = runs["0.13"], runs["0.13-control"]
    sfa = "model.layers.4.sfa"
    assert kinds(result["sfa_mlapo"])[:2] == ["wait", "mlapo"]
    assert kinds(result["sfa_mlapo"]).count("wait") == 1
    assert kinds(result["sfa_native"]).count("wait") == 1  # the branch's own wait deduped
    assert ["wait", sfa] not in control["sfa_mlapo"]  # upstream: the mlapo branch never waits
    assert kinds(control["sfa_native"]).count("wait") == 1


def test_0_13_no_hooks_without_connector_metadata(runs):
    assert not {"wait", "save"} & set(kinds(runs["0.13"]["no_metadata"]))
    assert "save" in kinds(runs["0.13-control"]["no_metadata"])  # upstream calls anyway


# -- 0.18 -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "cache"), [("0.18-vllm-0.18.0", "ve1"), ("0.18-vllm-0.18.1", "ve0")]
)
def test_0_18_one_save_per_gdn_layer_despite_the_anonymous_call(runs, name, cache):
    result = runs[name]
    # vLLM's own GDN wrapper was in place, the worker patch overwrote it, ours came after.
    assert result["markers_before_worker_patch"] == ["gdn_layerwise@vllm-0.22"]
    assert result["markers_after_worker_patch"] == ["gdn_layerwise@ascend-0.18"]
    assert result["qwen3_5_markers"] == ["gdn_layerwise@ascend-0.18-qwen3_5"]
    # forward = op (core) + maybe_save_kv_layer_to_connector("", []): one save, real name,
    # and the cache vllm_version_is("0.18.0") makes the core use (ve1) or index 0 (ve0).
    assert result["gdn_forward"] == [
        ["wait", GDN],
        ["write", f"gdn:{GDN}"],
        ["save", GDN, cache, "gdn_md", None, None],
    ]
    q35 = "model.layers.1.linear_attn"
    assert result["gdn35_op"] == [
        ["wait", q35],
        ["write", f"gdn:{q35}"],
        ["save", q35, f"q35.{cache}", "gdn35_md", None, None],
    ]
    assert result["binding_direct"] == [["save", "a.real.layer", "[]", "md", None, None]]


def test_0_18_kv_both_mla_gets_an_event(runs):
    result = runs["0.18-vllm-0.18.0"]
    assert next(e for e in result["mla_kv_producer"] if e[0] == "record")[2] == "native"
    both = result["mla_kv_both"]
    assert kinds(both) == ["wait", "write", "record", "save"]
    assert both[2][2] == "ucm" and both[3][4] == both[2][1]
    assert result["attn_producer"]["log"][1][2] == "native"
    assert result["attn_consumer"]["log"][1][2] == "ucm"


# -- 0.19 - 0.25 layout (stand-in 0.23) ---------------------------------------------------------
@pytest.mark.parametrize("name", ["0.23-plugin-first", "0.23-late", "0.23-310p"])
def test_0_23_one_save_per_gdn_layer_for_copied_and_oot_classes(runs, name):
    result = runs[name]
    core = "gdn310" if name.endswith("310p") else "gdn"
    assert result["gdn_step"] == [
        ["wait", GDN],
        ["write", f"{core}:{GDN}"],
        ["save", GDN, "gdn.kv", "gdn_md", None, None],
    ]
    oot = "model.layers.1.linear_attn"  # an AscendGatedDeltaNetAttention (register_oot)
    assert result["oot_step"] == [
        ["wait", oot],
        ["write", f"gdn:{oot}"],
        ["save", oot, "oot.kv", "oot_md", None, None],
    ]
    assert result["markers_ascend_class"] == ["gdn_layerwise@ascend-0.19"]


def test_0_23_wrapper_order_plugin_first_vs_late(runs):
    first, late, p310 = runs["0.23-plugin-first"], runs["0.23-late"], runs["0.23-310p"]
    # Plugin first (as on an NPU): vLLM's own GDN record is superseded by the Ascend eras
    # (never applied); patch_qwen3_5 copies the (already wrapped) Ascend core onto vLLM's
    # class and ours wraps the copy; the inner wrapper stands aside.
    assert first["markers_vllm_import"] == []
    assert first["markers_target"] == ["gdn_layerwise@ascend-0.21", "gdn_layerwise@ascend-0.19"]
    assert first["calls"]["skipped_nested"] == 1
    # Late activation: the copy was made before activation; only the Ascend era wraps it.
    assert late["markers_target"] == ["gdn_layerwise@ascend-0.21"]
    assert late["calls"]["skipped_nested"] == 0
    assert late["calls"]["save"] == 2  # GDN + OOT, nothing twice
    # 310P: patch_idex_310 copied the 310 core once more; ours wraps that copy.
    assert p310["markers_target"] == [
        "gdn_layerwise@ascend-0.21-310p-idex-qwen",
        "gdn_layerwise@ascend-0.19-310p",
    ]


def test_0_23_events_recorded_where_upstream_only_notifies(runs):
    result = runs["0.23-plugin-first"]
    for label in ("attn", "attn_c8", "attn_cp"):
        log = result[label]["log"]
        assert log == [
            ["write", "reshape_and_cache"],
            ["notified", ""],
            ["record", result[label]["event"], "ucm"],
        ]
    mla = result["mla"]  # notify(layer_name) is wrapped: the event precedes the notification
    assert kinds(mla) == ["wait", "write", "record", "notified", "save"]
    assert mla[2][2] == "ucm" and mla[4][4] == mla[2][1]
    for label in ("dsa", "dsa_cp"):
        log = result[label]
        assert kinds(log) == ["wait", "write", "record", "notified", "save"], log
        assert log[4][3] == "dsa_dict" and log[4][4] == log[2][1]  # read per layer from the dict


def test_0_23_sfa_already_waits_and_gates_hold(runs):
    result = runs["0.23-plugin-first"]
    assert result["states"]["ascend_sfa_wait@ascend-0.13"] == "skipped-version"
    assert kinds(result["sfa_mlapo"]).count("wait") == 1
    assert result["sfa_mlapo"][3][2] == "native"  # SFA still records for producers in 0.23
    assert not {"wait", "save"} & set(kinds(result["no_metadata"]))


# -- vLLM-Ascend main (newer than every ceiling) ---------------------------------------------
MAIN_GDN = ("model.layers.0.linear_attn", "model.layers.4.linear_attn")


def _bracketed(step: list[list[Any]]) -> list[list[Any]]:
    """One wait, the write, one save under the layer's name with its own cache, per layer."""
    out: list[list[Any]] = []
    for i, name in enumerate(MAIN_GDN):
        out += [
            ["wait", name],
            ["write", f"gdn:{name}"],
            ["save", name, f"gdn{i}.kv", f"gdn{i}_md", None, None],
        ]
    return out


@pytest.mark.parametrize("name", ["main", "main-12711"])
def test_main_gdn_records_are_untested_by_default(runs, name):
    """Past the ceiling nothing is wrapped: the connector sees upstream's calls only (the
    anonymous save, and #12711's wait where main has it)."""
    result = runs[name]
    core, anon = "gdn_layerwise@ascend-0.19", "gdn_layerwise@ascend-0.19-anon"
    assert result["final_states"][core] == result["final_states"][anon] == "untested-version"
    assert "past the ceiling <0.26" in result["final_reasons"][core]
    upstream = []
    for name_ in MAIN_GDN:
        upstream += [["wait", name_]] if name.endswith("12711") else []
        upstream += [["write", f"gdn:{name_}"], ["save", "", "[]", "md", None, None]]
    assert result["step0"] == result["step1"] == upstream


@pytest.mark.parametrize("name", ["main-allowed", "main-12711-allowed"])
def test_main_allowed_gives_one_wait_and_one_named_save_per_layer(runs, name):
    """Opted in: main's anonymous save (now inside _forward_core) is dropped, the core gets
    its save under its name, and the wait comes from the wrapper or from #12711, never both."""
    result = runs[name]
    for rid in ("gdn_layerwise@ascend-0.19", "gdn_layerwise@ascend-0.19-anon"):
        assert result["final_states"][rid] == "applied", result["final_reasons"].get(rid)
        assert "allowed by env UCM_PATCH_ALLOW_UNTESTED" in result["final_reasons"][rid]
    assert result["step0"] == result["step1"] == _bracketed(result["step0"])


def test_main_native_wait_leaves_the_wrapper_adding_the_save_only(runs):
    reason = runs["main-12711-allowed"]["final_reasons"]["gdn_layerwise@ascend-0.19"]
    assert "adds save only; native wait: " in reason
    assert "calls wait_for_kv_layer_from_connector" in reason
    assert "native" not in runs["main-allowed"]["final_reasons"]["gdn_layerwise@ascend-0.19"]
