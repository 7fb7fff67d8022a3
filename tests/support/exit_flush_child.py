"""A child process that exits with dumps in flight (the exit-flush test's subject).

``python -m tests.support.exit_flush_child STORE_DIR PUT_S DUMPS``: the process's dump
scheduler (``get_scheduler``, one worker) gets ``DUMPS`` one-value dumps of request
``exit-req`` into the real :class:`LocalStore` in ``STORE_DIR``, whose every put takes
``PUT_S`` seconds (a negative value: blocks forever, a hung store). It prints one JSON line
``{"submitted_at": <time.monotonic()>, "keys": [...]}`` and returns from ``main`` at once:
the rest is the interpreter's exit, where the scheduler's bounded flush runs
(``UCM_PATCH_DUMP_EXIT_FLUSH_S`` from the environment); right after it, a second line
``{"flushed_at": <time.monotonic()>}``.
"""

from __future__ import annotations

import atexit
import json
import logging
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from ucm_patch.hooks.dump import get_scheduler
from ucm_patch.hooks.stores.local import LocalStore

REQUEST = "exit-req"


class SlowLocalStore(LocalStore):
    """The real local store; each put first waits ``put_s`` seconds (< 0: forever)."""

    def __init__(self, path: Path, put_s: float) -> None:
        super().__init__(path, capacity_bytes=1 << 26)
        self.put_s = put_s
        self._never = threading.Event()

    def put_many(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]]) -> list[bool]:
        if self.put_s < 0:
            self._never.wait()
        time.sleep(self.put_s)
        return super().put_many(items)


def main(argv: list[str]) -> int:
    store_dir, put_s, count = Path(argv[0]), float(argv[1]), int(argv[2])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    store = SlowLocalStore(store_dir, put_s)
    # Registered before the scheduler's exit handler, so it runs right after it (LIFO):
    # the time the flush ended, apart from the interpreter's own teardown.
    atexit.register(lambda: print(json.dumps({"flushed_at": time.monotonic()}), flush=True))
    sched = get_scheduler(workers=1)
    client = sched.client("exit-test")
    batch = client.open_batch([REQUEST], store)
    keys = [f"exit/{i}" for i in range(count)]
    for key in keys:
        assert client.submit(batch, 0, [key], [key.encode() * 64])
    client.seal(batch)
    print(json.dumps({"submitted_at": time.monotonic(), "keys": keys}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
