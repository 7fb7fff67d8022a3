"""Exact-signature trampolines: what the registry installs in place of a plain function.

Why not wrapt's ``FunctionWrapper`` for these: the per-layer hooks run once per layer per
step, with budgets of 1 us (no connector) and 2 us (connector, nothing to dump) per call.
A method wrapped in a ``FunctionWrapper`` costs about a whole budget over a bare call even
when ``enabled`` sends the call straight to the original (``scripts/bench_hooks.py``, the
``wrapt`` rows in docs/BENCHMARKS.md): every attribute access allocates a bound
wrapper, and a keyword call is repacked into a dict twice (once by wrapt, once by the
``wrapped(*args, **kwargs)`` hop). A plain function with the original's own parameter
list costs a small fraction of that: Python binds it like any method (no allocation for
``obj.meth(...)``), and vLLM's keyword calls land in real parameters.

So the trampoline for ``def _forward_core(self, mixed_qkv, b, a, core_attn_out)`` is,
generated from the original's code object (simplified)::

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        if not enabled() or cell.broken:        # skip_when (no KV connector) / broken
            return original(self, mixed_qkv, b, a, core_attn_out)
        try:                                    # ucm_patch.guard's logic, inline
            return wrapper(shim, self, (mixed_qkv, b, a, core_attn_out), EMPTY_KWARGS)
        except Exception as exc:
            return recover(exc, self, (mixed_qkv, b, a, core_attn_out), EMPTY_KWARGS)

``wrapper`` is the patch's wrapt-style wrapper ``(wrapped, instance, args, kwargs)`` and
``shim`` an exact-signature stand-in for the original that records the call's progress
for ``recover`` (:mod:`ucm_patch.guard`), so a patch's wrapper works unchanged under
either installer. One difference a wrapper may rely on: under a trampoline every
parameter before ``*`` arrives in ``args`` in declaration order (positionally, whatever
the caller used) and ``kwargs`` holds only keyword-only ones (treat it as read-only).

It is compiled once per signature *shape* (parameter names are placeholders, renamed in
the code object per target), so applying a record is cheap once its shape is known.

wrapt still installs everything a trampoline cannot express (:func:`supports`): callables
that are not plain functions (``staticmethod``, builtins, other proxies) and functions
with ``*args`` / ``**kwargs``. Introspection matches wrapt's: ``functools.wraps`` copies
name, qualname, module, doc and annotations and sets ``__wrapped__`` (so
``inspect.signature``, and torch's schema inference for a lazily registered op kernel,
see the original).

The source is built from the original's parameter *names* only (identifiers by
construction); defaults are passed in as objects, never rendered as text.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

from ucm_patch import guard, trampoline_cache
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

    from ucm_patch.records import Wrapper

_CO_VARARGS = 0x04
_CO_VARKEYWORDS = 0x08
_PREFIX = "_ucm_tr_"  # generated names; a target parameter with this prefix is not supported
# Passed as ``kwargs`` when the target has no keyword-only parameter. A shared dict, not a
# read-only mapping: ``wrapped(*args, **kwargs)`` merges a dict at C speed, a mapping
# proxy through ``keys()``. Wrappers treat ``kwargs`` as read-only (none of ours writes it).
EMPTY_KWARGS: dict[str, Any] = {}
_RENAMES = f"{_PREFIX}renames"  # key in a build's env: placeholder -> real parameter name


def supports(original: Any, method: bool) -> bool:
    """True if a trampoline can stand in for ``original`` exactly.

    ``method``: ``original`` sits on a class, so its first parameter is the instance.
    """
    if type(original) is not types.FunctionType:
        return False
    code = original.__code__
    if code.co_flags & (_CO_VARARGS | _CO_VARKEYWORDS):
        return False
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    if method and code.co_argcount == 0:
        return False
    return not any(n.startswith(_PREFIX) for n in names)


class _Parameters:
    """The parameter list of a plain function, read from its code object (no ``inspect``:
    it is slow to import and is never needed on the paths the trampoline serves).

    ``drop_first``: leave out the first parameter (a method's instance, supplied by the
    caller from elsewhere)."""

    def __init__(self, fn: types.FunctionType, drop_first: bool, env: dict[str, Any]) -> None:
        code = fn.__code__
        n_pos, n_kw = code.co_argcount, code.co_kwonlyargcount
        names = code.co_varnames
        if not n_kw:
            # Placeholders instead of the real names, renamed in the compiled code (see
            # _build): one compile per signature *shape*. Keyword-only names also appear
            # as string constants (the kwargs dict), so those functions keep real names.
            names = tuple(f"{_PREFIX}a{i}" for i in range(n_pos)) + names[n_pos:]
            for placeholder, real in zip(names, code.co_varnames[:n_pos], strict=False):
                env.setdefault(_RENAMES, {})[placeholder] = real
        skip = 1 if drop_first else 0
        self.positional = list(names[skip:n_pos])
        self.kwonly = list(names[n_pos : n_pos + n_kw])
        defaults = fn.__defaults__ or ()
        kwdefaults = fn.__kwdefaults__ or {}
        first_default = n_pos - len(defaults)
        parts: list[str] = []
        for i in range(skip, n_pos):
            name = names[i]
            if i >= first_default:
                env[f"{_PREFIX}d{i}"] = defaults[i - first_default]
                parts.append(f"{name}={_PREFIX}d{i}")
            else:
                parts.append(name)
            if i + 1 == code.co_posonlyargcount:
                parts.append("/")
        if self.kwonly:
            parts.append("*")
            for name in self.kwonly:
                if name in kwdefaults:
                    env[f"{_PREFIX}k_{name}"] = kwdefaults[name]
                    parts.append(f"{name}={_PREFIX}k_{name}")
                else:
                    parts.append(name)
        self.source = ", ".join(parts)

    def call(self, *leading: str) -> str:
        """Arguments forwarding every parameter, after ``leading`` positional ones."""
        return ", ".join([*leading, *self.positional, *(f"{k}={k}" for k in self.kwonly)])

    def args_tuple(self) -> str:
        return "(" + "".join(f"{p}, " for p in self.positional) + ")"

    def kwargs_dict(self) -> str:
        if not self.kwonly:
            return f"{_PREFIX}empty"
        return "{" + ", ".join(f"{k!r}: {k}" for k in self.kwonly) + "}"


@functools.lru_cache(maxsize=128)
def _compile_factory(src: str) -> types.CodeType:
    """The factory's code object for ``src`` (compiled once per signature shape, and kept
    for later processes: :mod:`ucm_patch.trampoline_cache`)."""
    module_code = trampoline_cache.get(src)
    if module_code is None:
        module_code = compile(src, "<ucm_patch>", "exec")  # names only: see module docstring
        trampoline_cache.put(src, module_code)
    return next(c for c in module_code.co_consts if isinstance(c, types.CodeType))


def _build(
    original: types.FunctionType, what: str, head: str, body: list[str], env: dict[str, Any]
) -> types.FunctionType:
    """Compile ``def <name>(<head>): <body>`` with ``env`` bound as closure cells of a
    factory (LOAD_DEREF: no globals lookup per call) and give it ``original``'s identity."""
    renames = env.pop(_RENAMES, {})
    fn = f"{_PREFIX}fn"
    src = f"def {_PREFIX}factory({', '.join(env)}):\n    def {fn}({head}):\n"
    src += "".join(f"        {line}\n" for line in body) + f"    return {fn}\n"
    factory_code = _compile_factory(src)
    # Give the compiled shape this target's parameter names (keyword binding reads
    # co_varnames; the bytecode addresses locals by index) and a name and file that say
    # whose frame it is in a traceback.
    filename = f"<ucm_patch {what} for {original.__module__}.{original.__qualname__}>"
    name = original.__code__.co_name
    inner = next(c for c in factory_code.co_consts if isinstance(c, types.CodeType))
    inner_named = inner.replace(
        co_varnames=tuple(renames.get(v, v) for v in inner.co_varnames),
        co_name=name,
        co_filename=filename,
    )
    factory_code = factory_code.replace(
        co_consts=tuple(inner_named if c is inner else c for c in factory_code.co_consts),
        co_filename=filename,
    )
    # The original's globals, not a scratch namespace: torch.library.infer_schema (vLLM
    # registering a lazily defined op kernel) evaluates string annotations in the
    # function's ``__globals__``. Everything the body uses is a closure cell or a builtin,
    # so nothing is written to, or read by name from, the host module.
    factory = types.FunctionType(factory_code, original.__globals__)
    made = factory(**env)
    functools.update_wrapper(made, original)
    return made


def make_trampoline(
    original: types.FunctionType,
    wrapper: Wrapper,
    enabled: Callable[[], Any] | None,
    method: bool,
    cell: guard.CallCell,
    on_failure: Callable[[BaseException], None],
    strict: Callable[[], bool],
) -> types.FunctionType:
    """The guarded trampoline for ``original`` (only call when :func:`supports`).

    ``wrapper`` is the patch's wrapt-style wrapper; the trampoline runs
    :func:`ucm_patch.guard.make_guard`'s logic inline (one Python frame less per call than
    calling a guard) and hands the wrapper an exact-signature shim. ``enabled``: see
    :func:`ucm_patch.guard.make_enabled` (None: no check).
    """
    P = _PREFIX
    env: dict[str, Any] = {
        f"{P}original": original,
        f"{P}wrapper": wrapper,
        f"{P}enabled": enabled,
        f"{P}cell": cell,
        f"{P}shim": _make_shim(original, cell, method),
        f"{P}recover": guard.make_recover(cell, original, on_failure, strict),
        f"{P}empty": EMPTY_KWARGS,
    }
    full = _Parameters(original, False, env)
    rest = _Parameters(original, method, env)
    instance = full.positional[0] if method else "None"
    call_args = f"{instance}, {rest.args_tuple()}, {rest.kwargs_dict()}"
    passthrough = f"    return {P}original({full.call()})"
    body: list[str] = []
    if enabled is not None:
        body += [f"if not {P}enabled():", passthrough]
    body += [f"if {P}cell.broken:", passthrough]
    if method:
        body.append(f"{P}cell.instance = {instance}")
    body += [
        f"{P}cell.state = {guard.IDLE}",
        "try:",
        f"    {P}out = {P}wrapper({P}shim, {call_args})",
        f"except Exception as {P}exc:",
        f"    return {P}recover({P}exc, {call_args})",
        f"{P}cell.result = {P}cell.instance = None  # do not keep the host's objects alive",
        f"return {P}out",
    ]
    return _build(original, "trampoline", full.source, body, env)


def _make_shim(original: types.FunctionType, cell: guard.CallCell, method: bool) -> Any:
    """:func:`ucm_patch.guard.make_shim` with the original's own parameters (minus the
    instance for a method, read from ``cell.instance``): the patch wrapper's
    ``wrapped(*args, **kwargs)`` then binds straight to parameters, with no second
    ``*args`` tuple or ``**kwargs`` dict per call."""
    P = _PREFIX
    env: dict[str, Any] = {f"{P}original": original, f"{P}cell": cell}
    params = _Parameters(original, method, env)
    lead = (f"{P}cell.instance",) if method else ()
    body = [
        f"{P}cell.state = {guard.RUNNING}",
        f"{P}result = {P}original({params.call(*lead)})",
        f"{P}cell.result = {P}result",
        f"{P}cell.state = {guard.RETURNED}",
        f"return {P}result",
    ]
    return _build(original, "shim", params.source, body, env)
