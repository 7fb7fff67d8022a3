"""UCMPatchConnector on a tiny hybrid Qwen3-Next (GDN + full attention), real vLLM CPU 0.32.

vLLM's hybrid KV-cache manager stays on (the connector is ``SupportsHMA``); prefix caching
is on, so GDN states exist at block boundaries (mamba "align" mode). Request 1 computes
a prefix of a few thousand tokens: its full attention blocks and the GDN conv/SSM state at
the last block boundary of the prefill are dumped (one storage row: both layers' pages
alias). After vLLM's own prefix cache is reset, request 2 loads them asynchronously (vLLM
cannot take block-level load errors with several KV-cache groups): its tokens equal a
recomputation's, and its tokens and logprobs equal, bit for bit, the hit's exact oracle
(vLLM's own prefix cache seeded with the hit's prefix as request 1 computed it, then
request 2: the same KV and state bits, the same split of the prefill; ``oracle_steps`` in
tests/support/connector_child.py). A recomputation in one pass splits the prefill
elsewhere, and in bf16 no fixed tolerance on its logprobs holds on every CPU. The block
size is the one vLLM chose for this run (it depends on the CPU: the attention page must
hold the GDN state), never typed in.
Cross-process runs of every hybrid layout: tests/test_e2e_hybrid_layouts.py.

The model: a tied tiny Qwen3-Next gives uniform logits on vLLM 0.32 (its lm_head is never
tied); scripts/make_tiny_model.py builds it untied with initializer_range 0.2. Without the
GDN state load the logprobs of this model move (checked by hand by dropping the state
entry; tests/test_e2e_mutation.py shows wrong stored values move them beyond rounding),
so exact equality tests the state, not only the attention KV.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.support.connector_child import (
    assert_same_as_oracle,
    oracle_steps,
    prompt,
    run_child,
)

PREFIX = prompt(3, 2350)
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
            {"op": "reset", "name": "reset_r1"},
            {"op": "release", "name": "release_r1"},
            {"op": "gen", "name": "r2_recomputed", "prompt": R2, "salt": "recompute"},
            {"op": "flush", "name": "flush1"},
            {"op": "gen", "name": "r2", "prompt": R2},
            *oracle_steps("r2_oracle", R1, R2, hit_of="r2"),
            {"op": "flush", "name": "flush2"},
            {"op": "sizes", "name": "sizes"},
        ],
    }
    return run_child(spec, tmp, "hybrid")


@pytest.fixture(scope="module")
def block(hybrid_run: dict[str, Any]) -> int:
    """The block size vLLM chose for this run (hybrid: large enough for a GDN state page)."""
    size = hybrid_run["vllm"]["block_size"]
    assert hybrid_run["layout"]["unit"] == size
    return size


@pytest.fixture(scope="module")
def prefill_blocks(block: int) -> int:
    """Full blocks of request 1's prefill, where its one GDN state is stored."""
    return len(R1) // block


def test_model_outputs_vary(hybrid_run: dict[str, Any]) -> None:
    logprobs = hybrid_run["r2_recomputed"]["logprobs"]
    uniform = -math.log(VOCAB)
    assert all(lp > uniform + 1.0 for lp in logprobs), logprobs


def test_gdn_state_and_attention_blocks_are_dumped(
    hybrid_run: dict[str, Any], block: int, prefill_blocks: int
) -> None:
    stats = hybrid_run["r1"]["stats"]
    # every full attention block + 1 GDN state (where the prefill step ended)
    assert prefill_blocks >= 1
    assert stats["dump_blocks"] == prefill_blocks + 1
    assert list(hybrid_run["state_boundaries"].values()) == [[prefill_blocks * block]]
    assert stats["dumps_failed"] == stats["dumps_skipped"] == 0
    kinds = set(hybrid_run["layer_calls"]["kinds"].values())
    assert kinds == {"attention", "mamba"}


def test_request2_loads_gdn_state_and_matches_recompute(
    hybrid_run: dict[str, Any], block: int, prefill_blocks: int
) -> None:
    r2 = hybrid_run["r2"]
    assert hybrid_run["flush1"]["reset"]
    hit = min(prefill_blocks, len(PREFIX) // block) * block
    assert r2["num_cached_tokens"] == hit
    before = hybrid_run["r2_recomputed"]["stats"]
    after = r2["stats"]
    assert after["hit_tokens"] - before["hit_tokens"] == hit
    assert after["loads_async"] - before["loads_async"] == 1
    assert after["loaded_pages"] - before["loaded_pages"] == hit // block + 1  # + the state
    assert after["load_failed_requests"] == 0
    assert hybrid_run["r2_recomputed"]["num_cached_tokens"] == 0
    assert r2["tokens"] == hybrid_run["r2_recomputed"]["tokens"]
    assert_same_as_oracle(r2, hybrid_run["r2_oracle"])


def test_hybrid_run_leaks_nothing(hybrid_run: dict[str, Any]) -> None:
    assert hybrid_run["flush2"]["reset"]
    sizes = hybrid_run["sizes"]
    assert sizes["scheduler_requests"] == 0
    assert sizes["free_blocks"] == sizes["total_blocks"] - 1
    assert set(sizes["connector_scheduler"].values()) == {0}
    assert set(sizes["connector_worker"].values()) == {0}
    final = hybrid_run["final_stats"]
    assert final["pinned_blocks"] == final["unpinned_blocks"] > 0


def test_release_finished_lets_offline_llm_reset(hybrid_run: dict[str, Any]) -> None:
    """vLLM frees a finished request with dumps only on the next engine step; an offline
    LLM steps only inside generate, so the reset right after it fails until
    ``release_finished`` ran those steps."""
    assert hybrid_run["reset_r1"] == {"reset": False}
    assert hybrid_run["release_r1"] == {"released": True, "reset": True}
