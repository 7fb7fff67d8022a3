"""Native-hook detection: does upstream already call the KV connector around a target?

Upstream catches up: vLLM brackets attention with its ``maybe_transfer_kv_layer``
decorator and may do the same for GDN ops; vLLM-Ascend main waits for the layer inside its
GDN core itself (vllm-ascend PR #12711). A layer record that wraps such a target anyway
makes the connector see every wait and save twice. So, at apply time, the registry asks
this module which of a record's ``hooks`` upstream already makes, and

* a record whose every hook is made natively stands down (state ``native``, with what was
  found as the reason);
* a record that finds only some is built for the rest (``make_wrapper(hooks=missing)``).

Where it looks: the record's target, the callers it names (an op ``"ns::name"``: the
kernel registered for that op, from :mod:`ucm_patch.kernel_ledger`, else the function of
that name in the target's module; or a ``"module:qualname"``), and for an op-kernel record
its own op. Each object is followed down its ``__wrapped__`` chain (``functools.wraps``,
wrapt proxies, bound methods, partials), so a decorator such as ``maybe_transfer_kv_layer``
is seen wherever it sits. Each function's own bytecode is scanned for a load of a
connector call: ``wait_for_kv_layer_from_connector`` / ``wait_for_layer_load`` count as a
wait, ``maybe_save_kv_layer_to_connector`` / ``save_kv_layer`` as a save, except a save
whose first argument is the constant ``""`` (vLLM-Ascend's nameless layer-counting call
``maybe_save_kv_layer_to_connector("", [])``, which saves nothing: the record keeps its
save and its ``-anon`` filter drops that call).

What it does not see: a call made through a helper the function calls (only the
function's own code is scanned). ucm_patch's own wrappers are skipped, so a wrapper we
installed earlier never reads as "upstream does it".
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable, Iterator

from ucm_patch import kernel_ledger
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

    from ucm_patch.records import PatchRecord

WAIT_CALLS = frozenset({"wait_for_kv_layer_from_connector", "wait_for_layer_load"})
SAVE_CALLS = frozenset({"maybe_save_kv_layer_to_connector", "save_kv_layer"})
_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR", "LOAD_METHOD", "LOAD_DEREF"})
# The attribute every wrapper the installer makes carries: the record id (wrapt keeps
# `_self_*` attributes on the proxy itself). Defined here, where our wrappers are skipped,
# because the installer imports this module; it re-exports it as ``installer.MARKER``.
MARKER = "_self_ucm_patch_id"
_OWN_FILES = ("<ucm_patch ",)  # trampolines' code objects
_MAX_CHAIN = 32


class Finding:
    """What native connector calls were found, and where."""

    __slots__ = ("anonymous", "found")

    def __init__(self) -> None:
        self.found: dict[str, str] = {}  # hook ("wait" / "save") -> "<where> calls <name>"
        self.anonymous: list[str] = []  # "<where> calls <name>('', ...)"

    def missing(self, hooks: Iterable[str]) -> tuple[str, ...]:
        return tuple(h for h in hooks if h not in self.found)

    def describe(self, hooks: Iterable[str]) -> str:
        parts = [f"{h}: {self.found[h]}" for h in hooks if h in self.found]
        parts += [f"anonymous save ignored: {a}" for a in self.anonymous]
        return "; ".join(parts)


def detect(record: PatchRecord, module: Any, original: Any) -> Finding:
    """Which of ``record.hooks`` upstream makes around the target ``original``."""
    finding = Finding()
    sites: list[tuple[str, Any]] = [(record.target, original)]
    ops = ((record.op,) if record.op else ()) + tuple(c for c in record.callers if "::" in c)
    for op in ops:
        sites += _op_kernels(op, module)
    for caller in record.callers:
        if "::" not in caller:
            obj = _resolve(caller)
            if obj is not None:
                sites.append((caller, obj))
    for where, obj in sites:
        for fn_where, code in _codes(where, obj):
            _scan(code, fn_where, finding)
    return finding


def _op_kernels(op: str, module: Any) -> list[tuple[str, Any]]:
    """The registered kernel of ``op`` (if the ledger saw it) and its module namesake."""
    out: list[tuple[str, Any]] = []
    kernel = kernel_ledger.registered(op)
    if kernel is not None:
        out.append((f"kernel registered for {op}", kernel))
    short = op.partition("::")[2]
    namesake = getattr(module, short, None)
    if namesake is not None and namesake is not kernel:
        out.append((f"{module.__name__}.{short} (op {op})", namesake))
    return out


def _resolve(path: str) -> Any | None:
    """``"module:Qual.name"`` if its module is importable and has it (else None)."""
    mod_name, _, qualname = path.partition(":")
    mod = sys.modules.get(mod_name)
    if mod is None:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            return None
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def chain(obj: Any) -> Iterator[Any]:
    """``obj`` and everything it wraps (``__wrapped__``, ``__func__``, ``func``)."""
    seen: set[int] = set()
    while obj is not None and id(obj) not in seen and len(seen) < _MAX_CHAIN:
        seen.add(id(obj))
        yield obj
        nxt = getattr(obj, "__wrapped__", None)
        if nxt is None:
            nxt = getattr(obj, "__func__", None)  # bound / class / static method
        if nxt is None and type(obj).__name__ == "partial":
            nxt = getattr(obj, "func", None)
        obj = nxt


def _codes(where: str, obj: Any) -> Iterator[tuple[str, Any]]:
    """(description, code object) of every function down ``obj``'s chain, ours skipped.

    The description names the code that runs (``co_qualname`` and file), not the
    attribute: ``functools.wraps`` copies the wrapped function's name onto a decorator's
    wrapper, and "maybe_transfer_kv_layer.<locals>.wrapper" is what an operator needs.
    """
    for item in chain(obj):
        if getattr(item, MARKER, None) is not None:
            continue  # one of our wrappers: look at what it wraps
        code = getattr(item, "__code__", None)
        if code is None or code.co_filename.startswith(_own_files()):
            continue
        qualname = getattr(code, "co_qualname", code.co_name)
        yield f"{where} -> {qualname} ({code.co_filename.rpartition('/')[2]})", code


def _scan(code: Any, where: str, finding: Finding) -> None:
    names = set(code.co_names) | set(code.co_freevars)
    if not (names & WAIT_CALLS or names & SAVE_CALLS):
        return  # the common case: no connector name at all, no bytecode walk
    import dis  # apply time only

    instructions = list(dis.get_instructions(code))
    for i, ins in enumerate(instructions):
        if ins.opname not in _LOADS:
            continue
        name = ins.argval
        if name in WAIT_CALLS:
            finding.found.setdefault("wait", f"{where} calls {name}")
        elif name in SAVE_CALLS:
            nxt = instructions[i + 1] if i + 1 < len(instructions) else None
            if nxt is not None and nxt.opname == "LOAD_CONST" and nxt.argval == "":
                finding.anonymous.append(f"{where} calls {name}('', ...)")
            else:
                finding.found.setdefault("save", f"{where} calls {name}")


def _own_files() -> tuple[str, ...]:
    """Filename prefixes of ucm_patch's code (the package, its hooks and patches, which
    live in folders of their own in a checkout) and of its generated trampolines."""
    dirs = []
    for name in ("ucm_patch", "ucm_patch.hooks", "ucm_patch.patches"):
        mod = sys.modules.get(name)
        for path in getattr(mod, "__path__", ()):
            dirs.append(path.rstrip("/") + "/")
    return (*_OWN_FILES, *dirs)
