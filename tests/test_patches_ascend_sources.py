"""Every vLLM-Ascend record against the real vLLM-Ascend sources (scripts/verify_ascend_targets.py).

``test_pypi_releases_reverified`` downloads the PyPI releases (0.11.0, 0.13.0, 0.18.0 and
0.23.0 wheels, the 0.23.0.post1 sdist; cached in .cache/vllm_ascend, network needed on the
first run only) and re-verifies them: their facts and results must equal the data file the
docs matrix and the stand-in tests are built from. The rc tags were verified outside CI
from the public source; their entries are checked for completeness here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, clean_env
from tools.verify import ascend as verify
from tools.verify import ascend_report, ascend_sources
from ucm_patch.source_checks import apply_time_params

RC_TAGS = ("v0.19.1rc1", "v0.20.2rc1", "v0.21.0rc1", "v0.22.1rc1")
STANDIN_0_23 = REPO / "tests" / "standins" / "ascend_0_23"


def test_pypi_releases_reverified() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "verify_ascend_targets.py"),
            "--pypi",
            "all",
            "--check",
        ],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for version, how in ascend_sources.PYPI.items():
        assert f"{version} (pypi-{how}): OK" in proc.stdout.splitlines(), proc.stdout


def test_data_covers_pypi_in_ci_and_rc_tags_outside() -> None:
    versions = ascend_report.load_data()["versions"]
    for version in ascend_sources.PYPI:
        assert versions[version]["ci"] is True and versions[version]["kind"].startswith("pypi-")
    for tag in RC_TAGS:
        assert versions[tag]["ci"] is False and versions[tag]["kind"] == "tag"
    for label, entry in versions.items():
        if not verify.is_main(label):
            assert verify.failures(entry) == [], label


def test_main_drift_is_caught_at_apply_time() -> None:
    """On a main-branch snapshot a record may fail its source checks (nobody released that
    code yet), but only where the installer's apply-time check sees the same change: the
    record then reports ``failed: signature changed`` instead of wrapping code it misreads."""
    mains = {k: e for k, e in ascend_report.load_data()["versions"].items() if verify.is_main(k)}
    assert mains, "no main-branch snapshot verified (scripts/verify_ascend_targets.py --main)"
    by_id = {r.id: r for r in verify.RECORDS}
    for label, entry in mains.items():
        assert all(v.startswith("ok") for v in entry["completeness"].values()), label
        for rid, result in entry["results"].items():
            if not result.startswith("FAIL"):
                continue
            record = by_id[rid]
            live = apply_time_params(record.target, record.expect)
            code = record.target
            got = entry["facts"]["signatures"].get(code)
            assert live and got is not None and all(tuple(got) != p for p, _ in live), (
                f"{label}: {rid} fails in source ({result}) in a way its apply-time check "
                "would not catch"
            )


def test_every_record_is_verified_against_some_release() -> None:
    versions = ascend_report.load_data()["versions"].values()
    never = [r.id for r in verify.RECORDS if not any(e["results"][r.id] == "ok" for e in versions)]
    assert never == []


def test_docs_matrix_is_current() -> None:
    assert ascend_report.doc_section() == ascend_report.render_section(ascend_report.load_data()), (
        "docs/PATCHES.md ascend-matrix is stale: run "
        "python scripts/verify_ascend_targets.py --write-docs"
    )


def test_checks_fail_on_wrong_facts() -> None:
    tree = verify.Tree(STANDIN_0_23)
    C = verify.C
    attn = "vllm_ascend.attention.attention_v1:AscendAttentionBackendImpl.reshape_and_cache"
    assert "has parameters" in verify.run_check(tree, C.signature(attn, ("self", "key")))
    assert "does not exist" in verify.run_check(tree, C.signature(f"{attn}x", ("self",)))
    qwen35 = "vllm_ascend.patch.worker.patch_qwen3_5"
    assert "no module-level" in verify.run_check(
        tree, C.assigned(qwen35, "_GDN_PATCH_TARGET._forward_core", "Other._forward_core")
    )
    assert "does not import" in verify.run_check(tree, C.binding(qwen35, C.SAVE))
    sfa = "vllm_ascend.attention.sfa_v1:AscendSFAImpl.forward"
    assert "mlapo branch waits=True" in verify.run_check(tree, C.mlapo_no_wait(sfa))
    gdn_core = "vllm_ascend.ops.gdn:AscendGatedDeltaNetAttention._forward_core"
    assert "expected" in verify.run_check(
        tree, C.local(gdn_core, "self_kv_cache", "self.kv_cache[0]")
    )


def test_completeness_finds_new_upstream_bindings_and_copies(tmp_path: Path) -> None:
    root = tmp_path / "src"
    shutil.copytree(STANDIN_0_23, root)
    new = root / "vllm_ascend" / "attention" / "new_v1.py"
    new.write_text(
        "from vllm_ascend.attention.utils import maybe_save_kv_layer_to_connector\n"
        "from vllm_ascend.ops.gdn import AscendGatedDeltaNetAttention\n"
        "class NewGatedDeltaNet:\n    pass\n"
        "NewGatedDeltaNet._forward_core = AscendGatedDeltaNetAttention._forward_core\n"
    )
    report = verify.completeness(verify.Tree(root), "0.23.0")
    assert (
        "unpatched binding vllm_ascend.attention.new_v1:maybe_save_kv_layer_to_connector"
        in (report["hook_bindings"])
    )
    assert "NewGatedDeltaNet._forward_core" in report["gdn_cores"]


def test_download_failure_names_the_release_and_the_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ascend_sources, "CACHE", tmp_path)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    try:
        ascend_sources.download("0.13.0")
    except ascend_sources.SourceError as exc:
        text = str(exc)
    else:
        raise AssertionError("download() succeeded without an index")
    assert "vllm-ascend==0.13.0" in text and "https://pypi.org" in text and str(tmp_path) in text
