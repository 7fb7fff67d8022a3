"""UCMPatchConnector end to end on real vLLM CPU 0.32 (tiny Qwen3, single-process mode).

One vLLM process per scenario, several assertions per process (each start costs ~20 s):

* ``local_run``: request 1 computes and dumps; after vLLM's own prefix cache is reset,
  request 2 (same prefix) loads layerwise from the local store: its tokens equal a
  recomputation (same prompt, other ``cache_salt``: a miss) and a run without any
  connector, and its tokens and logprobs equal, bit for bit, the hit's exact oracle;
  loaded blocks are not dumped again; corrupted values fail their checksum at load
  time, vLLM recomputes (same output) and the blocks are stored again; nothing leaks
  (all maps empty, every block free).
* ``restart_run``: a new process on the same directory hits the cache, with our connector
  as a child of vLLM's ``MultiConnector`` next to ``ExampleConnector`` (a non-HMA sibling:
  the seed-000 ``request_finished`` path); its delayed frees are all reported and freed.
* ``plain_run``: the same prompts without a connector (the reference outputs).
* ``multiprocess_run``: ``vllm serve``'s process layout (API, engine core and worker
  processes; float32, as bf16 faults in spawned CPU workers here): the connector is found
  by its registered name in every process, metadata and worker reports cross process
  boundaries, and the hit equals a recomputation.

The exact oracle of a hit (issue #36): vLLM's own prefix cache, under a salt of its own,
seeded with the hit's prefix computed as the stored KV was computed (in a prefill as long
as the prompt that dumped it), then the request (``oracle_steps``,
tests/support/connector_child.py): the same KV bits, the same split of the prefill. A
recomputation in one pass splits the prefill elsewhere; in bf16 its logprobs then differ
in the last bits on some CPUs, so it is the reference for tokens only.

The model is ``tiny-qwen3-sharp`` (initializer range 0.2): its greedy tokens depend on the
KV, so "equals a recomputation" fails for wrong pages (``tests/test_e2e_mutation.py``
proves it by loading pages changed inside valid frames); the default tiny Qwen3 repeats
one token whatever its cache holds.
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

PREFIX = prompt(1, 300)  # full blocks + a partial one (vLLM CPU picks 128-token blocks)
R1 = [*PREFIX, 5, 6, 7]
R2 = [*PREFIX, 8, 9, 10, 11]
R3 = [*PREFIX, 12, 13]
R4 = prompt(2, 270)  # a new prompt: two more blocks to dump in the restarted process

pytestmark = pytest.mark.vllm


def gen(name: str, ids: list[int], salt: str | None = None) -> dict[str, Any]:
    return {"op": "gen", "name": name, "prompt": ids, "salt": salt}


FLUSH = {"op": "flush"}


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ucm_e2e") / "store"


@pytest.fixture(scope="module")
def local_run(tiny_qwen3_sharp: Path, store_dir: Path) -> dict[str, Any]:
    spec = {
        "model": str(tiny_qwen3_sharp),
        "extra": {"store": "local", "local_path": str(store_dir)},
        "steps": [
            gen("r1", R1),
            {"op": "flush", "name": "flush1"},
            gen("r2", R2),
            gen("r2_recomputed", R2, salt="recompute-r2"),
            FLUSH,
            {"op": "corrupt", "name": "corrupt", "count": 1000},
            gen("r3", R3),
            gen("r3_recomputed", R3, salt="recompute-r3"),
            FLUSH,
            gen("r2_again", R2),
            # the exact oracles: r2 loaded r1's dumps; r2_again, r3's (recomputed, dumped)
            *oracle_steps("r2_oracle", R1, R2, hit_of="r2"),
            *oracle_steps("r2_again_oracle", R3, R2, hit_of="r2_again"),
            {"op": "flush", "name": "flush_last"},
            {"op": "sizes", "name": "sizes"},
        ],
    }
    return run_child(spec, store_dir.parent, "local")


@pytest.fixture(scope="module")
def plain_run(tiny_qwen3_sharp: Path, store_dir: Path) -> dict[str, Any]:
    # r3 after a reset: computed in one pass, as a request whose load failed is recomputed
    steps = [gen("r2", R2), {"op": "reset", "name": "reset"}, gen("r3", R3)]
    spec = {"model": str(tiny_qwen3_sharp), "extra": None, "steps": steps}
    return run_child(spec, store_dir.parent, "plain")


@pytest.fixture(scope="module")
def restart_run(
    tiny_qwen3_sharp: Path, store_dir: Path, local_run: dict[str, Any]
) -> dict[str, Any]:
    spec = {
        "model": str(tiny_qwen3_sharp),
        "extra": {"store": "local", "local_path": str(store_dir)},
        "multi": True,
        "example_dir": str(store_dir.parent / "example"),
        "steps": [
            gen("r2", R2),
            FLUSH,
            gen("r4", R4),
            {"op": "flush", "name": "flush_last"},
            {"op": "sizes", "name": "sizes"},
        ],
    }
    (store_dir.parent / "example").mkdir(exist_ok=True)
    return run_child(spec, store_dir.parent, "restart")


def same_output(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The same computation (no hit in either, or the same hit of the same stored KV)."""
    assert a["tokens"] == b["tokens"]
    assert a["logprobs"] == b["logprobs"]


def delta(run: dict[str, Any], before: str, after: str, key: str) -> int:
    return run[after]["stats"][key] - run[before]["stats"][key]


def prefix_hit(run: dict[str, Any], tokens: int = len(PREFIX)) -> int:
    """Tokens of ``tokens`` in whole hit units (chunks of the block size vLLM chose)."""
    assert run["layout"]["unit"] % run["vllm"]["block_size"] == 0
    return whole_units(run, tokens)


def test_request1_dumps_its_full_blocks(local_run: dict[str, Any]) -> None:
    r1 = local_run["r1"]["stats"]
    assert r1["hit_tokens"] == 0
    assert r1["dump_blocks"] == prefix_hit(local_run, len(R1)) // local_run["vllm"]["block_size"]
    assert r1["dump_blocks"] >= 2
    assert r1["dumps_completed"] >= 2  # one dump task per storage row (2 layers)
    assert r1["dumps_failed"] == r1["dumps_skipped"] == 0
    assert local_run["flush1"]["reset"], "vLLM's prefix cache could not be reset: blocks leaked"


def test_request2_loads_prefix_layerwise_and_matches_recompute(
    local_run: dict[str, Any], plain_run: dict[str, Any]
) -> None:
    r2 = local_run["r2"]
    assert r2["num_cached_tokens"] == prefix_hit(local_run) > 0
    assert delta(local_run, "r1", "r2", "hit_tokens") == prefix_hit(local_run)
    # Loaded row by row inside the forward, waited for in wait_for_layer_load (both rows).
    assert delta(local_run, "r1", "r2", "loads_layerwise") == 1
    assert delta(local_run, "r1", "r2", "rows_waited_in_layer") == 2
    assert delta(local_run, "r1", "r2", "loaded_pages") == 2 * 2
    # Loaded blocks are never dumped again.
    assert delta(local_run, "r1", "r2", "dump_blocks") == 0
    recomputed = local_run["r2_recomputed"]
    assert recomputed["num_cached_tokens"] == 0
    assert delta(local_run, "r2", "r2_recomputed", "hit_tokens") == 0
    assert r2["tokens"] == recomputed["tokens"] == plain_run["r2"]["tokens"]
    assert_same_as_oracle(r2, local_run["r2_oracle"])


def test_corrupt_values_fail_the_load_and_vllm_recomputes(
    local_run: dict[str, Any], plain_run: dict[str, Any]
) -> None:
    assert local_run["corrupt"]["corrupted"], "nothing was stored to corrupt"
    assert delta(local_run, "r2_recomputed", "r3", "load_errors") >= 1
    assert delta(local_run, "r2_recomputed", "r3", "load_failed_requests") == 1
    assert local_run["r3_recomputed"]["num_cached_tokens"] == 0
    assert plain_run["reset"]["reset"] and plain_run["r3"]["num_cached_tokens"] == 0
    same_output(local_run["r3"], local_run["r3_recomputed"])
    same_output(local_run["r3"], plain_run["r3"])
    # The recomputed blocks were dumped again, so the prefix hits once more.
    assert delta(local_run, "r3_recomputed", "r2_again", "hit_tokens") == prefix_hit(local_run)
    assert local_run["r2_again"]["tokens"] == plain_run["r2"]["tokens"]
    assert_same_as_oracle(local_run["r2_again"], local_run["r2_again_oracle"])


def test_nothing_leaks(local_run: dict[str, Any]) -> None:
    assert local_run["flush_last"]["reset"]
    sizes = local_run["sizes"]
    assert sizes["scheduler_requests"] == 0
    assert sizes["free_blocks"] == sizes["total_blocks"] - 1  # all but the null block
    assert set(sizes["connector_scheduler"].values()) == {0}
    assert set(sizes["connector_worker"].values()) == {0}
    dump = sizes["dump_scheduler"]
    assert dump["requests"] == dump["ready"] == dump["batches"] == dump["slots_in_use"] == 0
    assert dump["live_owned_handles"] == dump["live_borrowed_handles"] == 0
    final = local_run["final_stats"]
    assert final["pinned_blocks"] == final["unpinned_blocks"] > 0
    assert final["delayed_frees"] == final["finished_sending"] > 0


def test_new_process_hits_through_multiconnector(
    restart_run: dict[str, Any], local_run: dict[str, Any], plain_run: dict[str, Any]
) -> None:
    r2 = restart_run["r2"]
    assert r2["num_cached_tokens"] == prefix_hit(restart_run) > 0
    assert r2["stats"]["hit_tokens"] == prefix_hit(restart_run)
    # First load of a fresh process: no layer has shown its hook yet -> loaded in full
    # in start_load_kv (never waited for by a hook that might not fire).
    assert r2["stats"]["loads_sync_fallback"] == 1
    assert r2["tokens"] == plain_run["r2"]["tokens"]
    # the values r2_again loaded, with its split: its output, bit for bit (and its oracle's)
    assert r2["num_cached_tokens"] == local_run["r2_again"]["num_cached_tokens"]
    same_output(r2, local_run["r2_again"])


def test_multiconnector_counts_delayed_frees(restart_run: dict[str, Any]) -> None:
    r4 = restart_run["r4"]["stats"]
    block = restart_run["vllm"]["block_size"]
    assert r4["dump_blocks"] == whole_units(restart_run, len(R4)) // block >= 2
    final = restart_run["final_stats"]
    # Every request our child delayed was reported finished_sending exactly once, and
    # MultiConnector freed it: no request left in the scheduler, every block free.
    assert final["delayed_frees"] == final["finished_sending"] == 1
    assert restart_run["flush_last"]["reset"]
    sizes = restart_run["sizes"]
    assert sizes["scheduler_requests"] == 0
    assert sizes["free_blocks"] == sizes["total_blocks"] - 1
    assert set(sizes["connector_scheduler"].values()) == {0}
    assert set(sizes["connector_worker"].values()) == {0}


@pytest.fixture(scope="module")
def multiprocess_run(
    tiny_qwen3_sharp: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("ucm_mp")
    spec = {
        "model": str(tiny_qwen3_sharp),
        "dtype": "float32",
        "multiprocess": True,
        "extra": {"store": "local", "local_path": str(tmp / "store")},
        "steps": [
            gen("r1", R1),
            {"op": "flush", "name": "flush1"},
            gen("r2", R2),
            gen("r2_recomputed", R2, salt="recompute-r2"),
            *oracle_steps("r2_oracle", R1, R2, hit_of="r2"),
            {"op": "flush", "name": "flush2"},
        ],
    }
    return run_child(spec, tmp, "multiprocess")


def test_multiprocess_layout_hits_and_releases_blocks(multiprocess_run: dict[str, Any]) -> None:
    # reset_prefix_cache succeeds only once no block is held: delayed frees and pins were
    # reported back from the worker process and released by the engine-core process.
    assert multiprocess_run["flush1"]["reset"]
    # (worker processes: the child cannot read the layout; the engine's block size it can)
    hit = whole_units(multiprocess_run, len(PREFIX))
    assert multiprocess_run["r2"]["num_cached_tokens"] == hit > 0
    assert multiprocess_run["r2_recomputed"]["num_cached_tokens"] == 0
    assert multiprocess_run["r2"]["tokens"] == multiprocess_run["r2_recomputed"]["tokens"]
    assert_same_as_oracle(multiprocess_run["r2"], multiprocess_run["r2_oracle"])
    assert multiprocess_run["flush2"]["reset"]
