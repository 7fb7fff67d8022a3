"""The process's one exit sequence (:mod:`ucm_patch.hooks.exit_sequence`): flushes before
closes by construction, each step once, a failing step never stopping the rest; and the
dump scheduler and the connector's stores enter it in their phases."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO, repo_pythonpath
from ucm_patch.hooks import exit_sequence


@pytest.fixture
def clean_sequence() -> Iterator[None]:
    """The registered steps of this process, restored afterwards."""
    saved = list(exit_sequence._flushes), list(exit_sequence._closes)
    exit_sequence._flushes.clear()
    exit_sequence._closes.clear()
    try:
        yield
    finally:
        exit_sequence._flushes[:] = saved[0]
        exit_sequence._closes[:] = saved[1]


def test_flushes_run_before_closes_whatever_the_registration_order(
    clean_sequence: None,
) -> None:
    ran: list[str] = []

    def close_a() -> None:
        ran.append("close a")

    def flush() -> None:
        ran.append("flush")

    def close_b() -> None:
        ran.append("close b")

    exit_sequence.close_at_exit(close_a)
    exit_sequence.flush_at_exit(flush)
    exit_sequence.close_at_exit(close_b)
    exit_sequence.close_at_exit(close_a)  # twice: once
    exit_sequence.run()
    assert ran == ["flush", "close a", "close b"]


def test_a_failing_step_is_logged_and_the_rest_still_run(
    clean_sequence: None, caplog: pytest.LogCaptureFixture
) -> None:
    ran: list[str] = []

    def broken_flush() -> None:
        raise RuntimeError("store hung")

    exit_sequence.flush_at_exit(broken_flush)
    exit_sequence.close_at_exit(lambda: ran.append("closed"))
    with caplog.at_level("ERROR", logger=exit_sequence.__name__):
        exit_sequence.run()
    assert ran == ["closed"]
    assert "broken_flush" in caplog.text and "store hung" in caplog.text


def test_the_scheduler_and_the_connectors_stores_enter_their_phases(
    clean_sequence: None, tmp_path: Path
) -> None:
    from ucm_patch.connector import kv_connector
    from ucm_patch.connector.config import parse_connector_config
    from ucm_patch.hooks.dump import get_scheduler, reset_scheduler, shutdown_at_exit

    reset_scheduler()
    config = parse_connector_config({"local_path": str(tmp_path / "kv"), "local_memory_bytes": 0})
    store = kv_connector.shared_store(config)
    try:
        get_scheduler(workers=1)
        assert exit_sequence._flushes == [shutdown_at_exit]
        assert exit_sequence._closes == [kv_connector._close_stores]
    finally:
        exit_sequence.run()  # the scheduler shut down, the store closed
    assert store not in kv_connector._stores.values()


def test_at_interpreter_exit_the_dumps_are_flushed_before_the_store_closes(
    tmp_path: Path,
) -> None:
    """A real exit: the store records at its close how many of the dumps submitted just
    before exit it holds; the close step is registered before the scheduler exists."""
    child = textwrap.dedent(
        f"""
        import time
        from tests.support.fakes_store import FakeStore
        from ucm_patch.hooks import exit_sequence
        from ucm_patch.hooks.device import CpuDevice
        from ucm_patch.hooks.dump import get_scheduler

        class SlowStore(FakeStore):
            def put_many(self, items):
                time.sleep(0.05)
                return super().put_many(items)

            def close(self):
                with open({str(tmp_path / "held")!r}, "w") as f:
                    f.write(str(len(self.data)))

        store = SlowStore()
        exit_sequence.close_at_exit(store.close)
        sched = get_scheduler(device=CpuDevice(), workers=1)
        client = sched.client("exit")
        batch = client.open_batch(["r"], store)
        for i in range(6):
            sched.submit(batch, i, [f"k{{i}}"], [b"v" * 64])
        sched.seal(batch)
        """
    )
    env = dict(os.environ, PYTHONPATH=repo_pythonpath())
    subprocess.run([sys.executable, "-c", child], check=True, cwd=REPO, env=env, timeout=120)
    assert (tmp_path / "held").read_text() == "6"
