"""Every record ends at a ceiling, is checkable at apply time, and says which hooks it adds.

The ceiling rule (issue #16): a range ends at the first minor after the newest release the
record was verified on, so a newer release finds the newest era ``untested-version``
instead of wrapping code nobody has read. The newest verified releases are the ones the
verification engines read (ucm_patch.verify.vllm / ascend), not numbers typed here.
"""

from __future__ import annotations

import pytest
from packaging.version import Version

from ucm_patch.expect import leading_params
from ucm_patch.patches import all_patch_sets
from ucm_patch.records import HOOKS
from ucm_patch.verify import vllm as verify_vllm

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


# vLLM-Ascend records state their parameters as `signature` checks on the code they read,
# not always on their own target (binding records wrap a by-name import): issue #16 work
# in progress gives each one an own-target check; until then they are checked in source
# only (ucm_patch.verify.ascend).
@pytest.mark.parametrize("record", [r for r in RECORDS if "vllm" in r.requires], ids=lambda r: r.id)
def test_every_record_has_a_parameter_check_for_apply_time(record):
    exact = [c for c in record.expect if c.kind == "signature" and c.args[0] == record.target]
    assert leading_params(record.expect) is not None or exact, (
        f"{record.id}: no `leading` / own-target `signature` check: its wrapper's argument "
        "positions cannot be checked against the live target"
    )


@pytest.mark.parametrize("record", [r for r in RECORDS if r.hooks], ids=lambda r: r.id)
def test_layer_records_accept_the_hooks_they_may_be_asked_for(record):
    """A record may be built for any non-empty subset of its hooks (upstream made the
    others): its factory must accept ``hooks=`` for each."""
    assert set(record.hooks) <= set(HOOKS)
    for hook in record.hooks:
        wrapper = record.make_wrapper(hooks=(hook,))
        assert callable(wrapper)
