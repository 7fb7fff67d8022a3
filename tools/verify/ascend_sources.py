"""vLLM-Ascend sources for :mod:`tools.verify.ascend`: each version's ``vllm_ascend`` tree on disk.

* PyPI releases (:data:`PYPI`): downloaded with ``pip download --no-deps`` into
  ``.cache/vllm_ascend/dist`` (x86_64 cp311 wheels for 0.11.0 - 0.23.0; the 0.23.0.post1
  sdist needs ``SOC_VERSION=ascend910b1`` and ``--no-build-isolation`` with setuptools_scm,
  so it is fetched from a small venv under ``.cache/vllm_ascend/dlvenv``) and unpacked into
  ``.cache/vllm_ascend/src/<version>``.
* A source checkout of an rc tag, or a tag or commit exported from a local clone (``git
  archive``) into ``.cache/vllm_ascend/src/<tag>``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "vllm_ascend"

# PyPI releases verified in CI: version -> how pip gets it.
PYPI: dict[str, str] = {
    "0.11.0": "wheel",
    "0.13.0": "wheel",
    "0.18.0": "wheel",
    "0.23.0": "wheel",
    "0.23.0.post1": "sdist",
}
WHEEL_PLATFORMS = (
    "manylinux_2_34_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux2014_x86_64",
)
PIP_TIMEOUT_S = 900


class SourceError(RuntimeError):
    """A source could not be downloaded or unpacked; the message says what to do."""


def _pip_failure(version: str, proc: subprocess.CompletedProcess[str]) -> SourceError:
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
    return SourceError(
        f"pip could not download vllm-ascend=={version} (exit {proc.returncode}). The check "
        f"needs https://pypi.org, or the file already in {CACHE / 'dist'}.\n{tail}"
    )


def _run_pip(cmd: list[str], version: str, env: dict[str, str] | None = None) -> None:
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, env=env, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise SourceError(
            f"pip download of vllm-ascend=={version} took more than {PIP_TIMEOUT_S}s; "
            f"check the network to https://pypi.org (command: {' '.join(cmd)})"
        ) from exc
    if proc.returncode != 0:
        raise _pip_failure(version, proc)


def _download_venv() -> Path:
    """A venv with setuptools_scm for the sdist's metadata step (pip needs it, no isolation)."""
    path = CACHE / "dlvenv"
    py = path / "bin" / "python"
    if not (path / ".ready").exists():
        if path.exists():
            shutil.rmtree(path)
        venv.EnvBuilder(with_pip=True).create(path)
        _run_pip(
            [str(py), "-m", "pip", "install", "-q", "setuptools_scm", "setuptools>=68", "wheel"],
            "(setuptools_scm for the sdist)",
        )
        (path / ".ready").write_text("ok\n")
    return py


def _find_dist(version: str) -> Path | None:
    dist = CACHE / "dist"
    if not dist.is_dir():
        return None
    for f in sorted(dist.iterdir()):
        if f.name.startswith(f"vllm_ascend-{version}-") and f.suffix == ".whl":
            return f
        if f.name == f"vllm_ascend-{version}.tar.gz":
            return f
    return None


def download(version: str) -> Path:
    """The downloaded wheel / sdist of ``version`` (cached in .cache/vllm_ascend/dist)."""
    if version not in PYPI:
        raise SourceError(f"vllm-ascend {version} is not one of the PyPI releases {sorted(PYPI)}")
    found = _find_dist(version)
    if found is not None:
        return found
    dist = CACHE / "dist"
    dist.mkdir(parents=True, exist_ok=True)
    req = f"vllm-ascend=={version}"
    if PYPI[version] == "wheel":
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", req, "-d", str(dist)]
        cmd += ["--only-binary=:all:", "--python-version", "3.11"]
        for platform in WHEEL_PLATFORMS:
            cmd += ["--platform", platform]
        _run_pip(cmd, version)
    else:
        py = _download_venv()
        env = {**os.environ, "SOC_VERSION": "ascend910b1"}
        cmd = [str(py), "-m", "pip", "download", "-q", "--no-deps", "--no-build-isolation"]
        cmd += ["--no-binary=:all:", req, "-d", str(dist)]
        _run_pip(cmd, version, env=env)
    found = _find_dist(version)
    if found is None:
        raise SourceError(f"pip reported success but no vllm-ascend {version} file is in {dist}")
    return found


def unpack(archive: Path, version: str) -> Path:
    """Unpack a wheel / sdist into .cache/vllm_ascend/src/<version>; returns that root."""
    root = CACHE / "src" / version
    if (root / "vllm_ascend" / "__init__.py").exists():
        return root
    tmp = root.with_name(root.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
    else:
        with tarfile.open(archive) as tf:
            tf.extractall(tmp, filter="data")
        inner = [p for p in tmp.iterdir() if (p / "vllm_ascend").is_dir()]
        if len(inner) != 1:
            raise SourceError(f"{archive} does not contain one top folder with vllm_ascend/")
        for p in inner[0].iterdir():
            p.rename(tmp / p.name)
        inner[0].rmdir()
    if not (tmp / "vllm_ascend" / "__init__.py").exists():
        raise SourceError(f"{archive} has no vllm_ascend/__init__.py")
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)
    return root


def export_tag(git_dir: Path, tag: str) -> Path:
    """``git archive <tag> vllm_ascend`` from a local clone into .cache/vllm_ascend/src/<tag>
    (``tag`` may be any commit: a main-branch snapshot is exported the same way)."""
    root = CACHE / "src" / tag
    if (root / "vllm_ascend" / "__init__.py").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "--git-dir", str(git_dir), "archive", tag, "vllm_ascend"],
        capture_output=True,
        check=False,
        timeout=300,
    )
    if archive.returncode != 0:
        raise SourceError(
            f"git archive {tag} failed in {git_dir}: {archive.stderr.decode()[-500:]}"
        )
    subprocess.run(["tar", "x", "-C", str(root)], input=archive.stdout, check=True)
    return root
