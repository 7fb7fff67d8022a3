"""Shared fixtures: fresh-interpreter runs, tiny models, a clean environment.

Most core tests run in a fresh subprocess (ddtrace's PatchTestCase idea): patching is
process-global, and import order is exactly what is under test.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.support.fakes_store import FakeStore

REPO = Path(__file__).resolve().parent.parent
TINY_RECIPE = 3  # scripts/make_tiny_model.py RECIPE
MODELS = REPO / "models"
PY = sys.executable


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The current environment without any UCM_PATCH* / VLLM_PLUGINS, plus ``extra``."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("UCM_PATCH") and k != "VLLM_PLUGINS"
    }
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


@pytest.fixture(autouse=True, scope="session")
def _memory_tier_under_test_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Local stores made from config put their memory tier under $XDG_RUNTIME_DIR
    (ucm_patch.hooks.stores.local.default_memory_path): point it at this run's temporary
    directory, inherited by every child process, so no test leaves segments in /dev/shm."""
    os.environ["XDG_RUNTIME_DIR"] = str(tmp_path_factory.mktemp("runtime"))


_counter = itertools.count()
RunPy = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run_py(tmp_path: Path) -> RunPy:
    """Run ``code`` in a fresh interpreter (cwd = tmp_path, on sys.path); return the result.

    ``check=True`` (default) fails the test with the child's output when it exits non-zero.
    """

    def run(
        code: str,
        env: Mapping[str, str] | None = None,
        check: bool = True,
        timeout: float = 300,
        args: tuple[str, ...] = (),
    ) -> subprocess.CompletedProcess[str]:
        # A real file, not `python -c`: vLLM's spawned processes re-import __main__.
        script = tmp_path / f"child_{next(_counter)}.py"
        script.write_text(textwrap.dedent(code))
        proc = subprocess.run(
            [PY, str(script), *args],
            cwd=tmp_path,
            env=clean_env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            pytest.fail(
                f"child exited {proc.returncode}\n--- stdout\n{proc.stdout}\n"
                f"--- stderr\n{proc.stderr[-6000:]}"
            )
        return proc

    return run


def _tiny(kind: str, dirname: str) -> Path:
    out = MODELS / dirname
    stamp = out / "ucm_tiny.json"
    if not stamp.exists() or json.loads(stamp.read_text()).get("recipe") != TINY_RECIPE:
        subprocess.run(
            [PY, str(REPO / "scripts" / "make_tiny_model.py"), kind, str(out)],
            check=True,
            env=clean_env(),
        )
    return out


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    """Tiny random Qwen3 (2 attention layers), built locally on first use."""
    return _tiny("qwen3", "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_sharp() -> Path:
    """Tiny random Qwen3 whose greedy tokens depend on the context (initializer 0.2)."""
    return _tiny("qwen3_sharp", "tiny-qwen3-sharp")


@pytest.fixture(scope="session")
def tiny_qwen3_next() -> Path:
    """Tiny random Qwen3-Next (layer 0 GDN linear attention, layer 1 full attention)."""
    return _tiny("qwen3_next", "tiny-qwen3-next")


@pytest.fixture(scope="session")
def tiny_qwen3_next_3to1() -> Path:
    """Tiny Qwen3-Next laid out like the released checkpoints: ``GGGA GGGA`` (3:1)."""
    return _tiny("qwen3_next_3to1", "tiny-qwen3-next-3to1")


@pytest.fixture(scope="session")
def tiny_qwen3_next_mixed() -> Path:
    """Tiny Qwen3-Next with an uneven layout: ``GAGGA``."""
    return _tiny("qwen3_next_mixed", "tiny-qwen3-next-mixed")


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeStore]:
    """A :class:`~tests.support.fakes_store.FakeStore` that every UCMPatchConnector built in this
    process uses, with the process-wide state (store cache, dump scheduler, counters)
    reset before and after; held puts are released at the end."""
    from tests.support.fakes_store import FakeStore
    from ucm_patch.connector import counters as connector_stats
    from ucm_patch.connector import kv_connector as connector
    from ucm_patch.hooks.dump import reset_scheduler

    fake = FakeStore()
    monkeypatch.setattr(connector, "make_store", lambda _config, **_kw: fake)
    connector._stores.clear()
    reset_scheduler()
    connector_stats.reset()
    yield fake
    fake.release()
    connector._stores.clear()
    reset_scheduler()
    connector_stats.reset()
