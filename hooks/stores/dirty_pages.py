"""Whether a write into the page cache can be made now without the kernel pausing it.

A full store's put that finds the memory tier's reserve dry writes its values around it,
into the disk tier (:meth:`LocalStore._put`): one copy into the page cache instead of one
into the memory tier and a second when that segment is spilled. The put must still never
wait for the disk. Linux lets a writer dirty pages freely while the host's dirty and
under-writeback pages stay below the *free-run* line, halfway between the background and
the hard dirty thresholds; above it, ``balance_dirty_pages`` pauses the writer (up to
200 ms a time) until writeback catches up (mm/page-writeback.c: ``domain_dirty_limits``,
``dirty_freerun_ceiling``). :class:`DirtyGauge` computes that line as the kernel does,
for the host and, under a cgroup v2 ``memory.max``, for the cgroup, and answers whether
the dirty pages are below it with a margin for the writes made before it looks again.

The vm settings are read once; ``/proc/meminfo`` (and the cgroup's ``memory.stat``) at
most every :data:`RECHECK_S`, so a put pays for a look once per many segments' worth of
values. Where the files cannot be read (not Linux), the answer is False: the put skips,
as it did before writing around existed.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

#: How long an answer is reused: at most a few segments' worth of writes at memcpy speed.
RECHECK_S = 0.01
#: Dirty bytes a writer may add between two looks; the gauge answers False this far below
#: the free-run line (two 64 MiB segments: the writes of one :data:`RECHECK_S` and more).
MARGIN_BYTES = 128 << 20
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _read_table(path: Path, scale: int) -> dict[str, int]:
    """``key value`` lines (meminfo's ``Key: N kB``, memory.stat's ``key N``) in bytes."""
    out: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1]) * scale
    return out


def freerun_line(avail: int, ratio: int, bg_ratio: int, dirty_bytes: int, bg_bytes: int) -> int:
    """The kernel's free-run ceiling in bytes for ``avail`` dirtyable bytes and the vm
    dirty settings (``domain_dirty_limits``: a ``*_bytes`` setting wins over its ratio,
    and a background threshold at or over the hard one is taken as half of it)."""
    thresh = dirty_bytes if dirty_bytes else avail * ratio // 100
    bg = bg_bytes if bg_bytes else avail * bg_ratio // 100
    if bg >= thresh:
        bg = thresh // 2
    return (thresh + bg) // 2


class DirtyGauge:
    """Answers :meth:`room` (is the host's dirty page count below the free-run line, with
    :data:`MARGIN_BYTES` to spare). One per store; thread-safe; paths are parameters so
    that tests can give the kernel's files."""

    def __init__(
        self,
        proc: str | os.PathLike[str] = "/proc",
        cgroup: str | os.PathLike[str] | None = "/sys/fs/cgroup",
    ) -> None:
        proc = Path(proc)
        vm = proc / "sys" / "vm"
        self._meminfo = proc / "meminfo"
        # parsed once: a host's vm settings do not change under a running server
        ratio, bg_ratio = _read_int(vm / "dirty_ratio"), _read_int(vm / "dirty_background_ratio")
        self._settings = (
            ratio if ratio is not None else 20,
            bg_ratio if bg_ratio is not None else 10,
            _read_int(vm / "dirty_bytes") or 0,
            _read_int(vm / "dirty_background_bytes") or 0,
        )
        self._readable = self._meminfo.exists()
        self._cgroup = self._cgroup_dir(proc, Path(cgroup)) if cgroup is not None else None
        self._lock = threading.Lock()
        self._until = 0.0
        self._answer = False

    @staticmethod
    def _cgroup_dir(proc: Path, root: Path) -> Path | None:
        """This process's cgroup v2 directory when it has a ``memory.max`` limit."""
        try:
            line = next(
                ln for ln in (proc / "self" / "cgroup").read_text().splitlines()
                if ln.startswith("0::")
            )  # fmt: skip
        except (OSError, StopIteration):
            return None
        where = root / line[3:].lstrip("/")
        limit = (
            (where / "memory.max").read_text().strip() if (where / "memory.max").exists() else ""
        )
        return where if limit.isdigit() else None

    def room(self) -> bool:
        """Whether a put may dirty page-cache pages now without being paused."""
        now = time.monotonic()
        if now < self._until:
            return self._answer
        with self._lock:
            if now >= self._until:
                self._answer = self._readable and self._measure()
                self._until = now + RECHECK_S
            return self._answer

    def _measure(self) -> bool:
        mem = _read_table(self._meminfo, 1024)
        try:
            dirty = mem["Dirty"] + mem["Writeback"]
            avail = mem["MemFree"] + mem["Active(file)"] + mem["Inactive(file)"]
        except KeyError:
            return False
        if dirty + MARGIN_BYTES >= freerun_line(avail, *self._settings):
            return False
        if self._cgroup is None:
            return True
        return self._cgroup_room(avail - min(avail, dirty))

    def _cgroup_room(self, global_clean: int) -> bool:
        """The cgroup's own domain (``mdtc_calc_avail``): its file pages plus as much of
        its headroom as the host's clean pages outside it cover."""
        assert self._cgroup is not None
        stat = _read_table(self._cgroup / "memory.stat", 1)
        limit = _read_int(self._cgroup / "memory.max")
        used = _read_int(self._cgroup / "memory.current")
        if limit is None or used is None or "file" not in stat:
            return False
        dirty = stat.get("file_dirty", 0) + stat.get("file_writeback", 0)
        files = stat["file"]
        clean = files - min(files, dirty)
        other_clean = global_clean - min(global_clean, clean)
        avail = files + min(max(0, limit - used), other_clean)
        return dirty + MARGIN_BYTES < freerun_line(avail, *self._settings)
