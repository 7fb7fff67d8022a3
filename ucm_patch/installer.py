"""The installer: puts one record's wrapper on its target, and takes it off again.

The registry (:mod:`ucm_patch.registry`) decides *whether* and *when* a record is applied
and keeps its state; this module does the work on the imported target module:

* **install** (:func:`install`): resolve the target, refuse one that already carries the
  record's marker, check the live signature against the record's ``leading`` parameters
  (:class:`SignatureChanged`: a wrapper must never misread its arguments), ask
  :mod:`ucm_patch.native` which of the record's hooks upstream already makes (all of them:
  :class:`NativeHooks`, the record stands down; some: the wrapper adds the rest), build the
  wrapper (an exact-signature trampoline for a plain function,
  :mod:`ucm_patch.trampoline`; a wrapt ``FunctionWrapper`` for anything else; both run the
  call-time guard of :mod:`ucm_patch.guard`), mark it, override the op kernel for an
  ``op-kernel`` record, and set it on the parent.
* **uninstall** (:func:`uninstall`): restore the exact original only while the attribute
  still is our wrapper; report anything else instead of touching it.

Nothing here takes the registry's lock or changes a record's state: the registry calls it
outside its lock (a factory may import) and records the outcome.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable

from ucm_patch import capture_break, guard, kernel_ledger, native, trampoline
from ucm_patch.native import MARKER as MARKER  # re-exported: the mark install() sets
from ucm_patch.records import Kind, PatchRecord
from ucm_patch.source_checks import apply_time_params
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any


class SignatureChanged(Exception):
    """The live target's parameters differ from the ones the record's wrapper reads."""


class NativeHooks(Exception):
    """The target already makes every connector call the record would add."""


class Applied:
    """What a revert needs: where the wrapper went and what it replaced (and, for the
    status, which hooks it adds and what native calls it found)."""

    __slots__ = (
        "attribute",
        "cell",
        "hooks",
        "library",
        "native",
        "original",
        "owned_attribute",
        "parent",
        "wrapper",
    )

    def __init__(
        self,
        parent: Any,
        attribute: str,
        original: Any,
        wrapper: Any,
        owned_attribute: bool,
        library: Any = None,
        cell: Any = None,
        hooks: tuple[str, ...] = (),
        native: str = "",
    ) -> None:
        self.parent = parent
        self.attribute = attribute
        self.original = original
        self.wrapper = wrapper
        # True when the original lived in parent.__dict__ (else it was inherited and a
        # revert deletes our attribute instead of assigning the original back).
        self.owned_attribute = owned_attribute
        self.library = library  # torch.library.Library holding an op-kernel override
        self.cell = cell  # guard.CallCell; set broken on revert for stray references
        self.hooks = hooks  # the connector calls this wrapper adds
        self.native = native  # what upstream already does around the target ("" if none)


def static_get(parent: Any, attribute: str) -> Any:
    """The attribute as stored (class ``__dict__`` for classes: no descriptor binding)."""
    if isinstance(parent, type):
        for klass in parent.__mro__:
            if attribute in vars(klass):
                return vars(klass)[attribute]
        raise AttributeError(attribute)
    return getattr(parent, attribute)


def is_ours(obj: Any, record_id: str) -> bool:
    """True if ``obj`` or anything it wraps carries our marker for ``record_id``."""
    seen = 0
    while obj is not None and seen < 32:
        if getattr(obj, MARKER, None) == record_id:
            return True
        obj = getattr(obj, "__wrapped__", None)
        seen += 1
    return False


def resolve(record: PatchRecord, module: Any) -> tuple[Any, str, Any] | str:
    """(parent, attribute, original) or a reason string when the target is missing."""
    parts = record.qualname.split(".")
    parent = module
    for i, part in enumerate(parts[:-1]):
        if not hasattr(parent, part):
            where = ".".join([record.module, *parts[:i]])
            return f"{where} has no attribute {part!r} (target {record.target})"
        parent = getattr(parent, part)
    attribute = parts[-1]
    try:
        original = static_get(parent, attribute)
    except AttributeError:
        owner = ".".join(parts[:-1]) or "<module>"
        return f"{record.module}:{owner} has no attribute {attribute!r}"
    return parent, attribute, original


def _dispatch_key(record: PatchRecord) -> str:
    key = record.dispatch_key or ""
    if ":" not in key:
        return key
    mod, _, attr = key.partition(":")
    fn: Callable[[], str] = getattr(importlib.import_module(mod), attr)
    return fn()


def install(
    record: PatchRecord,
    module: Any,
    on_call_failure: Callable[[BaseException], None],
    strict: Callable[[], bool],
) -> tuple[Applied | None, str | None]:
    """Apply one record to its imported module. Raises on unexpected errors.

    ``on_call_failure`` / ``strict`` feed the call-time guard (see :mod:`ucm_patch.guard`).
    """
    resolved = resolve(record, module)
    if isinstance(resolved, str):
        return None, resolved
    parent, attribute, original = resolved
    if is_ours(original, record.id):
        # Another registry instance (or a reloaded ucm_patch) already wrapped it.
        return None, f"{record.target} already carries this patch; not wrapped twice"
    check_signature(record, original)
    hooks, found = record.hooks, ""
    if hooks:
        finding = native.detect(record, module, original)
        found = finding.describe(hooks)
        missing = finding.missing(hooks)
        if not missing:
            raise NativeHooks(f"upstream already calls the connector here ({found})")
        hooks = missing
    owned = not isinstance(parent, type) or attribute in vars(parent)
    # A factory is asked for a subset only when upstream makes the other calls: every
    # layer-record factory accepts ``hooks``; the others keep their plain signature.
    patch_wrapper = (
        record.make_wrapper(hooks=hooks) if hooks != record.hooks else record.make_wrapper()
    )
    method = isinstance(parent, type)
    # vLLM's @eager_break_during_capture must stay outermost: wrap what it holds, decorate
    # the wrapper again (see capture_break).
    inner, redecorate = capture_break.split(original)
    as_classmethod = isinstance(inner, classmethod) and guard.guardable(inner.__func__)
    if as_classmethod:
        # Guard the function a classmethod holds (the class arrives as the instance) and
        # make the result a classmethod again: wrapt around the descriptor itself would
        # install no call-time guard, and a raising wrapper would reach the host.
        inner, method = inner.__func__, True
    cell = None
    if not guard.guardable(inner):
        import wrapt  # here, not at import: see importhooks' docstring

        skip = record.skip_when
        enabled = None if skip is None else lambda: not skip()
        wrapper = wrapt.FunctionWrapper(inner, patch_wrapper, enabled=enabled)
    else:
        cell = guard.CallCell()
        enabled = guard.make_enabled(cell, record.skip_when)
        if trampoline.supports(inner, method):
            wrapper = trampoline.make_trampoline(
                inner, patch_wrapper, enabled, method, cell, on_call_failure, strict
            )
        else:
            import wrapt

            guarded = guard.make_guard(patch_wrapper, cell, inner, on_call_failure, strict)
            wrapper = wrapt.FunctionWrapper(inner, guarded, enabled=enabled)
    if redecorate is not None:
        setattr(wrapper, MARKER, record.id)
        wrapper = redecorate(wrapper)
    if as_classmethod:
        wrapper = classmethod(wrapper)  # one marker, on what is installed
    setattr(wrapper, MARKER, record.id)
    library = None
    if record.kind is Kind.OP_KERNEL:
        library = _override_kernel(record, wrapper)
    setattr(parent, attribute, wrapper)
    applied = Applied(parent, attribute, original, wrapper, owned, library, cell, hooks, found)
    return applied, None


def live_params(original: Any) -> tuple[str, ...] | None:
    """Parameter names of the live target (through ``__wrapped__``), None if unreadable."""
    import inspect  # apply time only

    fn = getattr(original, "__func__", original)  # staticmethod / classmethod in __dict__
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def check_signature(record: PatchRecord, original: Any) -> None:
    """Raise :class:`SignatureChanged` unless the live target has the parameters the
    record's wrapper reads (:func:`ucm_patch.source_checks.apply_time_params`: the same facts
    ``tools.verify`` checks in source, read for the object really found here)."""
    options = apply_time_params(record.target, record.expect)
    if not options:
        return
    found = live_params(original)
    for expected, exact in options:
        if found is not None and (
            found == expected if exact else found[: len(expected)] == expected
        ):
            return
    want = " or ".join(
        f"({', '.join(p)})" if exact else f"({', '.join(p)}, ...)" for p, exact in options
    )
    shown = "unreadable" if found is None else f"({', '.join(found)})"
    raise SignatureChanged(f"signature changed: expected {want}, found {shown} on {record.target}")


def _override_kernel(record: PatchRecord, kernel: Any) -> Any:
    """Register ``kernel`` as the op's implementation for the platform's dispatch key.

    Only the kernel is overridden (``allow_override``); the op is never defined again
    (torch rejects a duplicate definition). Destroying the returned library removes our
    registration and the previous kernel is current again (used by revert).
    """
    import torch

    assert record.op is not None
    namespace, _, op_name = record.op.partition("::")
    dispatch_key = _dispatch_key(record)
    if not hasattr(getattr(torch.ops, namespace), op_name):
        # Registered lazily (vLLM 0.21+ CPU GDN: register_cpu_gdn_attention_ops() runs in
        # the layer's __init__ and reads the module global): the wrapper set on the module
        # attribute is what vLLM will register, so there is nothing to override.
        return None
    # A kernel registered through @eager_break_during_capture (vLLM 0.28+ XPU GDN op) keeps
    # it outermost: the wrapper is built around the module's undecorated function.
    _, redecorate = capture_break.split(kernel_ledger.registered(record.op))
    if redecorate is not None and not capture_break.is_capture_break(kernel):
        marker = getattr(kernel, MARKER, None)
        kernel = redecorate(kernel)
        setattr(kernel, MARKER, marker)
    library = torch.library.Library(namespace, "IMPL")
    try:
        with warnings.catch_warnings():
            # torch warns "Overriding a previously registered kernel": that is the point.
            warnings.simplefilter("ignore", UserWarning)
            library.impl(op_name, kernel, dispatch_key, allow_override=True)
    except BaseException:
        library._destroy()
        raise
    return library


def uninstall(applied: Applied, target: str) -> str | None:
    """Put the original back; None when done, else why it was left as it is.

    Refused when the attribute is no longer our wrapper (something replaced or re-wrapped
    it): assigning the original would silently drop that newer object.
    """
    current = static_get(applied.parent, applied.attribute)
    if current is not applied.wrapper:
        return (
            f"{target} is no longer our wrapper (replaced by "
            f"{type(current).__name__}); left as it is"
        )
    if applied.owned_attribute:
        setattr(applied.parent, applied.attribute, applied.original)
    else:
        delattr(applied.parent, applied.attribute)
    if applied.library is not None:
        applied.library._destroy()  # drops our kernel; the original is current again
    if applied.cell is not None:
        # References we cannot take back (a kernel vLLM registered from the wrapped
        # module attribute, a `from x import f` copy) now pass straight through.
        applied.cell.broken = True
    return None
