"""The vLLM-Ascend stand-ins (tests/standins) cannot drift from the releases they imitate.

Each stand-in era folder carries a ``.dist-info`` naming the release it imitates. Every fact
the patch records rely on is extracted from the stand-in with the same code that reads the
real release (scripts/verify_ascend_targets.py) and compared with the facts stored for that
release in scripts/data/ascend_signatures.json (re-verified against the PyPI download by
tests/test_patches_ascend_sources.py): method signatures, the GDN KV-cache expression,
where upstream creates ``reshape_cache_event``, SFA's mlapo branch, the set of by-name hook
bindings; and every record in range for that release passes its source checks on the
stand-in. A stand-in edited into something the real release is not fails here.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tools.verify import ascend as verify
from tools.verify import ascend_report

STANDINS = REPO / "tests" / "standins"
ERAS = sorted(p.name for p in STANDINS.glob("ascend_*") if p.is_dir())


def standin_of(root: Path) -> tuple[str, set[str] | None]:
    """The source a stand-in imitates (its data-file label) and, for a partial stand-in, the
    modules it imitates (``STANDIN_OF``: the label, then module names; the other modules
    come from another stand-in). None: the whole release (its ``.dist-info`` version)."""
    spec = root / "STANDIN_OF"
    if spec.exists():
        label, *modules = spec.read_text().split()
        return label, set(modules)
    return standin_version(root), None


def standin_version(root: Path) -> str:
    (info,) = root.glob("vllm_ascend-*.dist-info")
    for line in (info / "METADATA").read_text().splitlines():
        if line.startswith("Version: "):
            return line.removeprefix("Version: ").strip()
    raise AssertionError(f"{info}/METADATA has no Version")


def drift(root: Path) -> list[str]:
    """Every difference between a stand-in tree and the real release it names."""
    version, scope = standin_of(root)
    data = ascend_report.load_data()["versions"]
    if version not in data:
        return [f"{root.name}: no verified facts for vllm-ascend {version}"]
    real: dict[str, Any] = data[version]["facts"]
    tree = verify.Tree(root)
    if scope is not None:
        missing = sorted(m for m in scope if tree.module(m) is None)
        if missing:
            return [f"{root.name}: STANDIN_OF names modules it lacks: {missing}"]
    problems: list[str] = []
    for code, params in real["signatures"].items():
        fn = tree.find(code)
        if fn is not None and verify.params(fn) != params:
            problems.append(f"signature {code}: {verify.params(fn)} != real {params}")
    for code, expr in real["locals"].items():
        fn = tree.find(code)
        if fn is not None and verify.local_expr(fn, "self_kv_cache") != expr:
            problems.append(f"kv-cache expression in {code} != real {expr!r}")
    for code, cond in real["native_event"].items():
        if tree.find(code) is not None and verify.native_event(tree, code) != cond:
            problems.append(
                f"native event in {code}: {verify.native_event(tree, code)!r} != {cond!r}"
            )
    for code, branch in real["mlapo"].items():
        fn = tree.find(code)
        if fn is not None and verify.mlapo(fn) != branch:
            problems.append(f"mlapo branch of {code}: {verify.mlapo(fn)} != {branch}")
    found, _ = verify.hook_bindings_everywhere(tree)
    bindings = sorted(f"{m}:{n}" for m, n in found)
    want = [b for b in real["bindings"] if scope is None or b.partition(":")[0] in scope]
    if bindings != want:
        problems.append(f"hook bindings {bindings} != real {want}")
    for record in verify.RECORDS:
        if verify.in_range(record, version) and (scope is None or record.module in scope):
            for check in verify.EXPECT[record.id]:
                if scope is not None and _outside(check, scope):
                    continue  # checked on the stand-in that module comes from
                why = verify.run_check(tree, check)
                if why is not None:
                    problems.append(f"{record.id}: {why}")
    return problems


def _outside(check: Any, scope: set[str]) -> bool:
    """A ``signature`` check of a function outside a partial stand-in's modules."""
    return check.kind == "signature" and str(check.args[0]).partition(":")[0] not in scope


def test_there_are_stand_ins_for_each_layout() -> None:
    assert [standin_of(STANDINS / e)[0] for e in ERAS] == [
        "0.11.0",
        "0.13.0",
        "0.18.0",
        "0.23.0",
        "main@182b75ea84ff",
    ]


@pytest.mark.parametrize("era", ERAS)
def test_stand_in_matches_the_real_release(era: str) -> None:
    assert drift(STANDINS / era) == []


@pytest.mark.parametrize("era", ERAS)
def test_stand_in_covers_every_record_in_range(era: str) -> None:
    """Each record in range has its target module in the stand-in (so the eras test runs it)."""
    root = STANDINS / era
    version, scope = standin_of(root)
    tree = verify.Tree(root)
    missing = [
        r.id
        for r in verify.RECORDS
        if verify.in_range(r, version)
        and (scope is None or r.module in scope)
        and tree.module(r.module) is None
    ]
    assert missing == []
    if scope is not None:  # a partial stand-in still carries every in-range record's module
        assert any(verify.in_range(r, version) and r.module in scope for r in verify.RECORDS)


def test_a_drifted_stand_in_is_caught(tmp_path: Path) -> None:
    root = tmp_path / "ascend_0_23"
    shutil.copytree(STANDINS / "ascend_0_23", root)
    attn = root / "vllm_ascend" / "attention" / "attention_v1.py"
    attn.write_text(
        attn.read_text().replace(
            "        output: torch.Tensor,\n", "        out: torch.Tensor,\n", 1
        )
    )
    gdn = root / "vllm_ascend" / "ops" / "gdn.py"
    gdn.write_text(
        gdn.read_text().replace(
            "self_kv_cache = self.kv_cache\n", "self_kv_cache = self.kv_cache[0]\n"
        )
    )
    problems = drift(root)
    code = "vllm_ascend.attention.attention_v1:AscendAttentionBackendImpl.reshape_and_cache"
    assert any(p.startswith(f"signature {code}") for p in problems), problems
    assert any("kv-cache expression in vllm_ascend.ops.gdn" in p for p in problems), problems
    assert any(p.startswith("reshape_cache_event@ascend-0.16: ") for p in problems), problems
