"""UCMPatchConnector on a tiny hybrid Qwen3-Next (GDN + full attention), real vLLM CPU 0.32.

vLLM's hybrid KV-cache manager stays on (the connector is ``SupportsHMA``); prefix caching
is on, so GDN states exist at block boundaries (mamba "align" mode). Request 1 computes
2 x 1152 tokens: two attention blocks and the GDN conv/SSM state at token 2304 are dumped
(one storage row: both layers' pages alias). After vLLM's own prefix cache is reset,
request 2 loads all three asynchronously (vLLM cannot take block-level load errors with
several KV-cache groups) and its tokens and logprobs equal a recomputation exactly.

The model: a tied tiny Qwen3-Next gives uniform logits on vLLM 0.32 (its lm_head is never
tied); scripts/make_tiny_model.py builds it untied with initializer_range 0.2. Without the
GDN state load the logprobs of this model move by ~1e-2 (checked by hand by dropping the
state entry), so exact equality tests the state, not only the attention KV.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.connector_child import prompt, run_child

BLOCK = 1152  # hybrid block size: attention pages padded to the GDN state page
PREFIX = prompt(3, 2 * BLOCK + 46)
R1 = [*PREFIX, 5, 6, 7]
R2 = [*PREFIX, 8, 9, 10, 11]
VOCAB = 1024

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def hybrid_model(tiny_qwen3_next: Path) -> Path:
    cfg = json.loads((tiny_qwen3_next / "config.json").read_text())
    # Outputs must vary and depend on the GDN state (see scripts/make_tiny_model.py).
    assert cfg["tie_word_embeddings"] is False and cfg["initializer_range"] >= 0.1, cfg
    return tiny_qwen3_next


@pytest.fixture(scope="module")
def hybrid_run(hybrid_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("ucm_hybrid")
    spec = {
        "model": str(hybrid_model),
        "hybrid": True,
        "extra": {"store": "local", "local_path": str(tmp / "store")},
        "steps": [
            {"op": "gen", "name": "r1", "prompt": R1},
            {"op": "gen", "name": "r2_recomputed", "prompt": R2, "salt": "recompute"},
            {"op": "flush", "name": "flush1"},
            {"op": "gen", "name": "r2", "prompt": R2},
            {"op": "flush", "name": "flush2"},
            {"op": "sizes", "name": "sizes"},
        ],
    }
    return run_child(spec, tmp, "hybrid")


def test_model_outputs_vary(hybrid_run: dict[str, Any]) -> None:
    logprobs = hybrid_run["r2_recomputed"]["logprobs"]
    uniform = -math.log(VOCAB)
    assert all(lp > uniform + 1.0 for lp in logprobs), logprobs


def test_gdn_state_and_attention_blocks_are_dumped(hybrid_run: dict[str, Any]) -> None:
    stats = hybrid_run["r1"]["stats"]
    # 2 attention blocks + 1 GDN state (at token 2304, where the prefill step ended)
    assert stats["dump_blocks"] == 3
    assert stats["dumps_failed"] == stats["dumps_skipped"] == 0
    kinds = set(hybrid_run["layer_calls"]["kinds"].values())
    assert kinds == {"attention", "mamba"}


def test_request2_loads_gdn_state_and_matches_recompute(hybrid_run: dict[str, Any]) -> None:
    r2 = hybrid_run["r2"]
    assert hybrid_run["flush1"]["reset"]
    assert r2["num_cached_tokens"] == 2 * BLOCK
    before = hybrid_run["r2_recomputed"]["stats"]
    after = r2["stats"]
    assert after["hit_tokens"] - before["hit_tokens"] == 2 * BLOCK
    assert after["loads_async"] - before["loads_async"] == 1
    assert after["loaded_pages"] - before["loaded_pages"] == 3  # 2 attention + 1 state
    assert after["load_failed_requests"] == 0
    assert hybrid_run["r2_recomputed"]["num_cached_tokens"] == 0
    assert r2["tokens"] == hybrid_run["r2_recomputed"]["tokens"]
    assert r2["logprobs"] == hybrid_run["r2_recomputed"]["logprobs"]


def test_hybrid_run_leaks_nothing(hybrid_run: dict[str, Any]) -> None:
    assert hybrid_run["flush2"]["reset"]
    sizes = hybrid_run["sizes"]
    assert sizes["scheduler_requests"] == 0
    assert sizes["free_blocks"] == sizes["total_blocks"] - 1
    assert set(sizes["connector_scheduler"].values()) == {0}
    assert set(sizes["connector_worker"].values()) == {0}
    final = hybrid_run["final_stats"]
    assert final["pinned_blocks"] == final["unpinned_blocks"] > 0
