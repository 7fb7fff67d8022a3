"""A store raising ``RuntimeError`` at load time, on real vLLM CPU, in both load modes.

Not a ``StoreError``: a store (or a bug in the load path) that breaks the contract. Before,
such an exception escaped ``wait_for_layer_load`` and killed the engine. Now every
exception in a load is a load error for the affected blocks, which vLLM recomputes.

One child process per load mode: request 1 dumps its prefix; then every
``LocalStore.get_many`` raises (the scheduler's lookup still finds the prefix, so vLLM
schedules a load); requests 2 and 3 share the prefix, so both loads fail. What must hold:
the engine survives, both outputs equal a recomputation (a salted request that cannot
hit), the exception is counted in ``load_exceptions`` and logged once, not per request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.connector_child import prompt, run_child

PREFIX = prompt(5, 300)
R1 = [*PREFIX, 5, 6, 7]
R2 = [*PREFIX, 8, 9, 10, 11]
R3 = [*PREFIX, 12, 13]
MODES = ("layerwise", "async")

pytestmark = pytest.mark.vllm


def gen(name: str, ids: list[int], salt: str | None = None) -> dict[str, Any]:
    return {"op": "gen", "name": name, "prompt": ids, "salt": salt, "max_tokens": 6}


@pytest.fixture(scope="module", params=MODES)
def run(
    request: pytest.FixtureRequest, tiny_qwen3_sharp: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    mode = request.param
    tmp = tmp_path_factory.mktemp(f"load_errors_{mode}")
    extra = {"store": "local", "local_path": str(tmp / "store"), "load_mode": mode}
    spec = {
        "model": str(tiny_qwen3_sharp),
        "extra": extra,
        "steps": [
            gen("r1", R1),
            {"op": "flush", "name": "flush"},
            {"op": "break_gets", "name": "break"},
            gen("r2", R2),
            # r2 recomputed the prefix into vLLM's own cache: drop it, so r3 asks the store
            {"op": "flush", "name": "flush_r2"},
            gen("r3", R3),
            gen("r2_recomputed", R2, salt="recompute"),
            gen("r3_recomputed", R3, salt="recompute"),
            {"op": "flush", "name": "flush2"},
        ],
    }
    return run_child(spec, tmp, f"load_errors_{mode}") | {"mode": mode}


def test_engine_survives_and_output_equals_recomputation(run: dict[str, Any]) -> None:
    for name in ("r2", "r3"):
        assert run[name]["tokens"] == run[f"{name}_recomputed"]["tokens"], name
        assert run[name]["logprobs"] == run[f"{name}_recomputed"]["logprobs"], name
    assert run["flush2"]["reset"], "blocks of the failed loads are still held"


def test_the_loads_were_attempted_and_failed(run: dict[str, Any]) -> None:
    before, after = run["r1"]["stats"], run["r3"]["stats"]
    assert before["load_exceptions"] == 0
    # the lookups still found the prefix: vLLM scheduled a load for both requests
    assert after["hit_requests"] - before["hit_requests"] == 2
    assert after["load_failed_requests"] - before["load_failed_requests"] == 2
    assert after["load_exceptions"] >= 2  # at least one per failed request
    assert after["loaded_pages"] == before["loaded_pages"]
    if run["mode"] == "layerwise":
        assert after["loads_layerwise"] + after["loads_sync_fallback"] >= 2
    else:
        assert after["loads_async"] - before["loads_async"] == 2


def test_the_cause_is_logged_once(run: dict[str, Any]) -> None:
    lines = [line for line in run["ucm_errors"] if "store exploded" in line]
    assert len(lines) == 1, run["ucm_errors"]
    assert "RuntimeError" in lines[0]
