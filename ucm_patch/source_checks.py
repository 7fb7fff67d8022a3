"""What a patch record relies on in its target library's source, as checkable data.

Every record carries ``expect``: a tuple of :class:`Check`. The verification engine
(:mod:`tools.verify`) reads a release's source with ``ast`` (never importing it) and
evaluates each check; the tests evaluate the same checks on the stand-in packages, so a
stand-in cannot drift from the source it imitates. The wrappers take their argument
positions from the very parameter tuples the checks verify (:func:`arg_index`), so "the
signature was checked" and "the wrapper reads the right argument" are one fact, not two.

Patch modules import this at ``import ucm_patch`` time: it stays a namedtuple and a few
constructors.

Kinds (``Check.kind``); ``code`` is ``"module:Qual.name"``:

``signature``      ``(code, params)``: function/method ``code`` exists and its parameter
                   names are exactly ``params``.
``leading``        ``(params,)``: the record's own target exists and its parameter names
                   start with ``params`` (later parameters may come and go between
                   releases without touching the wrapper).
``assigned``       ``(module, target, value)``: a module-level statement (possibly under
                   ``if``/``else``) ``target = value``, e.g. a library copying its method
                   onto another class: the code that runs at the record's target.
``local``          ``(code, name, expr)``: inside ``code``, ``name = expr`` (an expression
                   the wrapper must mirror, such as the one picking a layer's KV cache).
``binding``        ``(module, name)``: ``module`` imports ``name`` by name, at module level,
                   from the library's hook module (vLLM-Ascend: ``attention.utils``).
``anonymous_only`` ``(module, name)``: every call of ``name`` in ``module`` is ``name("", [])``
                   (a layer-counting call; a filter may drop exactly those).
``marks_write``    ``(code,)``: ``code`` (or a ``self.`` method it calls) writes the KV cache
                   or marks that it did, so an event recorded when ``code`` returns follows
                   the write.
``mlapo_no_wait``  ``(code,)``: vLLM-Ascend SFA ``forward`` has a branch on ``enable_mlapo``
                   with no layer wait while another branch has one.
"""

from __future__ import annotations

from collections import namedtuple  # not typing.NamedTuple: typing is slow to import


class Check(namedtuple("Check", ("kind", "args"))):
    """One fact a record needs from its target library's source (see the module docstring)."""

    __slots__ = ()
    kind: str
    args: tuple[str | tuple[str, ...], ...]

    def __str__(self) -> str:
        return f"{self.kind}{self.args!r}"


def signature(code: str, params: tuple[str, ...]) -> Check:
    return Check("signature", (code, params))


def leading(params: tuple[str, ...]) -> Check:
    return Check("leading", (params,))


def assigned(module: str, target: str, value: str) -> Check:
    return Check("assigned", (module, target, value))


def local(code: str, name: str, expr: str) -> Check:
    return Check("local", (code, name, expr))


def binding(module: str, name: str) -> Check:
    return Check("binding", (module, name))


def anonymous_only(module: str, name: str) -> Check:
    return Check("anonymous_only", (module, name))


def marks_write(code: str) -> Check:
    return Check("marks_write", (code,))


def mlapo_no_wait(code: str) -> Check:
    return Check("mlapo_no_wait", (code,))


def leading_params(checks: tuple[Check, ...]) -> tuple[str, ...] | None:
    """The parameters a ``leading`` check among ``checks`` requires, or None without one."""
    for check in checks:
        if check.kind == "leading":
            return check.args[0]  # type: ignore[return-value]
    return None


def apply_time_params(target: str, checks: tuple[Check, ...]) -> list[tuple[tuple[str, ...], bool]]:
    """What the live object at ``target`` must look like, as ``(params, exact)`` options.

    The same source facts ``tools.verify`` checks, read for the object the wrapper will
    really receive: a ``leading`` check (a prefix of the target's parameters); a
    ``signature`` check on ``target`` itself; a ``signature`` check on a function that an
    ``assigned`` check copies onto ``target`` (vLLM-Ascend copying its GDN core onto vLLM's
    class: the live method *is* that function); a ``signature`` check on the name a
    ``binding`` check imports as ``target`` (a by-name import of a hook function). Several
    options (a copy from one of two classes) mean any of them may be live. Empty: the record
    states nothing checkable.
    """
    module, _, qualname = target.partition(":")
    sources = {target}
    for check in checks:
        if check.kind == "assigned" and f"{check.args[0]}:{check.args[1]}" == target:
            sources.add(str(check.args[2]))
        elif check.kind == "binding" and (check.args[0], check.args[1]) == (module, qualname):
            sources.add(str(check.args[1]))
    out: list[tuple[tuple[str, ...], bool]] = []
    for check in checks:
        option = None
        if check.kind == "leading":
            option = (tuple(check.args[0]), False)
        elif check.kind == "signature":
            code = str(check.args[0])
            if code in sources or code.partition(":")[2] in sources:
                option = (tuple(check.args[1]), True)
        if option is not None and option not in out:
            out.append(option)
    return out


def arg_index(params: tuple[str, ...], name: str) -> int:
    """Position of ``name`` among a function's call arguments (``params`` minus ``self``).

    Raises ValueError naming the parameter list when ``name`` is not in it.
    """
    call_params = params[1:] if params and params[0] == "self" else params
    if name not in call_params:
        raise ValueError(f"parameter {name!r} not in {params!r}")
    return call_params.index(name)
