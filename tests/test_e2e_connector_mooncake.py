"""UCMPatchConnector on the Mooncake store, end to end on real vLLM CPU 0.32.

The whole vLLM process runs inside a private network namespace next to a Mooncake master
and storage node on loopback (``scripts/mooncake_netns.sh``: Mooncake clients listen on
0.0.0.0 whatever they are told, so nothing may run on the host network); the script stops
master and node afterwards. Request 1 dumps into Mooncake; after vLLM's own prefix cache is
reset, request 2 loads the shared prefix from Mooncake: its tokens equal a recomputation's,
and its tokens and logprobs equal, bit for bit, the hit's exact oracle (vLLM's own prefix
cache seeded with the hit's prefix as request 1 computed it, then request 2: the same KV
bits, the same split of the prefill; ``oracle_steps`` in tests/support/connector_child.py;
in bf16 a recomputation in one pass may differ in the last bits on some CPUs). The
model is ``tiny-qwen3-sharp``, whose output changes when its KV is wrong
(``tests/test_e2e_mutation.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.connector_child import (
    assert_same_as_oracle,
    oracle_steps,
    prompt,
    run_child,
    whole_units,
)

PREFIX = prompt(1, 300)
R1 = [*PREFIX, 5, 6, 7]
R2 = [*PREFIX, 8, 9, 10, 11]

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]


@pytest.fixture(scope="module")
def mooncake_run(
    tiny_qwen3_sharp: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("ucm_mooncake")
    spec = {
        "model": str(tiny_qwen3_sharp),
        "extra": {
            "store": "mooncake",
            "mooncake_master": "$MOONCAKE_MASTER",
            "mooncake_global_segment_bytes": 0,  # the namespace's storage node holds data
        },
        "steps": [
            {"op": "gen", "name": "r1", "prompt": R1},
            {"op": "flush", "name": "flush1"},
            {"op": "gen", "name": "r2", "prompt": R2},
            {"op": "gen", "name": "r2_recomputed", "prompt": R2, "salt": "recompute"},
            *oracle_steps("r2_oracle", R1, R2, hit_of="r2"),
            {"op": "flush", "name": "flush2"},
            {"op": "sizes", "name": "sizes"},
        ],
    }
    return run_child(spec, tmp, "mooncake", netns=True)


def test_mooncake_request2_hits_and_matches_recompute(mooncake_run: dict[str, Any]) -> None:
    block = mooncake_run["vllm"]["block_size"]
    hit = whole_units(mooncake_run, len(PREFIX))
    r1 = mooncake_run["r1"]["stats"]
    assert r1["dump_blocks"] == whole_units(mooncake_run, len(R1)) // block >= 2
    assert r1["dumps_failed"] == r1["dumps_skipped"] == 0
    # every dumped value went out from the connector's registered staging buffers
    rows = {g["rows"] for g in mooncake_run["layout"]["groups"]}.pop()
    values = whole_units(mooncake_run, len(R1)) // mooncake_run["layout"]["unit"] * rows
    assert r1["store_zero_copy_puts"] == r1["store_puts"] == values > 0
    r2 = mooncake_run["r2"]
    assert r2["num_cached_tokens"] == hit
    assert r2["stats"]["hit_tokens"] == hit
    rows = {g["rows"] for g in mooncake_run["layout"]["groups"]}
    assert r2["stats"]["loaded_pages"] == hit // block * rows.pop()
    assert r2["stats"]["load_errors"] == 0
    recomputed = mooncake_run["r2_recomputed"]
    assert recomputed["num_cached_tokens"] == 0
    assert r2["tokens"] == recomputed["tokens"]
    assert_same_as_oracle(r2, mooncake_run["r2_oracle"])


def test_mooncake_run_leaks_nothing(mooncake_run: dict[str, Any]) -> None:
    assert mooncake_run["flush2"]["reset"]
    sizes = mooncake_run["sizes"]
    assert sizes["scheduler_requests"] == 0
    assert sizes["free_blocks"] == sizes["total_blocks"] - 1
    assert set(sizes["connector_scheduler"].values()) == {0}
    assert set(sizes["connector_worker"].values()) == {0}
