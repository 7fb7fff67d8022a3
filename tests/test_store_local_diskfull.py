"""Local store on a disk smaller than its capacity: ENOSPC evicts and retries, the default
capacity is capped by the free space, and the warnings stay bounded.

The disk is a real 4 MiB tmpfs mounted in a private mount namespace (``unshare``); the
child is this file run as a script (``--driver``) and reports JSON.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ucm_patch.hooks.stores.local import LocalStore
from ucm_patch.hooks.stores.tier import record_bytes

VALUE = 256 << 10
PUTS = 60  # 15 MiB through a 4 MiB disk
SEGMENT = 1 << 20


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _driver(mount: str, out: str) -> None:
    counter = _Count()
    logging.getLogger("ucm_patch.hooks.stores").addHandler(counter)
    logging.getLogger("ucm_patch.hooks.stores").setLevel(logging.INFO)
    report: dict[str, object] = {}
    big = os.path.join(mount, "big")  # 16 x the disk, in segments of 4 values
    s = LocalStore(big, capacity_bytes=64 << 20, segment_bytes=SEGMENT)
    results = []
    for i in range(PUTS):
        key = f"v{i}"
        results.append(s.put_many([(key, bytes([i]) * VALUE)])[0])
        got = s.get_many([key])[0]
        assert got == bytes([i]) * VALUE, key
    report["results"] = results
    report["stats"] = s.stats
    report["warnings"] = [r.getMessage() for r in counter.records if r.levelno >= logging.WARNING]
    report["last_readable"] = s.get_many([f"v{PUTS - 1}"])[0] is not None
    s.close()
    shutil.rmtree(os.path.join(mount, "big"))

    # the default capacity: free space + what is already stored, at most 10 GiB, in whole
    # segments
    capped_dir = os.path.join(mount, "capped")
    first = LocalStore(capped_dir, capacity_bytes=1 << 20, segment_bytes=SEGMENT // 4)
    assert first.put_many([(f"c{i}", b"c" * (100 << 10)) for i in range(5)]) == [True] * 5
    first.close()
    held = sum(e.stat().st_blocks * 512 for e in os.scandir(capped_dir) if e.name[:4] == "seg-")
    vfs = os.statvfs(mount)
    free = vfs.f_bavail * vfs.f_frsize
    counter.records.clear()
    capped = LocalStore(capped_dir)
    report["cap"] = {
        "capacity": capped.capacity_bytes,
        "free": free,
        "held": held,
        "segment": capped.disk.segment_bytes,
        "stored": capped.used_bytes,
    }
    report["cap_logged"] = [
        r.getMessage() for r in counter.records if "capacity capped at" in r.getMessage()
    ]
    report["configured_not_capped"] = LocalStore(capped_dir, capacity_bytes=64 << 20).capacity_bytes
    Path(out).write_text(json.dumps(report))


def test_enospc_evicts_and_retries_and_default_capacity_is_capped(tmp_path: Path) -> None:
    mount, out = tmp_path / "mnt", tmp_path / "report.json"
    mount.mkdir()
    assert shutil.which("unshare"), "util-linux 'unshare' is required for this test"
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    script = (
        f"mount -t tmpfs -o size=4m tmpfs {mount} && "
        f"exec {sys.executable} {Path(__file__).resolve()} --driver {mount} {out}"
    )
    proc = subprocess.run(
        [*unshare, "sh", "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"driver failed:\n{proc.stdout}\n{proc.stderr}"
    r = json.loads(out.read_text())
    # every put succeeded: a full disk made the store evict (counted) and retry
    assert r["results"] == [True] * PUTS, r["results"]
    assert r["stats"]["errors"] == 0, r["stats"]
    assert r["stats"]["disk_full"] >= 1, r["stats"]
    assert r["stats"]["evictions"] >= PUTS - 4 * (1 << 20) // VALUE, r["stats"]
    # each ENOSPC empties whole segments, at least a tenth of what is stored, so most
    # puts do not hit it ...
    assert r["stats"]["disk_full"] <= PUTS // 2, r["stats"]
    # ... and their warnings are rate limited: one line, not one per put
    assert len(r["warnings"]) == 1 and "file system full" in r["warnings"][0], r["warnings"]
    assert r["last_readable"] is True
    cap = r["cap"]
    # the directory's segment size (a quarter MiB, from its first process) counts it
    assert cap["segment"] == SEGMENT // 4, cap
    assert cap["capacity"] == (cap["free"] + cap["held"]) // cap["segment"] * cap["segment"], cap
    assert cap["capacity"] < 4 << 20, cap
    assert cap["stored"] == 5 * record_bytes(100 << 10), cap
    assert len(r["cap_logged"]) == 1, r["cap_logged"]
    assert r["configured_not_capped"] == 64 << 20


if __name__ == "__main__" and sys.argv[1:2] == ["--driver"]:
    _driver(sys.argv[2], sys.argv[3])
