"""The trampolines' compiled code kept between processes: a later process loads it instead
of compiling, and a cache that is damaged, not this user's alone, or not writable only
costs a compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ucm_patch import guard, trampoline, trampoline_cache

ROOT = Path(__file__).resolve().parents[1]

# A child that builds trampolines for targets of three shapes, calls them, and says how
# many times it compiled and what the calls returned.
CHILD = textwrap.dedent(
    """
    import builtins, json
    from ucm_patch import guard, trampoline
    compiled = []
    real_compile = builtins.compile
    def counting(src, *args, **kwargs):
        compiled.append(src)
        return real_compile(src, *args, **kwargs)
    builtins.compile = counting  # every source compiled from here on (modules imported)

    def one(a):
        return ("one", a)

    def three(a, b, c=30):
        return ("three", a, b, c)

    class Layer:
        def forward(self, x, y):
            return ("forward", x, y)

    def wrapper(wrapped, instance, args, kwargs):
        return ("wrapped", wrapped(*args, **kwargs))

    def make(fn, method):
        return trampoline.make_trampoline(
            fn, wrapper, None, method, guard.CallCell(), lambda exc: None, lambda: False
        )

    layer = Layer()
    Layer.forward = make(Layer.forward, True)
    out = [make(one, False)(1), make(three, False)(1, 2), layer.forward(5, y=6)]
    print(json.dumps({"compiled": len(compiled), "out": out}))
    """
)


def _child(cache: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_PATCH")}
    env.update(XDG_CACHE_HOME=str(cache), UCM_PATCH="0", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cache_file(cache: Path) -> Path:
    (found,) = (cache / "ucm_patch" / "trampolines").glob("*.marshal")
    return found


EXPECTED = [
    ["wrapped", ["one", 1]],
    ["wrapped", ["three", 1, 2, 30]],
    ["wrapped", ["forward", 5, 6]],
]


def test_a_later_process_loads_the_shapes_instead_of_compiling(tmp_path: Path) -> None:
    first = _child(tmp_path)
    # three targets: a shim and a trampoline each, every one a shape of its own
    assert first == {"compiled": 6, "out": EXPECTED}
    file = _cache_file(tmp_path)
    assert file.stat().st_mode & 0o077 == 0, "this user's alone"
    assert f"{sys.implementation.cache_tag}-" in file.name
    second = _child(tmp_path)
    assert second == {"compiled": 0, "out": EXPECTED}


@pytest.mark.parametrize(
    "damage",
    [b"", b"not marshal at all", b"\xff" * 64, b"\xe9\x03\x00\x00\x00"],  # ...last: an int
    ids=["empty", "text", "garbage", "not-a-dict"],
)
def test_a_damaged_cache_is_compiled_over_and_rewritten(tmp_path: Path, damage: bytes) -> None:
    _child(tmp_path)
    file = _cache_file(tmp_path)
    file.write_bytes(damage)
    assert _child(tmp_path) == {"compiled": 6, "out": EXPECTED}
    assert _child(tmp_path) == {"compiled": 0, "out": EXPECTED}, "rewritten whole"


def test_a_cache_others_can_write_is_not_loaded(tmp_path: Path) -> None:
    _child(tmp_path)
    file = _cache_file(tmp_path)
    os.chmod(file, 0o666)
    assert _child(tmp_path)["compiled"] == 6


def test_an_unwritable_cache_only_costs_a_compile(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")  # $XDG_CACHE_HOME/ucm_patch cannot be made under a file
    assert _child(blocker) == {"compiled": 6, "out": EXPECTED}
    assert _child(blocker) == {"compiled": 6, "out": EXPECTED}
    assert list(tmp_path.iterdir()) == [blocker], "no temporary file left behind"


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This process's cache pointed at an empty folder, and its loaded shapes dropped."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    trampoline_cache.forget()
    trampoline._compile_factory.cache_clear()
    yield tmp_path
    trampoline_cache.forget()
    trampoline._compile_factory.cache_clear()


def test_a_batch_writes_the_file_once(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[int] = []
    real_write = trampoline_cache._write
    monkeypatch.setattr(
        trampoline_cache, "_write", lambda codes: (writes.append(len(codes)), real_write(codes))
    )

    def a(x):
        return x

    def b(x, y):
        return x, y

    with trampoline_cache.batch():
        for fn in (a, b):
            trampoline.make_trampoline(
                fn, lambda w, i, args, kw: w(*args, **kw), None, False, guard.CallCell(),
                lambda exc: None, lambda: False,
            )  # fmt: skip
        assert writes == [], "nothing written inside the batch"
    assert writes == [4], "one write, with both targets' shim and trampoline"
    trampoline_cache.forget()
    assert len(trampoline_cache._read(trampoline_cache.path())) == 4


def test_activation_writes_the_cache_once(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registry applies the records whose targets are imported inside one batch."""
    from ucm_patch.records import PatchRecord
    from ucm_patch.registry import Registry

    writes: list[int] = []
    real_write = trampoline_cache._write
    monkeypatch.setattr(
        trampoline_cache, "_write", lambda codes: (writes.append(len(codes)), real_write(codes))
    )
    module = sys.modules[__name__]
    records = [
        PatchRecord(
            f"cache_probe_{target}",
            "any",
            f"{__name__}:{target}",
            {"wrapt": ">=1"},
            lambda: lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs),
            why="test record",
            upstream="test only here",
            removal="never at all",
        )
        for target in ("_target_one", "_target_two")
    ]
    reg = Registry(records)
    try:
        reg.activate(env={})
        assert [r["state"] for r in reg.report()] == ["applied", "applied"]
        assert writes == [4]
        assert module._target_one(1) == 1 and module._target_two(1, 2) == (1, 2)
    finally:
        reg.revert()


def _target_one(x: Any) -> Any:
    return x


def _target_two(x: Any, y: Any) -> Any:
    return x, y


def test_a_fork_while_another_thread_holds_the_lock_leaves_the_child_usable(
    fresh_cache: Path,
) -> None:
    """vLLM forks its workers: a child forked while a thread of the parent wrote the cache
    still looks shapes up (its lock is a new one), instead of hanging."""
    import signal
    import threading

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with trampoline_cache._lock:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    pid = os.fork()
    if pid == 0:  # the child: a hang ends by SIGALRM, a failure by its exit code
        signal.alarm(10)
        try:
            found = trampoline_cache.get("def nothing_cached(): pass")
            os._exit(0 if found is None else 2)
        except BaseException:
            os._exit(1)
    release.set()
    holder.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
