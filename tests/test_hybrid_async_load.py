"""``hybrid_async_load`` on a stand-in scheduler written in vLLM 0.22's shape (real vLLM
0.22.1 runs it in tests/test_older_release_e2e.py: a hybrid hit, served).

``compile_guarded`` compiles ``schedule`` again from its own source with the waiting
loop's align split under ``and not load_kv_async``: an async load no longer meets the
split's assert or its ``break``, everything else runs as written (a sync load with
external tokens still asserts, as on 0.23), and an error points at the file's own lines.
A schedule of another shape fails the patch, naming what it lacks. The blocks of a
request waiting for its async load leave the step's zeroing list.
"""

from __future__ import annotations

import inspect
import sys
import traceback
import types
from typing import Any

import pytest

from ucm_patch.installer import SignatureChanged
from ucm_patch.patches.vllm import hybrid_async_load as hal
from ucm_patch.records import PatchRecord
from ucm_patch.registry import Registry


class Scheduler022:
    """vLLM 0.22's waiting loop, reduced to what the patch changes: the split, its
    assert and its ``break``; ``load_kv_async`` set by the lookup."""

    def __init__(self) -> None:
        self.need_mamba_block_aligned_split = True
        self.scheduled: list[tuple[str, int]] = []

    def _mamba_block_aligned_split(
        self,
        request: str,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        assert num_external_computed_tokens == 0, "External KV connector is not verified yet"
        return num_new_tokens // 4 * 4

    def schedule(self, waiting: list[tuple[str, int, bool]]) -> list[tuple[str, int]]:
        for request, external, async_hit in waiting:
            num_new_local_computed_tokens = 0
            load_kv_async = False
            num_external_computed_tokens = external
            load_kv_async = async_hit
            if load_kv_async:
                num_new_tokens = 0
            else:
                num_new_tokens = 10 - external
            if self.need_mamba_block_aligned_split:
                num_new_tokens = self._mamba_block_aligned_split(
                    request,
                    num_new_tokens,
                    num_new_local_computed_tokens,
                    num_external_computed_tokens,
                )
                if num_new_tokens == 0:
                    break
            self.scheduled.append((request, num_new_tokens))
        return self.scheduled


def test_an_async_load_passes_the_split_and_the_steps_scheduling_goes_on() -> None:
    waiting = [("hit", 8, True), ("next", 0, False)]
    with pytest.raises(AssertionError, match="External KV connector is not verified yet"):
        Scheduler022().schedule(waiting)  # vLLM 0.22 as released: the engine core dies
    guarded = hal.compile_guarded(Scheduler022.schedule)
    sched = Scheduler022()
    assert guarded(sched, waiting) == [("hit", 0), ("next", 8)]  # the next one split as before
    with pytest.raises(AssertionError, match="not verified"):  # a sync load: as on 0.23
        guarded(Scheduler022(), [("sync", 4, False)])
    sched = Scheduler022()
    sched.need_mamba_block_aligned_split = False
    assert guarded(sched, [("a", 0, False)]) == [("a", 10)]


def test_the_compiled_schedule_keeps_the_files_line_numbers() -> None:
    guarded = hal.compile_guarded(Scheduler022.schedule)
    assert guarded.__qualname__ == Scheduler022.schedule.__qualname__
    lines, first = inspect.getsourcelines(Scheduler022.schedule)
    loop = first + next(i for i, line in enumerate(lines) if "for request, external" in line)
    with pytest.raises(TypeError) as info:
        guarded(Scheduler022(), [None])  # cannot unpack: raised on the loop's own line
    frame = traceback.extract_tb(info.value.__traceback__)[-1]
    assert (frame.filename, frame.lineno) == (__file__, loop)


def _no_split(self: Any) -> None:
    load_kv_async = True
    return load_kv_async


def _two_splits(self: Any, r: Any) -> None:
    load_kv_async = False
    if self.need_mamba_block_aligned_split:
        self._mamba_block_aligned_split(r, 0, 0, num_external_computed_tokens)  # noqa: F821
    if self.need_mamba_block_aligned_split:
        self._mamba_block_aligned_split(r, 0, 0, num_external_computed_tokens)  # noqa: F821
    return load_kv_async


def _no_async(self: Any, r: Any) -> None:
    if self.need_mamba_block_aligned_split:
        self._mamba_block_aligned_split(r, 0, 0, num_external_computed_tokens)  # noqa: F821


def _closure() -> Any:
    captured = 1

    def schedule(self: Any) -> int:
        return captured

    return schedule


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (_no_split, "has 0 `if self.need_mamba_block_aligned_split:` blocks"),
        (_two_splits, "has 2 `if self.need_mamba_block_aligned_split:` blocks"),
        (_no_async, "no longer sets load_kv_async"),
        (_closure(), "not a plain function"),
        (print, "not a plain function"),
    ],
)
def test_a_schedule_of_another_shape_fails_the_patch_naming_why(fn: Any, why: str) -> None:
    with pytest.raises(SignatureChanged, match=why.replace("`", ".").replace("(", ".")):
        hal.compile_guarded(fn)


class Manager:
    def __init__(self, blocks: dict[str, tuple[list[int], ...]]) -> None:
        self.blocks = blocks

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.blocks[request_id]


def _scheduler(waiting: list[tuple[str, Any]], skipped: list[tuple[str, Any]]) -> Any:
    blocks = {"loading": ([3, 4], [9]), "queued": ([5], [10])}
    return types.SimpleNamespace(
        waiting=[types.SimpleNamespace(request_id=r, status=s) for r, s in waiting],
        skipped_waiting=[types.SimpleNamespace(request_id=r, status=s) for r, s in skipped],
        kv_cache_manager=Manager(blocks),
    )


@pytest.mark.parametrize("queue", ["skipped_waiting", "waiting"])
def test_an_async_loads_blocks_leave_the_steps_zeroing(queue: str) -> None:
    """vLLM 0.22's schedule puts a request whose load is async into ``skipped_waiting``
    (the step's skipped requests, prepended there before the zeroing list is taken)."""
    from vllm.v1.request import RequestStatus

    remote, plain = RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING
    loading = [("loading", remote)]
    sched = _scheduler(
        [*(loading if queue == "waiting" else []), ("queued", plain)],
        loading if queue == "skipped_waiting" else [],
    )
    out = types.SimpleNamespace(new_block_ids_to_zero=[1, 2, 3, 4, 5, 9, 10])
    hal.skip_async_load_blocks(sched, out, remote)
    assert out.new_block_ids_to_zero == [1, 2, 5, 10]  # the queued request's are zeroed
    out = types.SimpleNamespace(new_block_ids_to_zero=[3, 9])
    hal.skip_async_load_blocks(sched, out, remote)
    assert out.new_block_ids_to_zero is None  # vLLM's "nothing to zero"
    out = types.SimpleNamespace(new_block_ids_to_zero=None)
    hal.skip_async_load_blocks(sched, out, remote)
    assert out.new_block_ids_to_zero is None


def test_a_host_error_of_the_compiled_schedule_is_not_run_again() -> None:
    """An error vLLM's own code raises in the compiled schedule propagates as it is: the
    call-time guard must not call the original schedule after it (the step's state is
    half changed), and the patch stays applied."""
    calls: list[str] = []

    def original(self: Any, fail: bool) -> str:
        calls.append("original")
        return "vllm's"

    def make_wrapper() -> Any:
        from ucm_patch.guard import host_raised

        def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            calls.append("copy")
            try:
                if args[0]:
                    raise KeyError("vLLM's own error")
            except Exception as exc:
                host_raised(exc)
                raise
            return "copy's"

        return wrapper

    mod = types.ModuleType("ucm_hal_target")
    mod.Scheduler = type("Scheduler", (), {"schedule": original})
    sys.modules[mod.__name__] = mod
    try:
        rec = PatchRecord(
            "hal_guard", "t", "ucm_hal_target:Scheduler.schedule", {"wrapt": ">=1"},
            make_wrapper, why="test record", upstream="test only here", removal="never at all",
        )  # fmt: skip
        reg = Registry([rec])
        reg.activate()
        sched = mod.Scheduler()
        assert sched.schedule(False) == "copy's"
        with pytest.raises(KeyError, match="vLLM's own error"):
            sched.schedule(True)
        assert calls == ["copy", "copy"]  # the original never ran
        assert reg.report()[0]["state"] == "applied"
        reg.revert()
    finally:
        del sys.modules[mod.__name__]


def test_the_records_cover_vllm_0_22_to_0_25() -> None:
    """0.22: the compiled schedule; 0.23 - 0.25: vLLM's own schedule and the zeroing filter
    (0.26 has both fixes: no record)."""
    by_era = {r.era: r for r in hal.RECORDS}
    assert set(by_era) == {"vllm-0.22", "vllm-0.23"}
    for record in hal.RECORDS:
        assert record.target == "vllm.v1.core.sched.scheduler:Scheduler.schedule"
        assert record.id.startswith(hal.BACKPORTED + "@")
    assert by_era["vllm-0.22"].requires == {"vllm": ">=0.22,<0.23"}
    assert by_era["vllm-0.22"].make_wrapper is hal.make_schedule_wrapper
    assert by_era["vllm-0.23"].requires == {"vllm": ">=0.23,<0.26"}
    assert by_era["vllm-0.23"].make_wrapper is hal.make_zeroing_wrapper
    assert "_skip_zero_block_ids" in by_era["vllm-0.23"].why


def _guarded_023(self: Any, r: Any) -> Any:
    load_kv_async = bool(r)
    if self.need_mamba_block_aligned_split and not load_kv_async:
        self._mamba_block_aligned_split(r, 0, 0, num_external_computed_tokens)  # noqa: F821
    new_block_ids_to_zero = self.kv_cache_manager.take_new_block_ids() or None
    return new_block_ids_to_zero


def _guarded_027(self: Any, r: Any) -> Any:
    load_kv_async = bool(r)
    if load_kv_async:
        pass
    elif self.need_mamba_block_aligned_split:
        self._mamba_block_aligned_split(r, 0, 0, num_external_computed_tokens)  # noqa: F821
    return types.SimpleNamespace(new_block_ids_to_zero=None)


def _guarded_no_zeroing(self: Any, r: Any) -> Any:
    load_kv_async = bool(r)
    if self.need_mamba_block_aligned_split and not load_kv_async:
        self._mamba_block_aligned_split(r, 0, 0, num_external_computed_tokens)  # noqa: F821
    return load_kv_async


def test_the_zeroing_era_checks_that_the_split_is_already_guarded() -> None:
    """0.23 - 0.25's record leaves vLLM's schedule as it is: applied only where its
    waiting loop already skips the split for an async load and builds the zeroing list;
    0.22's shape, or one without the list, fails the patch, naming why."""
    hal.check_split_guarded(_guarded_023)
    hal.check_split_guarded(_guarded_027)  # 0.27+'s form (the split after `if load_kv_async`)
    with pytest.raises(SignatureChanged, match="runs _mamba_block_aligned_split for an async"):
        hal.check_split_guarded(Scheduler022.schedule)
    with pytest.raises(SignatureChanged, match="no longer builds new_block_ids_to_zero"):
        hal.check_split_guarded(_guarded_no_zeroing)
    with pytest.raises(SignatureChanged, match="no longer sets load_kv_async"):
        hal.check_split_guarded(_no_async)
    with pytest.raises(SignatureChanged, match="source cannot be read"):
        hal.check_split_guarded(print)
