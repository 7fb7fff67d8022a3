"""``hybrid_async_load``: an async KV load of a hybrid model gets past vLLM 0.22's mamba
align split, and on 0.22 - 0.25 out of its step's KV zeroing, as vLLM 0.26 lets it (the
connector then serves hybrid hits on 0.22 - 0.25, finding the states by position as on
0.26 - 0.28).

Why: a hybrid model's hit (Qwen3-Next: GDN + attention, several KV-cache groups) loads
asynchronously (``load_kv_async``: vLLM cannot recompute the blocks of a synchronous load
that failed there). vLLM 0.22's ``Scheduler.schedule`` runs the mamba align split
(``_mamba_block_aligned_split``) for every waiting request, an async load's included,
whose ``num_new_tokens`` is 0 by then: the split asserts ``num_external_computed_tokens ==
0`` ("External KV connector is not verified yet") and the engine core dies; past the
assert, its 0 would end the step's scheduling (``break``). And the step's KV zeroing
(``new_block_ids_to_zero``) lists the blocks the load is about to write: on a GPU the
zeroing runs on the compute stream while the load writes from its own, so it could wipe
what the load wrote.

How (vLLM 0.23's and 0.26's own code, backported): the waiting loop's split runs only
``if self.need_mamba_block_aligned_split and not load_kv_async`` (0.23 - 0.26 read so;
0.27+ split only in the branch after ``if load_kv_async``). ``schedule`` is compiled again
from its own source with that one condition changed (found in its syntax tree, checked
at apply time: a schedule of another shape leaves the patch ``failed``, and the connector
refuses hybrid hits as before); everything else is vLLM's code, line for line (its
traceback lines are the file's own). After it returns, the blocks of every request that
waits for its async load are taken out of ``new_block_ids_to_zero``
(0.26's ``_skip_zero_block_ids``): the blocks a step allocates for a waiting async load
are the load's targets only (its ``num_new_tokens`` is 0).

vLLM 0.23 - 0.25 skip the split for an async load already (``and not load_kv_async``) but
still zero its blocks in the step that allocates them: their record (era ``vllm-0.23``)
runs vLLM's own ``schedule`` and then the same zeroing filter, after checking at apply
time that the split is the guarded one (:func:`check_split_guarded`).
"""

from __future__ import annotations

from typing import Any

from ucm_patch.mamba_split import ASYNC as _ASYNC
from ucm_patch.mamba_split import SPLIT as _SPLIT
from ucm_patch.records import PatchRecord, records_from_rows
from ucm_patch.source_checks import leading
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    import ast
    from collections.abc import Callable

    from ucm_patch.records import Wrapper

NAME = "hybrid_async_load"
#: The patch set's one-line description (docs/PATCHES.md, ucm-patch status).
DESCRIPTION = (
    "Let a hybrid model's async KV load past vLLM 0.22's mamba align split, and out of its "
    "step's KV zeroing on 0.22 - 0.25."
)

WHY = (
    "vLLM 0.22's Scheduler.schedule runs the mamba align split for a request whose KV "
    "loads asynchronously (a hybrid model's hit): _mamba_block_aligned_split asserts that "
    "no external token arrives and the engine core dies (past it, its 0 would end the "
    "step's scheduling), and the step's KV zeroing lists the blocks the load writes. The "
    "patch runs schedule compiled from its own source with the split under `and not "
    "load_kv_async` (vLLM 0.23+), and drops an async load's blocks from "
    "new_block_ids_to_zero (vLLM 0.26's _skip_zero_block_ids)."
)
REMOVAL = (
    "Delete with vLLM 0.22 support: 0.23 skips the split for an async load, 0.26 also "
    "keeps its blocks out of the zeroing."
)
RETIRED = (
    "vLLM 0.23: `if self.need_mamba_block_aligned_split and not load_kv_async`; vLLM 0.26: "
    "Scheduler._skip_zero_block_ids (get_zeroing_block_ids_in_range)."
)

WHY_ZEROING = (
    "vLLM 0.23 - 0.25's Scheduler.schedule lists the blocks a step allocates for a request "
    "waiting for its async KV load (a hybrid model's hit) in new_block_ids_to_zero: on a "
    "GPU the zeroing runs on the compute stream while the load writes from its own, so it "
    "could wipe what the load wrote. The patch drops those blocks from the list after "
    "vLLM's own schedule returns (vLLM 0.26's _skip_zero_block_ids)."
)
REMOVAL_ZEROING = (
    "Delete with vLLM 0.25 support: 0.26 keeps an async load's blocks out of the zeroing."
)
RETIRED_ZEROING = "vLLM 0.26: Scheduler._skip_zero_block_ids (get_zeroing_block_ids_in_range)."

#: What the connector reads to know that this vLLM's schedule was patched so
#: (``ucm_patch.connector.vllm_support``): the record's name, the prefix of its ids.
BACKPORTED = NAME

PARAMS = ("self",)

_FLAG = "need_mamba_block_aligned_split"


def _is_flag(test: ast.expr) -> bool:
    import ast

    return (
        isinstance(test, ast.Attribute) and test.attr == _FLAG
        and isinstance(test.value, ast.Name) and test.value.id == "self"
    )  # fmt: skip


def _splits_external(body: list[ast.stmt]) -> bool:
    """``body`` calls the split with ``num_external_computed_tokens`` (the waiting loop's
    call; the running loop's passes no external tokens)."""
    import ast

    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == _SPLIT
        and any(isinstance(a, ast.Name) and a.id == "num_external_computed_tokens" for a in n.args)
        for stmt in body
        for n in ast.walk(stmt)
    )  # fmt: skip


def _assigns_async(tree: ast.Module) -> bool:
    import ast

    return any(
        isinstance(n, ast.Name) and n.id == _ASYNC and isinstance(n.ctx, ast.Store)
        for n in ast.walk(tree)
    )


def _unguarded_splits(tree: ast.Module) -> list[ast.If]:
    """The ``if self.need_mamba_block_aligned_split:`` blocks (the flag alone) whose body
    splits with the external tokens: vLLM 0.22's waiting loop has one, 0.23 - 0.26 none
    (0.27+ has one again, in the branch after ``if load_kv_async:``)."""
    import ast

    return [
        n for n in ast.walk(tree)
        if isinstance(n, ast.If) and _is_flag(n.test) and _splits_external(n.body)
    ]  # fmt: skip


def guard_split(tree: ast.Module) -> str | None:
    """Change the waiting loop's ``if self.need_mamba_block_aligned_split:`` (whose body
    splits with the external tokens) into ``... and not load_kv_async``, in place: None
    when done, else why it cannot be (the shape it needs, named)."""
    import ast

    if not _assigns_async(tree):
        return f"Scheduler.schedule no longer sets {_ASYNC}"
    found = _unguarded_splits(tree)
    if len(found) != 1:
        return (
            f"Scheduler.schedule has {len(found)} `if self.{_FLAG}:` blocks calling "
            f"{_SPLIT} with num_external_computed_tokens (expected 1)"
        )
    node = found[0]
    node.test = ast.BoolOp(
        op=ast.And(),
        values=[node.test, ast.UnaryOp(op=ast.Not(), operand=ast.Name(id=_ASYNC, ctx=ast.Load()))],
    )
    ast.copy_location(node.test, node)
    ast.fix_missing_locations(node)
    return None


def compile_guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (vLLM's ``Scheduler.schedule``) compiled again with :func:`guard_split`, in
    its own module's globals, at its own file's line numbers. SignatureChanged (the
    patch is then ``failed``) when its source cannot be read or has another shape."""
    import ast
    import inspect
    import textwrap

    from ucm_patch.installer import SignatureChanged  # apply time: not on import ucm_patch

    code = getattr(fn, "__code__", None)
    if code is None or code.co_freevars:
        raise SignatureChanged("Scheduler.schedule is not a plain function (a closure?)")
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        filename = inspect.getsourcefile(fn) or code.co_filename
    except (OSError, TypeError) as exc:
        raise SignatureChanged(f"Scheduler.schedule's source cannot be read: {exc}") from exc
    tree = ast.parse(source)
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        raise SignatureChanged("Scheduler.schedule's source is not one plain def")
    if tree.body[0].decorator_list:
        raise SignatureChanged("Scheduler.schedule is decorated (compiled again, it would not be)")
    why = guard_split(tree)
    if why is not None:
        raise SignatureChanged(why)
    ast.increment_lineno(tree, code.co_firstlineno - 1)
    namespace: dict[str, Any] = {}
    exec(compile(tree, filename, "exec"), fn.__globals__, namespace)
    guarded = namespace[fn.__name__]
    guarded.__qualname__, guarded.__doc__ = fn.__qualname__, fn.__doc__
    guarded.__defaults__, guarded.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__
    return guarded


def skip_async_load_blocks(scheduler: Any, output: Any, waiting: Any) -> None:
    """Take the blocks of every request waiting for its async load (status ``waiting``,
    vLLM's ``RequestStatus.WAITING_FOR_REMOTE_KVS``, bound at apply time: nothing is
    imported per step) out of the step's KV zeroing (``output.new_block_ids_to_zero``).
    vLLM 0.22 keeps such a request in ``skipped_waiting`` (where ``schedule`` put it this
    step), not in ``waiting``: both are read."""
    ids = getattr(output, "new_block_ids_to_zero", None)
    if not ids:
        return
    manager = scheduler.kv_cache_manager
    skip = {
        b
        for queue in (scheduler.waiting, getattr(scheduler, "skipped_waiting", ()))
        for request in queue
        if request.status == waiting
        for group in manager.get_block_ids(request.request_id)
        for b in group
    }
    if skip:
        output.new_block_ids_to_zero = [b for b in ids if b not in skip] or None


def make_schedule_wrapper() -> Wrapper:
    """``Scheduler.schedule``: :func:`compile_guarded`'s schedule (made here, at apply
    time, so that another shape fails the patch at start), then
    :func:`skip_async_load_blocks`."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    from ucm_patch.guard import host_raised

    waiting = RequestStatus.WAITING_FOR_REMOTE_KVS

    original = Scheduler.__dict__["schedule"]
    original = getattr(original, "__wrapped__", original)
    guarded = compile_guarded(original)

    def schedule(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if not getattr(instance, "need_mamba_block_aligned_split", False):
            return wrapped(*args, **kwargs)  # no mamba align split: vLLM's own schedule
        try:
            output = guarded(instance, *args, **kwargs)
        except Exception as exc:
            # vLLM's own code raised (its schedule, one condition apart): the engine's
            # error, propagated as it is, never run again by the call-time guard
            host_raised(exc)
            raise
        skip_async_load_blocks(instance, output, waiting)
        return output

    return schedule


def check_split_guarded(fn: Callable[..., Any]) -> None:
    """``fn`` (vLLM 0.23 - 0.25's ``Scheduler.schedule``) already skips the waiting loop's
    align split for an async load and lists ``new_block_ids_to_zero``: SignatureChanged
    (the patch is then ``failed``) otherwise, naming what differs."""
    import ast
    import inspect
    import textwrap

    from ucm_patch.installer import SignatureChanged  # apply time: not on import ucm_patch
    from ucm_patch.mamba_split import skips_split_for_async

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError) as exc:
        raise SignatureChanged(f"Scheduler.schedule's source cannot be read: {exc}") from exc
    if not _assigns_async(tree):
        raise SignatureChanged(f"Scheduler.schedule no longer sets {_ASYNC}")
    if not skips_split_for_async(tree):
        raise SignatureChanged(
            f"Scheduler.schedule runs {_SPLIT} for an async load (vLLM 0.22's shape: the "
            "vllm-0.22 record's)"
        )
    zeroing = "new_block_ids_to_zero"  # a local, or SchedulerOutput's keyword
    if not any(
        (isinstance(n, ast.Name) and n.id == zeroing)
        or (isinstance(n, ast.keyword) and n.arg == zeroing)
        for n in ast.walk(tree)
    ):
        raise SignatureChanged(f"Scheduler.schedule no longer builds {zeroing}")


def make_zeroing_wrapper() -> Wrapper:
    """``Scheduler.schedule`` of vLLM 0.23 - 0.25 (checked by :func:`check_split_guarded`
    at apply time): vLLM's own, then :func:`skip_async_load_blocks`."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    original = Scheduler.__dict__["schedule"]
    check_split_guarded(getattr(original, "__wrapped__", original))
    waiting = RequestStatus.WAITING_FOR_REMOTE_KVS

    def schedule(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        output = wrapped(*args, **kwargs)
        if getattr(instance, "need_mamba_block_aligned_split", False):
            skip_async_load_blocks(instance, output, waiting)
        return output

    return schedule


RECORDS: tuple[PatchRecord, ...] = records_from_rows(
    NAME,
    "vllm",
    "era target requires upstream expect",
    (
        (
            "vllm-0.22",
            "vllm.v1.core.sched.scheduler:Scheduler.schedule",
            ">=0.22,<0.23",
            "vLLM 0.22: v1/core/sched/scheduler.py Scheduler.schedule runs "
            "`if self.need_mamba_block_aligned_split:` -> _mamba_block_aligned_split(request, "
            "num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens) for "
            "every waiting request, whose `assert num_external_computed_tokens == 0` reads "
            '"External KV connector is not verified yet"; 0.23 adds `and not load_kv_async`. '
            "0.26 adds _skip_zero_block_ids (KVCacheManager.get_zeroing_block_ids_in_range) "
            "for the blocks an async load overwrites.",
            (leading(PARAMS),),
        ),
        (
            "vllm-0.23",
            "vllm.v1.core.sched.scheduler:Scheduler.schedule",
            ">=0.23,<0.26",
            "vLLM 0.23 - 0.25: v1/core/sched/scheduler.py Scheduler.schedule's waiting loop "
            "splits under `if self.need_mamba_block_aligned_split and not load_kv_async`, "
            "puts an async load's request into skipped_waiting and builds "
            "new_block_ids_to_zero from KVCacheManager.take_new_block_ids(), the load's "
            "blocks included; 0.26 adds _skip_zero_block_ids.",
            (leading(PARAMS),),
            {
                "make_wrapper": make_zeroing_wrapper,
                "why": WHY_ZEROING,
                "removal": REMOVAL_ZEROING,
                "retired": RETIRED_ZEROING,
            },
        ),
    ),
    make_wrapper=make_schedule_wrapper,
    why=WHY,
    removal=REMOVAL,
    retired=RETIRED,
)
