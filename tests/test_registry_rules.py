"""Registry rules that need no target import: supersedes, duplicate ids, lazy gating."""

from __future__ import annotations

import pytest

from ucm_patch.records import PatchRecord
from ucm_patch.registry import Registry


def _rec(name: str, era: str, requires: str = ">=1", **kw) -> PatchRecord:
    return PatchRecord(
        name,
        era,
        "ucm_no_such_module_x:f",
        {"wrapt": requires},
        lambda: lambda w, i, a, k: w(*a, **k),
        why="test record here",
        upstream="test only here",
        removal="never at all",
        **kw,
    )


def test_superseded_record_is_skipped_with_the_reason() -> None:
    vllm_rec = _rec("gdn_layerwise", "vllm-0.22")
    ascend_rec = _rec("gdn_layerwise", "ascend-0.21", supersedes=("gdn_layerwise@vllm-0.22",))
    reg = Registry([vllm_rec, ascend_rec])
    reg.activate()
    states = {r["id"]: (r["state"], r["reason"]) for r in reg.report()}
    assert states["gdn_layerwise@ascend-0.21"][0] == "waiting-for-import"
    state, reason = states["gdn_layerwise@vllm-0.22"]
    assert state == "skipped-version" and reason.startswith("superseded by gdn_layerwise@ascend")


def test_out_of_range_superseder_supersedes_nothing() -> None:
    vllm_rec = _rec("gdn_layerwise", "vllm-0.22")
    ascend_rec = _rec(
        "gdn_layerwise", "ascend-0.21", requires=">=999", supersedes=("gdn_layerwise@vllm-0.22",)
    )
    reg = Registry([vllm_rec, ascend_rec])
    reg.activate()
    states = {r["id"]: r["state"] for r in reg.report()}
    assert states == {
        "gdn_layerwise@vllm-0.22": "waiting-for-import",
        "gdn_layerwise@ascend-0.21": "skipped-version",
    }


def test_duplicate_record_ids_are_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate patch record id 'a@x'"):
        Registry([_rec("a", "x"), _rec("a", "x")])
