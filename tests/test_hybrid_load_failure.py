"""``hybrid_load_failure``'s wrapper on a stand-in scheduler (real vLLM 0.26 and 0.29 run
it in tests/test_older_release_e2e.py).

Several KV-cache groups: a request with a failed block in any group goes back to token 0
(vLLM 0.30's path), the shared null block never counts, and the return value is what
vLLM's method returns. One group: vLLM's own method, untouched.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import wrapt

from ucm_patch.patches.vllm import hybrid_load_failure as hlf

NULL = 0


class Manager:
    """``kv_cache_manager``: block ids per request, one list per group; a null block."""

    def __init__(self, blocks: dict[str, tuple[list[int], ...]]) -> None:
        self.blocks = blocks
        self.block_pool = types.SimpleNamespace(null_block=types.SimpleNamespace(block_id=NULL))

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return self.blocks[req_id]


def request(rid: str, computed: int) -> Any:
    return types.SimpleNamespace(request_id=rid, num_computed_tokens=computed)


def scheduler(groups: int, blocks: dict[str, tuple[list[int], ...]]) -> Any:
    """A class whose method is wrapped as the registry wraps it, and an instance."""
    calls: list[tuple[Any, ...]] = []

    def original(self, requests, invalid_block_ids, num_scheduled_tokens, evict_blocks=True):
        calls.append((list(requests), invalid_block_ids, num_scheduled_tokens, evict_blocks))
        return "vllm's own"

    wrapped = wrapt.FunctionWrapper(original, hlf.make_invalid_blocks_wrapper())
    klass = type("Scheduler", (), {"_update_requests_with_invalid_blocks": wrapped})
    sched = klass()
    sched.kv_cache_config = types.SimpleNamespace(kv_cache_groups=[object()] * groups)
    sched.kv_cache_manager = Manager(blocks)
    sched.calls = calls
    return sched


# Attention group 0 (one block per 16 tokens), GDN group 1 (null but for the state block).
BLOCKS = {
    "hit": ([1, 2, 3, 4], [NULL, NULL, NULL, 5]),  # its load wrote 3, 4 and state 5
    "other": ([1, 2, 6], [NULL, NULL, 7]),  # shares the local prefix 1, 2: untouched
    "null_only": ([8], [NULL]),
}


@pytest.mark.parametrize("invalid", [{3, 4, 5}, {5}, {4}])
@pytest.mark.parametrize("keywords", [False, True])
def test_several_groups_recompute_the_whole_request(invalid: set[int], keywords: bool) -> None:
    sched = scheduler(2, BLOCKS)
    reqs = [request("hit", 64), request("other", 48), request("null_only", 16)]
    args: tuple[Any, ...] = (reqs, invalid | {NULL}, {"other": 16})
    if keywords:  # vLLM's call: evict_blocks by keyword
        out = sched._update_requests_with_invalid_blocks(*args, evict_blocks=True)
    else:  # a trampoline passes every parameter positionally
        out = sched._update_requests_with_invalid_blocks(*args, True)
    assert sched.calls == []  # vLLM's single-group code would raise ValueError here
    affected, tokens, evict = out
    assert affected == {"hit"}
    assert tokens == 64  # everything it had "computed", the loaded tokens included
    assert evict == {1, 2, 3, 4, 5}  # every block of it but the null block
    assert [r.num_computed_tokens for r in reqs] == [0, 48, 16]


def test_a_waiting_async_load_evicts_nothing_and_counts_scheduled_tokens_out() -> None:
    sched = scheduler(3, {"r": ([1], [NULL], [2])})
    req = request("r", 40)
    affected, tokens, evict = sched._update_requests_with_invalid_blocks(
        iter([req]), {2}, {"r": 8}, evict_blocks=False
    )
    assert (affected, tokens, evict) == ({"r"}, 32, set())
    assert req.num_computed_tokens == 0


def test_nothing_failed_changes_nothing() -> None:
    sched = scheduler(2, BLOCKS)
    reqs = [request("hit", 64), request("other", 48)]
    assert sched._update_requests_with_invalid_blocks(reqs, {99}, {}) == (set(), 0, set())
    assert [r.num_computed_tokens for r in reqs] == [64, 48]


def test_one_group_is_vllms_own_method() -> None:
    sched = scheduler(1, {"r": ([1, 2],)})
    reqs = [request("r", 32)]
    assert sched._update_requests_with_invalid_blocks(reqs, {2}, {}, evict_blocks=False) == (
        "vllm's own"
    )
    assert sched.calls == [(reqs, {2}, {}, False)]
    assert reqs[0].num_computed_tokens == 32


def test_the_record_covers_the_hybrid_releases_before_0_30_and_is_retired_by_0_30() -> None:
    """The connector serves hybrid hits on 0.22 (with the hybrid_async_load patch) and
    from 0.26 (states found by position to 0.28, offered from 0.29), and every release
    before 0.30 unpacks one group (0.23 - 0.25 refuse hybrid hits: never met there)."""
    (record,) = hlf.RECORDS
    assert record.requires == {"vllm": ">=0.22,<0.30"}
    assert record.retired and record.default and not record.hooks
    assert record.expect[0].args[0] == hlf.PARAMS
