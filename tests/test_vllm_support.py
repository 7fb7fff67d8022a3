"""What the connector says at start about the running vLLM (connector/vllm_support.py).

The installed vLLM (0.32) offers boundary states and seeds NONE_HASH from a fixed value
for sha256; the older releases' behaviour is checked against their own module shapes
here and for real by the runtime matrix (scripts/matrix_child.py, make test's 0.22.1 run).
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest

from ucm_patch.connector import vllm_support

OLD_UTILS = SimpleNamespace()  # vLLM < 0.29: no resolve_none_hash_seed
NEW_UTILS = SimpleNamespace(resolve_none_hash_seed=lambda fn: "")


@pytest.mark.parametrize(
    ("seed", "utils", "algo", "warned"),
    [
        (None, OLD_UTILS, "sha256", True),
        ("0", OLD_UTILS, "sha256", False),
        (None, NEW_UTILS, "sha256", False),
        (None, NEW_UTILS, "sha256_cbor", False),
        (None, NEW_UTILS, "xxhash", True),
        ("7", NEW_UTILS, "xxhash_cbor", False),
    ],
)
def test_random_hash_seed_is_named_with_its_fix(monkeypatch, seed, utils, algo, warned):
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    reason = vllm_support.random_hash_seed_reason(utils, algo)
    if warned:
        assert reason is not None
        assert "PYTHONHASHSEED" in reason and "PYTHONHASHSEED=0" in reason
        assert ("< 0.29" in reason) == (utils is OLD_UTILS)
    else:
        assert reason is None


@dataclasses.dataclass
class _OutputWithoutOffers:  # a SchedulerOutput before vLLM 0.29
    num_scheduled_tokens: dict


ZEROING = """
class Scheduler:
    def __init__(self):
        self._skip_zero_block_ids: set[int] = set()
"""
SPLIT_0_26 = """
    def schedule(self):
        if self.need_mamba_block_aligned_split and not load_kv_async:
            num_new_tokens = self._mamba_block_aligned_split(request, num_new_tokens)
"""
SPLIT_0_28 = """
    def schedule(self):
        if load_kv_async:
            num_new_tokens = 0
        elif defer_prefills:
            pass
        else:
            if self.need_mamba_block_aligned_split:
                num_new_tokens = self._mamba_block_aligned_split(request, num_new_tokens)
"""
SPLIT_0_22 = """
    def schedule(self):
        if load_kv_async:
            num_new_tokens = 0
        else:
            num_new_tokens = 5
        if self.need_mamba_block_aligned_split:
            num_new_tokens = self._mamba_block_aligned_split(request, num_new_tokens)
"""
NO_ZEROING = "\nclass Scheduler:\n    pass\n"


@pytest.mark.parametrize(
    ("source", "missing"),
    [
        (ZEROING + SPLIT_0_26, []),  # 0.26: the split skipped for an async load
        (ZEROING + SPLIT_0_28, []),  # 0.27+: the split only where the load is not async
        (NO_ZEROING + SPLIT_0_26, ["_skip_zero_block_ids"]),  # 0.23 - 0.25: zeroing races
        (NO_ZEROING + SPLIT_0_22, [vllm_support.SPLIT_MARK, "_skip_zero_block_ids"]),  # 0.22
        (ZEROING + SPLIT_0_22, [vllm_support.SPLIT_MARK]),
        ("not python (", [vllm_support.SPLIT_MARK, "_skip_zero_block_ids"]),
    ],
)
def test_without_offers_hybrid_hits_need_what_finding_states_by_position_needs(source, missing):
    """Without ``kv_connector_block_state`` the states are found by position only where
    the scheduler's own source never runs the align split for an async load (read from
    its syntax tree, in either form releases wrote it) and keeps the load's blocks out of
    the step's zeroing; elsewhere the reason names what is missing."""
    reason = vllm_support.hybrid_unsupported_reason(
        None, source, _OutputWithoutOffers, hash_block_size=64, state_block_size=64
    )
    if not missing:
        assert reason is None
    else:
        assert reason is not None and vllm_support.HYBRID_RELEASES in reason
        assert "hybrid_async_load patch" in reason and "vLLM >= 0.26" in reason
        for mark in missing:
            assert mark in reason, (mark, reason)
        assert (vllm_support.SPLIT_MARK in reason) == (vllm_support.SPLIT_MARK in missing)


@pytest.mark.vllm
def test_a_scheduler_whose_source_cannot_be_read_refuses_hybrid_hits(monkeypatch):
    """vLLM installed as compiled files only: no mark can be read, so hybrid hits are
    refused with the reason (never an exception at the connector's start)."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    real = inspect.getsource

    def unreadable(obj: object) -> str:
        if obj is Scheduler:
            raise OSError("could not get source code")
        return real(obj)

    monkeypatch.setattr(inspect, "getsource", unreadable)
    reason = vllm_support.hybrid_unsupported_reason(None, None, _OutputWithoutOffers)
    assert reason is not None and "_skip_zero_block_ids" in reason


def test_without_offers_speculative_decoding_and_finer_hash_blocks_are_refused():
    """By design, where a state's block moves (speculative decoding) or is copied into a
    block of its own (a hash block finer than the mamba block: prefix_match_unit), a
    position cannot find it: refused, saying which. With offers (0.29+), both are fine."""
    source = ZEROING + SPLIT_0_26
    spec = SimpleNamespace(speculative_config=object())
    reason = vllm_support.hybrid_unsupported_reason(spec, source, _OutputWithoutOffers, 64, 64)
    assert reason is not None and "speculative decoding" in reason
    reason = vllm_support.hybrid_unsupported_reason(None, source, _OutputWithoutOffers, 16, 64)
    assert reason is not None and "prefix_match_unit" in reason and "16" in reason
    assert vllm_support.hybrid_unsupported_reason(spec, source, _OutputWithoutOffers, 64, 64)
    assert (
        vllm_support.hybrid_unsupported_reason(
            SimpleNamespace(speculative_config=None), source, _OutputWithoutOffers, 64, 64
        )
        is None
    )


@pytest.mark.vllm
def test_installed_vllm_offers_boundary_states():
    assert vllm_support.hybrid_unsupported_reason() is None


@pytest.mark.vllm
def test_vllm_without_state_offers_leaves_a_hybrid_model_idle(monkeypatch, caplog):
    """On a vLLM without ``kv_connector_block_state`` the scheduler side is built with
    nothing to load or dump, and one WARNING says why (the real 0.22.1 run is in the
    runtime matrix)."""
    from ucm_patch.connector import kv_connector

    reason = "hybrid prefix hits need vLLM >= 0.29: test"
    monkeypatch.setattr(vllm_support, "hybrid_unsupported_reason", lambda *a, **k: reason)
    seen = {}

    class Side:
        def __init__(self, layout, config, store, **kw):
            seen.update(kw)

    monkeypatch.setattr("ucm_patch.connector.scheduler_side.SchedulerSide", Side)
    layout = SimpleNamespace(
        mamba_groups=(SimpleNamespace(block_size=64),),
        hash_block_size=64,
        tp_size=1,
        fingerprint="f",
        rows=(),
        groups=(),
        max_value_bytes=0,
    )
    monkeypatch.setattr(kv_connector.KVLayout, "from_vllm", lambda *a: layout)
    monkeypatch.setattr(kv_connector, "shared_store", lambda config, value_bytes=0: object())
    monkeypatch.setattr(kv_connector.KVConnectorBase_V1, "__init__", lambda *a, **k: None)
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}, kv_role="kv_both"),
        cache_config=SimpleNamespace(prefix_caching_hash_algo="sha256"),
        parallel_config=SimpleNamespace(world_size=1),
    )
    with caplog.at_level(logging.WARNING, logger="vllm.ucm_patch.connector.kv_connector"):
        kv_connector.UCMPatchConnector(vllm_config, kv_connector.KVConnectorRole.SCHEDULER)
    assert seen["can_dump"] is False and seen["can_load"] is False
    assert [r.getMessage() for r in caplog.records if reason in r.getMessage()]
