"""Every exception in a load becomes a load error (vLLM recomputes), counted, logged once.

A load runs on load threads and is waited for inside vLLM's forward (layerwise) or between
steps (async). Before, only ``StoreError`` became a load error: a store raising anything
else, or a torch copy error, escaped ``wait_for_layer_load`` and killed the engine (vLLM's
own hooks) or made a wrapped layer a silent pass-through with its KV not loaded. Each test
plays engine steps on the real local store with one fault injected, and checks that the
step completes, the affected blocks are reported, the exception is counted in
``load_exceptions`` and logged once per cause however often it repeats.
"""

from __future__ import annotations

import logging

import pytest

from tests.support.connector_harness import (  # store_fixture: the ``store`` fixture
    ControlledLocalStore,
    Harness,
    Req,
    blocks,
    new_req,
    store_fixture,  # noqa: F401
)
from tests.support.connector_harness import sched_output as so
from tests.test_connector_flow import TOKENS, _async_load, prefill
from ucm_patch import connector
from ucm_patch.connector import UCMPatchConnector
from ucm_patch.connector.rows import RowLoader

LOGGER = "vllm.ucm_patch.connector.worker_side"  # the connector logs under vLLM's logger


def _raise_runtime_error(*_args: object) -> list[bool]:
    """In place of the store's read that loads use on a KV cache in host memory
    (``get_many_scattered``: the store writes the pages into their blocks)."""
    raise RuntimeError("store exploded")


def _layerwise_load(h: Harness, rid: str, ids: list[int]) -> set[int]:
    """Schedule ``rid`` with a 12-token hit into ``ids``; return the reported error blocks."""
    req = Req(rid, TOKENS)
    assert h.sched.get_num_new_matched_tokens(req, 0) == (12, False)
    h.sched.update_state_after_alloc(req, blocks(ids), 12)
    h.step(so([new_req(rid, [ids], 12)], scheduled={rid: 1}))
    return h.worker.get_block_ids_with_load_errors()


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_store_raising_runtime_error_fails_the_layerwise_load_once_logged(
    store: ControlledLocalStore,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = Harness(UCMPatchConnector)
    prefill(h, "a", [1, 2, 3, 4])
    monkeypatch.setattr(store, "get_many_scattered", _raise_runtime_error)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert _layerwise_load(h, "b", [5, 6, 7, 8]) == {5, 6, 7}
        assert _layerwise_load(h, "c", [9, 10, 11, 12]) == {9, 10, 11}
    stats = connector.stats()
    assert stats["load_exceptions"] == 2 * len(h.worker.layout.rows)  # every row of both
    assert stats["load_failed_requests"] == 2
    lines = _errors(caplog)
    assert len(lines) == 1, lines  # once per cause, not per row or request
    assert "RuntimeError: store exploded" in lines[0]


def test_exception_in_the_row_loader_never_reaches_the_forward(
    store: ControlledLocalStore,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = Harness(UCMPatchConnector)
    prefill(h, "a", [1, 2, 3, 4])
    h.step(so())  # the fresh worker has seen every layer's hook: loads are layerwise

    def broken(self: RowLoader, layer_name: str) -> None:
        raise IndexError(f"no row for {layer_name}")

    monkeypatch.setattr(RowLoader, "on_layer", broken)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert _layerwise_load(h, "b", [5, 6, 7, 8]) == {5, 6, 7}
    assert connector.stats()["load_exceptions"] >= 1
    lines = _errors(caplog)
    assert len(lines) == 1 and "wait_for_layer_load raised IndexError" in lines[0], lines


def test_store_raising_runtime_error_fails_the_async_load_once_logged(
    store: ControlledLocalStore,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = Harness(UCMPatchConnector, {"load_mode": "async"})
    prefill(h, "a", [1, 2, 3, 4])
    monkeypatch.setattr(store, "get_many_scattered", _raise_runtime_error)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        _async_load(h, "b", [5, 6, 7, 8])
        _async_load(h, "c", [9, 10, 11, 12])
    assert {r for s in h.recved for r in s} == {"b", "c"}
    assert {r for s in h.failed_recv for r in s} == {"b", "c"}  # vLLM recomputes both
    assert connector.stats()["load_exceptions"] == 2  # one per request (first row fails)
    lines = _errors(caplog)
    assert len(lines) == 1 and "RuntimeError: store exploded" in lines[0], lines


def test_wrong_sized_page_view_copy_error_is_a_load_error(
    store: ControlledLocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch error in the copy into vLLM's blocks (here: a destination view of the
    wrong width) fails the load instead of escaping the load thread. The path of a KV
    cache on a device (through a host buffer, then ``index_copy_``), taken here by
    dropping the rows' host copy plans."""
    h = Harness(UCMPatchConnector)
    prefill(h, "a", [1, 2, 3, 4])
    h.step(so())
    ws = h.worker._worker_side
    ws.loads.plans = [None] * len(ws.views)
    views = ws.views
    monkeypatch.setattr(views[0], "scatter", _raise_copy_error)
    assert _layerwise_load(h, "b", [5, 6, 7, 8]) == {5, 6, 7}
    assert connector.stats()["load_exceptions"] == 1


def _raise_copy_error(*_args: object) -> None:
    raise RuntimeError("index_copy_(): source and destination shapes differ")


def test_failed_async_load_is_not_offered_again(
    store: ControlledLocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM puts a request whose async load failed back in the waiting queue and asks for a
    hit again: offering it would loop lookup -> load -> fail forever on a store that
    fails every read (seen on real vLLM: the engine spun on one request)."""
    h = Harness(UCMPatchConnector, {"load_mode": "async"})
    prefill(h, "a", [1, 2, 3, 4])
    monkeypatch.setattr(store, "get_many_scattered", _raise_runtime_error)
    _async_load(h, "b", [5, 6, 7, 8])
    assert {r for s in h.failed_recv for r in s} == {"b"}
    assert h.sched.get_num_new_matched_tokens(Req("b", TOKENS), 0) == (0, False)
    assert h.sched.get_num_new_matched_tokens(Req("c", TOKENS), 0) == (12, True)
    h.sched.request_finished(Req("b", TOKENS), [])
    assert h.sched._sched_side.internal_sizes()["load_failed"] == 0  # forgotten at finish
