"""UCMPatchConnector as a child of vLLM's real MultiConnector, next to another async saver.

MultiConnector counts, per request, how many children returned True from
``request_finished`` and frees the blocks only after that many ``finished_sending``
reports (its ``extra_async_saves``). UCM #989 fixed exactly this path: a child that delays
the free must say so through *both* ``request_finished`` (non-HMA, when a sibling does not
support HMA) and ``request_finished_all_groups`` (HMA), and must report a request in
``finished_sending`` iff it returned True, exactly once. The sibling here returns True for
every request (like a P/D sender) and reports two steps after it learns of the finish.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

from tests.support.connector_harness import (  # store_fixture: the ``store`` fixture
    BS,
    ControlledLocalStore,
    Harness,
    Req,
    blocks,
    new_req,
    store_fixture,  # noqa: F401
    vllm_config,
)
from tests.support.connector_harness import sched_output as so
from ucm_patch import connector

TOKENS = list(range(100, 113))  # 3 full blocks + 1 token
WAIT_S = 30.0


class _Meta(KVConnectorMetadata):
    pass


class AsyncSibling(KVConnectorBase_V1):
    """Non-HMA sibling: async-saves every request, reports it 2 get_finished calls later."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.countdown: dict[str, int] = {}

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for rid in finished_req_ids:
            self.countdown[rid] = 2
        done = set()
        for rid in list(self.countdown):
            self.countdown[rid] -= 1
            if self.countdown[rid] == 0:
                del self.countdown[rid]
                done.add(rid)
        return done or None, None

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _Meta()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        return True, None


class AsyncSiblingHMA(AsyncSibling, SupportsHMA):
    """The same sibling with hybrid-allocator support (MultiConnector's HMA path)."""

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        return True, None


def multi(sibling: str, hma: bool) -> Harness:
    children = [
        {
            "kv_connector": "UCMPatchConnector",
            "kv_connector_module_path": "ucm_patch.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"chunk_tokens": BS},  # a value per block
        },
        {
            "kv_connector": sibling,
            "kv_connector_module_path": "tests.test_connector_multi",
            "kv_role": "kv_both",
        },
    ]
    cfg = vllm_config({"connectors": children}, connector="MultiConnector", disable_hma=not hma)
    return Harness(MultiConnector, config=cfg)


@pytest.mark.parametrize(("sibling", "hma"), [("AsyncSibling", False), ("AsyncSiblingHMA", True)])
def test_multiconnector_frees_only_after_every_async_saver(
    store: ControlledLocalStore, sibling: str, hma: bool
) -> None:
    h = multi(sibling, hma)
    x = Req("x", TOKENS)  # 3 full blocks: our connector dumps them
    y = Req("y", TOKENS[:3])  # no full block: only the sibling saves it
    for req, ids in ((x, [1, 2, 3, 4]), (y, [5])):
        assert h.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        h.sched.update_state_after_alloc(req, blocks(ids), 0)
    store.hold()  # our dumps of "x" stay in flight
    h.step(
        so([new_req("x", [[1, 2, 3, 4]], 0), new_req("y", [[5]], 0)], scheduled={"x": 13, "y": 3})
    )
    finish = h.sched.request_finished_all_groups if hma else h.sched.request_finished
    ids_x = ([1, 2, 3, 4],) if hma else [1, 2, 3, 4]
    ids_y = ([5],) if hma else [5]
    assert finish(x, ids_x) == (True, None)
    assert finish(y, ids_y) == (True, None)
    ours = h.sched._connectors[0]._sched_side
    assert ours._delayed == set()  # our side forgot both: it decided once, per request
    h.step(so(), finished={"x", "y"})
    for _ in range(4):  # the sibling reports both; our dump of "x" is still held
        h.step(so())
    assert h.all_sent() == ["y"]
    store.release()
    assert connector.wait_for_dumps(WAIT_S)
    for _ in range(3):
        h.step(so())
    # each request freed exactly once, "x" only after both of its async savers
    assert h.all_sent() == ["y", "x"]
    assert connector.stats()["delayed_frees"] == connector.stats()["finished_sending"] == 1
