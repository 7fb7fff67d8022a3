"""UCMPatchConnector with tensor parallelism (TP=2) on real vLLM CPU 0.32.

Three fresh vLLM processes, each with two worker processes (vLLM's multiprocessing
executor; the engine core and the connector's scheduler side stay in the child):

* ``dump``: request 1 computes and dumps its full blocks; each TP rank stores its own
  shard of every page under its own key (``...t0`` / ``...t1``);
* ``load``: a fresh process on the same store: request 2 (same prefix) hits every full
  block of the prefix, loads both ranks' shards; its tokens equal a recomputation in the
  same process (other ``cache_salt``: a miss), and its tokens and logprobs equal, bit for
  bit, the hit's exact oracle in the same process (vLLM's own prefix cache seeded, under a
  third salt, with the hit's prefix computed as the dump computed it; ``oracle_steps`` in
  tests/support/connector_child.py): the same KV bits, the same split of the prefill. A
  recomputation in one pass splits it elsewhere: even in float32 its last bits may differ
  on another CPU;
* ``plain``: request 2 with no connector at all, also TP=2 (the reference tokens).

The counters of loads and dumps live in the worker processes; what the test reads is the
engine's side: ``num_cached_tokens`` per request, the scheduler side's hit counters and
maps, the block pool, and the store itself (every key the scheduler side planned, for
both ranks, is present). float32: spawned CPU workers die of SIGILL in AMX code with bf16
on this machine kind. ``VLLM_CPU_OMP_THREADS_BIND="0|1"``: one core per rank (vLLM's
default binding wants one NUMA node per rank).
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
TP = 2

pytestmark = pytest.mark.vllm


def gen(name: str, ids: list[int], salt: str | None = None) -> dict[str, Any]:
    return {"op": "gen", "name": name, "prompt": ids, "salt": salt, "max_tokens": 8}


def spec(model: Path, extra: dict[str, Any] | None, steps: list[dict[str, Any]]) -> dict:
    return {
        "model": str(model),
        "extra": extra,
        "dtype": "float32",
        "tp": TP,
        "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        "record_dump_keys": True,
        "steps": steps,
    }


@pytest.fixture(scope="module")
def runs(tiny_qwen3_sharp: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("ucm_tp")
    extra = {"store": "local", "local_path": str(tmp / "store")}
    dump = [
        gen("r1", R1),
        {"op": "flush", "name": "flush"},
        {"op": "store_keys", "name": "keys"},
    ]
    load = [
        gen("r2", R2),
        gen("r2_recomputed", R2, salt="recompute"),
        *oracle_steps("r2_oracle", R1, R2, hit_of="r2", max_tokens=8),
        {"op": "flush", "name": "flush"},
        {"op": "sizes", "name": "sizes"},
    ]
    return {
        "dump": run_child(spec(tiny_qwen3_sharp, extra, dump), tmp, "tp_dump"),
        "load": run_child(spec(tiny_qwen3_sharp, extra, load), tmp, "tp_load"),
        "plain": run_child(spec(tiny_qwen3_sharp, None, [gen("r2", R2)]), tmp, "tp_plain"),
    }


def test_each_rank_stores_its_shard_of_every_dumped_block(runs: dict[str, Any]) -> None:
    dump = runs["dump"]
    block = dump["vllm"]["block_size"]
    unit = dump["layout"]["unit"]
    rows = sum(g["rows"] for g in dump["layout"]["groups"])
    full_blocks = whole_units(dump, len(R1)) // block
    assert full_blocks >= 2
    assert dump["r1"]["stats"]["dump_blocks"] == full_blocks
    values = whole_units(dump, len(R1)) // unit * rows  # one per chunk and row
    keys = dump["keys"]
    assert sorted(keys) == [str(rank) for rank in range(TP)]
    for rank in keys.values():
        assert rank == {"expected": values, "present": values}
    assert dump["flush"]["reset"], "blocks still held after the dumps finished"


def test_fresh_process_hits_and_equals_the_reference(runs: dict[str, Any]) -> None:
    load = runs["load"]
    hit = whole_units(load, len(PREFIX))
    r2 = load["r2"]
    assert r2["num_cached_tokens"] == hit > 0
    assert r2["stats"]["hit_tokens"] == hit
    assert r2["stats"]["hit_requests"] == 1
    recomputed = load["r2_recomputed"]
    assert recomputed["num_cached_tokens"] == 0
    plain = runs["plain"]["r2"]
    assert plain["num_cached_tokens"] == 0
    assert r2["tokens"] == recomputed["tokens"] == plain["tokens"]
    assert_same_as_oracle(r2, load["r2_oracle"])


def test_tp_run_releases_every_block(runs: dict[str, Any]) -> None:
    load = runs["load"]
    assert load["flush"]["reset"]
    sizes = load["sizes"]
    assert sizes["scheduler_requests"] == 0
    assert sizes["free_blocks"] == sizes["total_blocks"] - 1  # all but the null block
    assert set(sizes["connector_scheduler"].values()) == {0}
    final = load["final_stats"]  # this process's counters: the scheduler side's
    assert final["delayed_frees"] >= 1
    # A pin is dropped only once *both* workers reported its step's dumps done.
    assert final["pinned_blocks"] == final["unpinned_blocks"] > 0
