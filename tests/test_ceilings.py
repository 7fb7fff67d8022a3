"""Every record ends at a ceiling, is checkable at apply time, and says which hooks it adds.

The ceiling rule (issue #16): a range ends at the first minor after the newest release the
record was verified on, so a newer release finds the newest era ``untested-version``
instead of wrapping code nobody has read. The newest verified releases are the ones the
verification engines read (tools.verify.vllm / ascend), not numbers typed here.
"""

from __future__ import annotations

import sys
import types

import pytest
from packaging.version import Version

from tools.verify import ascend_report
from tools.verify import vllm as verify_vllm
from ucm_patch.patches import all_patch_sets
from ucm_patch.records import HOOKS
from ucm_patch.source_checks import apply_time_params

RECORDS = [r for ps in all_patch_sets() for r in ps.records]


def _next_minor(version: str) -> Version:
    v = Version(version)
    return Version(f"{v.major}.{v.minor + 1}")


NEWEST_VLLM = max(Version(v) for _, v in verify_vllm.VERSIONS)


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.id)
def test_every_range_has_a_ceiling(record):
    for dist, ceiling in record.ceiling.items():
        assert ceiling is not None, f"{record.id}: requires[{dist!r}] has no upper bound"


@pytest.mark.parametrize("record", [r for r in RECORDS if "vllm" in r.requires], ids=lambda r: r.id)
def test_vllm_ceilings_stop_after_the_newest_verified_release(record):
    ceiling = Version(record.ceiling["vllm"])
    assert ceiling <= _next_minor(str(NEWEST_VLLM)), (
        f"{record.id}: ceiling <{ceiling} runs past the newest verified vLLM {NEWEST_VLLM}"
    )


def test_the_newest_vllm_eras_reach_the_ceiling():
    """At least one era of every vLLM patch still in use reaches the newest release."""
    newest = {}
    for r in RECORDS:
        if "vllm" in r.requires and not r.retired:
            c = Version(r.ceiling["vllm"])
            newest[r.name] = max(newest.get(r.name, c), c)
    assert newest and all(c == _next_minor(str(NEWEST_VLLM)) for c in newest.values()), newest


def _newest_ascend() -> Version:
    """The newest vLLM-Ascend release verified from source (PyPI or git tag; a main-branch
    snapshot is not a release)."""
    entries = ascend_report.load_data()["versions"].values()
    return max(Version(e["label"].lstrip("v")) for e in entries if e["kind"] != "main")


@pytest.mark.parametrize(
    "record", [r for r in RECORDS if "vllm-ascend" in r.requires], ids=lambda r: r.id
)
def test_ascend_ceilings_stop_after_the_newest_verified_release(record):
    newest = _newest_ascend()
    ceiling = Version(record.ceiling["vllm-ascend"])
    assert ceiling <= _next_minor(newest.base_version), (
        f"{record.id}: ceiling <{ceiling} runs past the newest verified vLLM-Ascend {newest}"
    )


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.id)
def test_every_record_has_a_parameter_check_for_apply_time(record):
    """The installer checks the live target against these before wrapping (a copied or
    by-name-imported function is checked through the source it is a copy of)."""
    assert apply_time_params(record.target, record.expect), (
        f"{record.id}: no `leading` check and no `signature` check on its target, on the "
        "function an `assigned` check copies there or on the name a `binding` check imports: "
        "its wrapper's argument positions cannot be checked against the live target"
    )


@pytest.mark.parametrize("record", [r for r in RECORDS if r.hooks], ids=lambda r: r.id)
def test_layer_records_accept_the_hooks_they_may_be_asked_for(record, monkeypatch):
    """A record may be built for any non-empty subset of its hooks (upstream made the
    others): its factory must accept ``hooks=`` for each."""
    # The vLLM-Ascend 0.18 factory asks vllm_ascend.utils.vllm_version_is (apply time).
    utils = types.ModuleType("vllm_ascend.utils")
    utils.vllm_version_is = lambda version: False  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm_ascend", types.ModuleType("vllm_ascend"))
    monkeypatch.setitem(sys.modules, "vllm_ascend.utils", utils)
    assert set(record.hooks) <= set(HOOKS)
    for hook in record.hooks:
        wrapper = record.make_wrapper(hooks=(hook,))
        assert callable(wrapper)
