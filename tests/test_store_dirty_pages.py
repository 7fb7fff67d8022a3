"""The dirty-page gauge that lets a full store's puts go around its memory tier
(hooks/stores/dirty_pages.py): the kernel's free-run line, computed as
mm/page-writeback.c does, from a /proc and a cgroup tree given here."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ucm_patch.hooks.stores import dirty_pages
from ucm_patch.hooks.stores.dirty_pages import MARGIN_BYTES, DirtyGauge, freerun_line

GiB = 1 << 30


def test_the_free_run_line_is_the_kernels() -> None:
    """Halfway between the background and the hard threshold; a *_bytes setting wins over
    its ratio; a background threshold at or over the hard one counts as half of it."""
    assert freerun_line(10 * GiB, 20, 10, 0, 0) == (2 * GiB + GiB) // 2
    assert freerun_line(10 * GiB, 20, 10, GiB, 0) == (GiB + GiB // 2) // 2  # bg 1 GiB >= 1
    assert freerun_line(10 * GiB, 20, 10, 0, 256 << 20) == (2 * GiB + (256 << 20)) // 2
    assert freerun_line(10 * GiB, 20, 30, 0, 0) == (2 * GiB + GiB) // 2


def _proc(root: Path, free: int, files: int, dirty: int, ratio: int = 20, bg: int = 10) -> Path:
    proc = root / "proc"
    (proc / "sys" / "vm").mkdir(parents=True, exist_ok=True)
    (proc / "self").mkdir(exist_ok=True)
    kib = 1024
    (proc / "meminfo").write_text(
        f"MemTotal:       {(free + files) // kib} kB\n"
        f"MemFree:        {free // kib} kB\n"
        f"Active(file):   {files // 2 // kib} kB\n"
        f"Inactive(file): {files // 2 // kib} kB\n"
        f"Dirty:          {dirty // kib} kB\n"
        f"Writeback:      0 kB\n"
    )
    for name, value in (("dirty_ratio", ratio), ("dirty_background_ratio", bg),
                        ("dirty_bytes", 0), ("dirty_background_bytes", 0)):  # fmt: skip
        (proc / "sys" / "vm" / name).write_text(f"{value}\n")
    (proc / "self" / "cgroup").write_text("0::/serving\n")
    return proc


def test_room_below_the_line_less_the_margin_and_none_above(tmp_path: Path, monkeypatch) -> None:
    """10 GiB dirtyable, ratios 20/10: the line is 1.5 GiB. Room while the dirty pages
    plus the margin stay under it; none at it; re-read only after RECHECK_S."""
    monkeypatch.setattr(dirty_pages, "RECHECK_S", 0.5)
    line = freerun_line(10 * GiB, 20, 10, 0, 0)
    proc = _proc(tmp_path, 6 * GiB, 4 * GiB, line - MARGIN_BYTES - (4 << 20))
    gauge = DirtyGauge(proc, cgroup=None)
    assert gauge.room()
    _proc(tmp_path, 6 * GiB, 4 * GiB, line - MARGIN_BYTES + (4 << 20))
    assert gauge.room(), "re-read before RECHECK_S"
    assert not DirtyGauge(proc, cgroup=None).room()
    time.sleep(0.6)
    assert not gauge.room()


def test_a_cgroup_limit_sets_its_own_line(tmp_path: Path) -> None:
    """Under a cgroup v2 memory.max, the cgroup's domain counts too (mdtc_calc_avail):
    its file pages plus the headroom the host's clean pages cover. A host with room and
    a cgroup past its own line: no room."""
    proc = _proc(tmp_path, 20 * GiB, 4 * GiB, 0)
    cg = tmp_path / "cgroup" / "serving"
    cg.mkdir(parents=True)
    (cg / "memory.max").write_text(f"{4 * GiB}\n")
    (cg / "memory.current").write_text(f"{4 * GiB}\n")  # no headroom: avail = its files
    files = 2 * GiB
    line = freerun_line(files, 20, 10, 0, 0)
    (cg / "memory.stat").write_text(f"file {files}\nfile_dirty {line}\nfile_writeback 0\n")
    assert not DirtyGauge(proc, cgroup=tmp_path / "cgroup").room()
    (cg / "memory.stat").write_text(f"file {files}\nfile_dirty 0\nfile_writeback 0\n")
    assert DirtyGauge(proc, cgroup=tmp_path / "cgroup").room()
    (cg / "memory.max").write_text("max\n")  # no limit: the host's line only
    (cg / "memory.stat").write_text(f"file {files}\nfile_dirty {line}\nfile_writeback 0\n")
    assert DirtyGauge(proc, cgroup=tmp_path / "cgroup").room()


@pytest.mark.parametrize("broken", ["missing", "garbled"])
def test_an_unreadable_meminfo_means_no_room(tmp_path: Path, broken: str) -> None:
    """Where the kernel's figures cannot be read, a put does not go around (it is
    skipped, as before writing around existed), never guesses."""
    proc = _proc(tmp_path, 6 * GiB, 4 * GiB, 0)
    if broken == "missing":
        (proc / "meminfo").unlink()
    else:
        (proc / "meminfo").write_text("MemFree: lots\n")
    assert not DirtyGauge(proc, cgroup=None).room()


def test_this_host_answers() -> None:
    """On this Linux host the real files are read (the answer depends on the host's
    load, so only its type is checked; the figures are the tests above)."""
    gauge = DirtyGauge()
    assert gauge._readable and isinstance(gauge.room(), bool)
