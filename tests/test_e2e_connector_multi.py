"""Two UCMPatchConnectors under vLLM's MultiConnector, 200 requests with aborts, real vLLM CPU.

One child vLLM process (inside the Mooncake network namespace) runs a ``MultiConnector``
whose children are two UCMPatchConnectors: one on the local store, one on the Mooncake
store. Both dump what they see computed, so vLLM's MultiConnector counts up to two async
saves per request and frees its blocks only after every child that answered "async save"
reported it in ``finished_sending``. The two children's request sets differ: a prefix
loaded by the first child (MultiConnector lets the first one with a hit load) counts as
computed for the second, which dumps it into its own store.

Each worker-side instance holds its own dump client; were the two to share one request-id
space, one instance would report the other's completions (or one id twice), and vLLM
would free blocks while the other instance's dumps still read them.

The stream: 200 requests over shared prefixes, at most 10 outstanding, a quarter aborted
at a random output length (some while still waiting). Between the two halves vLLM's prefix
cache is reset, so the second half loads the prefixes back from the stores while other
requests dump.

What must hold (every expected number comes from the run: which requests finished and
which were aborted, which requests each instance answered "async save" for):

* every planned abort happened and every other request finished;
* per instance: ``finished_sending`` reports exactly the requests whose
  ``request_finished`` answered True on that instance, each once, no foreign id;
* afterwards every block is free (``reset_prefix_cache`` succeeds, free = total - 1),
  both instances' scheduler- and worker-side maps, the dump scheduler's maps and
  MultiConnector's extra-save counts are empty, and no event handle is alive.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.support.connector_child import run_child

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

N_REQUESTS = 200
ABORT_SHARE = 0.25
KINDS = ("local", "mooncake")


def requests(seed: int = 11) -> list[dict[str, Any]]:
    """Shared prefixes of varied length, a random suffix each, a quarter aborted."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(4, 1000) for _ in range(rng.randrange(150, 420))] for _ in range(12)]
    out = []
    for i in range(N_REQUESTS):
        suffix = [rng.randrange(4, 1000) for _ in range(rng.randrange(1, 60))]
        max_tokens = rng.randrange(2, 16)
        abort_at = rng.randrange(0, max_tokens) if rng.random() < ABORT_SHARE else None
        out.append(
            {
                "id": f"m{i}",
                "prompt": rng.choice(prefixes) + suffix,
                "max_tokens": max_tokens,
                "abort_at": abort_at,
            }
        )
    return out


@pytest.fixture(scope="module")
def run(tiny_qwen3_sharp: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("ucm_multi")
    stream = requests()
    half = N_REQUESTS // 2
    spec = {
        "model": str(tiny_qwen3_sharp),
        "extra": None,
        "multi_ours": [
            {"store": "local", "local_path": str(tmp / "store")},
            {
                "store": "mooncake",
                "mooncake_master": "$MOONCAKE_MASTER",
                "mooncake_global_segment_bytes": 0,  # the namespace's storage node holds data
            },
        ],
        "dtype": "float32",
        "max_num_seqs": 6,
        "steps": [
            {"op": "stress", "name": "first", "requests": stream[:half], "inflight": 10},
            {"op": "flush", "name": "flush1"},
            {"op": "stress", "name": "second", "requests": stream[half:], "inflight": 10},
            {"op": "flush", "name": "flush2"},
            {"op": "sizes", "name": "sizes"},
        ],
    }
    return run_child(spec, tmp, "multi", netns=True, timeout=1200)


def test_planned_aborts_happened_and_the_rest_finished(run: dict[str, Any]) -> None:
    stream = requests()
    planned = {r["id"] for r in stream if r["abort_at"] is not None}
    aborted = run["first"]["aborted"] + run["second"]["aborted"]
    finished = set(run["first"]["finished"]) | set(run["second"]["finished"])
    assert sorted(aborted) == sorted(planned)
    assert len(planned) >= 0.15 * N_REQUESTS
    assert finished == {r["id"] for r in stream} - planned
    stats = run["final_stats"]
    assert stats["loaded_pages"] > 0, stats  # the second half loaded from a store
    assert stats["dump_pages"] > 0, stats


def test_each_instance_reports_exactly_its_own_requests(run: dict[str, Any]) -> None:
    ids = {r["id"] for r in requests()}
    per = run["per_connector"]
    assert sorted(per) == sorted(KINDS)
    for kind in KINDS:
        saves, sending = per[kind]["async_saves"], per[kind]["sending"]
        twice = [rid for rid, n in Counter(sending).items() if n > 1]
        assert twice == [], (kind, twice)
        assert len(saves) == len(set(saves)), kind  # vLLM asks once per request
        assert set(sending) == set(saves), (
            kind,
            sorted(set(sending) - set(saves))[:10],
            sorted(set(saves) - set(sending))[:10],
        )
        # vLLM's engine appends a random suffix to each id it is given ("m7-1a2b3c4d")
        external = {rid.rsplit("-", 1)[0] for rid in saves}
        assert len(external) == len(saves), kind
        assert external <= ids, (kind, sorted(external - ids)[:10])
        assert saves, kind


def test_every_block_freed_and_nothing_leaks(run: dict[str, Any]) -> None:
    assert run["flush1"]["reset"] and run["flush2"]["reset"], "blocks still held"
    sizes = run["sizes"]
    assert sizes["scheduler_requests"] == 0
    assert sizes["free_blocks"] == sizes["total_blocks"] - 1  # all but the null block
    assert len(sizes["connector_schedulers"]) == len(sizes["connector_workers"]) == len(KINDS)
    for side in (*sizes["connector_schedulers"], *sizes["connector_workers"]):
        assert set(side.values()) == {0}, side
    assert set(sizes["dump_scheduler"].values()) == {0}, sizes["dump_scheduler"]
    assert sizes["multi_extra_async_saves"] == [0, 0]
