"""The patch registry: applies records when their target module is imported.

Life of a record, per process::

    activate() ── version gate ── toggle ──> waiting-for-import
                     │                │            │ post-import hook (at once if imported)
                     v                v            v
              skipped-version      disabled     signature check ── failed ("signature changed")
              untested-version                     │ native-hook detection ── native
                                                   v
                                     applied | target-missing | failed
                                                   │ revert()
                                                   v
                                                reverted (or revert-refused)

``untested-version``: the installed version is past the ceiling (the exclusive upper
bound) of the patch's newest era, i.e. newer than any release the record was verified on.
Off by default; ``UCM_PATCH_ALLOW_UNTESTED=1`` (or a list of patch names, or
``allow_untested = true`` for a patch in the config file) lets the newest era apply, and it
then still has to pass the signature check and the native-hook detection.
``native``: upstream already makes every connector call the record would add
(:mod:`ucm_patch.native`); the record stands down and says what it found.

Guarantees (each has a test in tests/test_registry_*.py):

* **Never break the host.** Whatever goes wrong while applying (target renamed, factory
  raising, torch.library refusing) is caught at the hook boundary and recorded as
  ``failed`` with the reason; ``import vllm`` carries on. ``UCM_PATCH_STRICT=1`` (or
  ``strict=True``) re-raises as :class:`PatchFailed` instead, for CI.
* **Idempotent.** A record is applied at most once per process whatever the number of
  ``activate()`` calls or entry paths (import + plugin); a wrapper already carrying our
  record id is recognised and never wrapped again.
* **Thread-safe.** One ``RLock`` guards the state table. Factories (which may import) run
  *outside* the lock, and :mod:`ucm_patch.importhooks` (our own post-import hooks, not
  wrapt's) runs each hook outside its own lock, so a hook firing in one thread while
  another thread imports cannot deadlock on the import lock.
* **Cheap where it runs per layer.** The installer (:mod:`ucm_patch.installer`) gives a
  plain-function target an exact-signature trampoline, anything else a wrapt
  ``FunctionWrapper``; both run the same guarded wrapper (:mod:`ucm_patch.guard`).
* **Revertible.** The exact original is restored only while the attribute still is our
  wrapper; if something else replaced or re-wrapped it, the registry warns and leaves it.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType

from ucm_patch import importhooks, installer, trampoline_cache
from ucm_patch.errors import PatchFailed
from ucm_patch.records import PatchRecord, Tag, newest_eras
from ucm_patch.toggles import ToggleResolver
from ucm_patch.typing_guard import TYPE_CHECKING
from ucm_patch.versions import InstalledVersion, VersionCache

if TYPE_CHECKING:
    from typing import Any


class State:
    APPLIED = Tag("applied")
    WAITING = Tag("waiting-for-import")
    APPLYING = Tag("applying")  # transient: a hook is applying it right now
    SKIPPED_VERSION = Tag("skipped-version")
    UNTESTED = Tag("untested-version")  # newer than the newest verified release
    NATIVE = Tag("native")  # upstream already calls the connector here
    DISABLED = Tag("disabled")
    TARGET_MISSING = Tag("target-missing")
    FAILED = Tag("failed")
    REVERTED = Tag("reverted")
    REVERT_REFUSED = Tag("revert-refused")
    INACTIVE = Tag("inactive")  # known, never activated in this process


class RecordStatus:
    """Live state of one record; ``report()`` returns copies as dicts."""

    def __init__(self, record: PatchRecord) -> None:
        self.record = record
        self.state = State.INACTIVE
        self.reason = ""
        self.toggle = ""
        self.versions: dict[str, str] = {}
        self.gated = False  # version gate evaluated for the current activation
        self.applied: installer.Applied | None = None
        self.hooked = False  # a post-import hook is registered for this activation
        self.warned = False  # the call-time failure WARNING was logged
        self.allow_untested = ""  # who allowed it past the ceiling ("" = nobody)
        self.past = ""  # why it applies past its ceiling (allowed), for the report

    def as_dict(self) -> dict[str, Any]:
        r = self.record
        return {
            "id": r.id,
            "name": r.name,
            "era": r.era,
            "kind": r.kind.value,
            "target": r.target,
            "op": r.op,
            "requires": dict(r.requires),
            "ceiling": {d: f"<{c}" if c else "none" for d, c in r.ceiling.items()},
            "installed": dict(self.versions),
            "default": r.default,
            "state": self.state.value,
            "reason": self.reason,
            "toggle": self.toggle,
        }


class Registry:
    """Holds every known record and applies the enabled, in-range ones.

    The version gate is evaluated lazily (first ``report()`` or first import of a target
    module), because reading distribution metadata costs tens of milliseconds and
    ``import ucm_patch`` must stay cheap. The outcome is the same as gating up front.
    """

    def __init__(self, records: Iterable[PatchRecord]) -> None:
        self._lock = threading.RLock()
        _fork_safe(self)
        self._status: dict[str, RecordStatus] = {}
        for rec in records:
            if rec.id in self._status:
                raise ValueError(f"duplicate patch record id {rec.id!r}")
            self._status[rec.id] = RecordStatus(rec)
        # Ids of the newest era of each patch (the ones that may apply past their ceiling),
        # computed at the first gate, not here: it parses every range, and ``import
        # ucm_patch`` must stay cheap (and import no ``packaging``).
        self._newest: dict[str, frozenset[str]] | None = None  # patch name -> newest eras
        self.strict = False
        self.debug = False
        self.active = False
        self._versions = VersionCache()
        # Called with (event, details) on activation and every state change of a record
        # (never on a hot path); set by activation when UCM_PATCH_REPORT_DIR is given.
        self.on_event: Callable[[str, dict[str, Any]], None] | None = None

    # -- queries ---------------------------------------------------------------------------
    @property
    def names(self) -> frozenset[str]:
        return frozenset(s.record.name for s in self._status.values())

    def status(self, record_id: str) -> RecordStatus:
        return self._status[record_id]

    def report(self) -> list[dict[str, Any]]:
        self._gate_pending()
        with self._lock:
            return [s.as_dict() for s in self._status.values()]

    # -- activation ------------------------------------------------------------------------
    def activate(
        self,
        patches: Mapping[str, bool] | None = None,
        env: Mapping[str, str] | None = None,
        strict: bool = False,
        debug: bool = False,
    ) -> None:
        """Toggle and hook every record; re-running re-resolves toggles (idempotent).

        Raises ConfigError for bad toggles before changing anything (and, when ``strict``,
        for an unknown ``UCM_PATCH_*`` variable, which otherwise is a WARNING).
        """
        versions = self._versions  # one metadata read per distribution and process
        resolver = ToggleResolver(
            self.names, code=patches, env=env, versions=versions, strict=strict
        )
        decisions = [
            (st, resolver.decide(st.record.name, st.record.default)) for st in self._status.values()
        ]
        to_hook: list[RecordStatus] = []
        to_revert: list[RecordStatus] = []
        with self._lock:
            self.strict = strict
            self.debug = debug
            self.active = True
            for st, decision in decisions:
                st.toggle = decision.source
                st.allow_untested = resolver.allow_untested(st.record.name)
                if st.applied is not None or st.state is State.APPLYING:
                    # installed (possibly failed at call time and now a pass-through)
                    if not decision.enabled:
                        to_revert.append(st)
                    continue
                st.gated = False
                if not decision.enabled:
                    st.state, st.reason = State.DISABLED, f"switched off by {decision.source}"
                else:
                    st.state, st.reason = State.WAITING, f"waiting for {st.record.module}"
                    to_hook.append(st)
        for st in to_revert:
            self._revert_one(st, State.DISABLED, f"switched off by {st.toggle}")
        with trampoline_cache.batch():  # the targets imported already apply now: one write
            for st in to_hook:
                self._hook(st)

    def _is_newest(self, record: PatchRecord) -> bool:
        """Whether ``record`` is its patch's newest era (it alone may apply past its
        ceiling). Computed on first need only, i.e. when an installed version is past some
        record's ceiling: it parses every record's range, a sizeable share of the apply time
        (docs/BENCHMARKS.md, section 1)."""
        newest = self._newest
        if newest is None:
            newest = self._newest = {}
        found = newest.get(record.name)
        if found is None:  # this patch's eras only: most records are never asked about
            eras = (s.record for s in self._status.values() if s.record.name == record.name)
            found = newest[record.name] = frozenset(newest_eras(eras))
        return record.id in found and not record.retired

    def _gate_pending(self) -> None:
        """Evaluate the version gate of every waiting record not yet gated."""
        with self._lock:
            todo = [
                st
                for st in self._status.values()
                if not st.gated and st.state in (State.WAITING, State.DISABLED)
            ]
            versions = self._versions
        for st in todo:
            # may read metadata: outside the lock
            shown, reason, past = _gate(st.record, versions, self._is_newest)
            with self._lock:
                if st.gated:
                    continue
                st.gated, st.versions = True, shown
                if st.state is not State.WAITING:
                    continue
                if past and not st.allow_untested:
                    st.state, st.reason = (
                        State.UNTESTED,
                        (
                            f"{past}; off by default: UCM_PATCH_ALLOW_UNTESTED=1 (or "
                            "allow_untested in the config file) applies it once its "
                            "signature and native-hook checks pass"
                        ),
                    )
                elif past:
                    st.past = f"{past}; allowed by {st.allow_untested}"
                    st.reason = st.past
                elif reason:
                    st.state, st.reason = State.SKIPPED_VERSION, reason
        if todo:
            self._apply_supersedes()

    def _apply_supersedes(self) -> None:
        """Skip records superseded by an enabled, in-range record (before they apply)."""
        with self._lock:
            for st in self._status.values():
                if st.state is not State.WAITING or not st.gated:
                    continue
                for rid in st.record.supersedes:
                    # A registry may hold a subset of the records (tests); the full set's
                    # ids are checked by tests/test_docs.py.
                    other = self._status.get(rid)
                    if other is not None and other.state is State.WAITING:
                        other.state = State.SKIPPED_VERSION
                        other.reason = f"superseded by {st.record.id} ({_shown(st.versions)})"

    def _call_failed(self, st: RecordStatus, exc: BaseException) -> None:
        """A wrapper raised at call time: the guard made it a pass-through; report it.

        Also a WARNING through :mod:`logging` (logger ``ucm_patch``), once per record: the
        layer now runs without its hooks, and vLLM's log is where an operator looks.
        """
        with self._lock:
            st.state = State.FAILED
            st.reason = f"wrapper raised at call time: {type(exc).__name__}: {exc}"
            first = not st.warned
            st.warned = True
        if first:
            import logging  # failure path only: `import ucm_patch` stays without logging

            logging.getLogger("ucm_patch").warning(
                "ucm_patch: patch %s on %s raised at call time and is now a pass-through "
                "(the layer runs without its hooks): %s",
                st.record.id,
                st.record.target,
                st.reason,
            )
        self._emit(st)

    def _emit(self, st: RecordStatus) -> None:
        """Tell the debug stream and the event sink about a record's new state."""
        if self.debug:
            print(
                f"ucm_patch: {st.record.id}: {st.state.value} {st.reason}".rstrip(), file=sys.stderr
            )
        sink = self.on_event
        if sink is not None:
            sink("state", {"id": st.record.id, "state": st.state.value, "reason": st.reason})

    def _hook(self, st: RecordStatus) -> None:
        """Apply now if the target module is imported, else register a post-import hook."""
        rid = st.record.id
        with self._lock:
            if st.hooked:
                return  # a hook is pending (or firing) for this activation
            st.hooked = True
        # when_imported fires at once if the module is imported, and never on a half-run one.
        importhooks.when_imported(st.record.module, lambda m: self._on_import(rid, m))

    def _on_import(self, record_id: str, module: ModuleType) -> None:
        """Post-import hook body: never raises unless strict."""
        st = self._status[record_id]
        with self._lock:
            st.hooked = False  # the hook fired; a later activation must register again
        self._gate_pending()
        with self._lock:
            if st.state is not State.WAITING:
                return  # disabled, out of range, reverted, or already applied
            st.state, st.reason = State.APPLYING, "applying"
            strict = self.strict
        try:
            applied, missing = installer.install(
                st.record, module, lambda exc: self._call_failed(st, exc), lambda: self.strict
            )
        except installer.NativeHooks as exc:
            with self._lock:
                st.state, st.reason = State.NATIVE, str(exc)
            self._emit(st)
            return
        except installer.SignatureChanged as exc:
            with self._lock:
                st.state, st.reason = State.FAILED, str(exc)
            self._emit(st)
            if strict:
                raise PatchFailed(f"{record_id}: {exc}") from exc
            return
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            with self._lock:
                st.state, st.reason = State.FAILED, reason
            self._emit(st)
            if strict:
                raise PatchFailed(f"{record_id} on {st.record.target}: {reason}") from exc
            return
        with self._lock:
            if applied is None:
                state = State.TARGET_MISSING if st.record.optional else State.FAILED
                st.state, st.reason = state, missing or "target not found"
            else:
                st.state, st.applied = State.APPLIED, applied
                st.reason = _applied_reason(st, applied)
        self._emit(st)
        if applied is None and strict and not st.record.optional:
            raise PatchFailed(f"{record_id}: {missing}")

    # -- revert ----------------------------------------------------------------------------
    def revert(self) -> None:
        """Undo every applied record and stop pending ones (hooks then do nothing)."""
        with self._lock:
            self.active = False
            statuses = list(self._status.values())
            for st in statuses:
                if st.state is State.WAITING:
                    st.state, st.reason = State.REVERTED, "reverted before import"
        for st in statuses:
            if st.applied is not None:
                self._revert_one(st, State.REVERTED, "reverted")

    def _revert_one(self, st: RecordStatus, new_state: State, reason: str) -> None:
        with self._lock:
            applied = st.applied
            if applied is None:
                return
            refused = installer.uninstall(applied, st.record.target)
            if refused is not None:
                st.state, st.reason = State.REVERT_REFUSED, refused
                warnings.warn(f"ucm_patch: {refused}", RuntimeWarning, stacklevel=3)
                return
            st.applied = None
            st.state, st.reason = new_state, reason


# -- helpers -------------------------------------------------------------------------------
def _fork_safe(registry: Registry) -> None:
    """Hold the registry lock across fork(): the child gets a fresh, unowned lock.

    Without this a fork while another thread holds the lock (report(), activate()) leaves
    the child's lock owned by a thread that does not exist there: its next call hangs.
    """
    ref = weakref.ref(registry)

    def before() -> None:
        reg = ref()
        if reg is not None:
            reg._lock.acquire()

    def after_in_parent() -> None:
        reg = ref()
        if reg is not None:
            reg._lock.release()

    def after_in_child() -> None:
        reg = ref()
        if reg is not None:
            reg._lock = threading.RLock()

    os.register_at_fork(
        before=before, after_in_parent=after_in_parent, after_in_child=after_in_child
    )


def _applied_reason(st: RecordStatus, applied: installer.Applied) -> str:
    notes = [st.past] if st.past else []
    if applied.hooks != st.record.hooks:
        notes.append(f"adds {' and '.join(applied.hooks)} only; native {applied.native}")
    return "; ".join(notes)


def _gate(
    record: PatchRecord, versions: VersionCache, is_newest: Callable[[PatchRecord], bool]
) -> tuple[dict[str, str], str | None, str | None]:
    """(installed versions shown in the report, reason to skip or None, why the installed
    version is past the record's ceiling or None).

    "Past the ceiling" (above the exclusive upper bound, inside every lower bound) is
    reported apart from any other mismatch so the registry can tell "newer than anything
    verified" from "another era's range"; when it is the only mismatch, ``reason`` is
    None and the registry decides (untested-version unless allowed). Only the newest era
    of a patch (``is_newest``, asked only then) can be past its ceiling: an older era's
    upper bound is where the next era starts.
    """
    from packaging.specifiers import SpecifierSet

    shown: dict[str, str] = {}
    reasons: list[str] = []
    past: list[str] = []
    for dist, spec in record.specifiers.items():
        found: InstalledVersion | None = versions.get(dist)
        if found is None:
            shown[dist] = "not installed"
            reasons.append(f"{dist} is not installed")
            continue
        shown[dist] = str(found)
        if spec.contains(found.effective, prereleases=True):
            continue
        ceiling = record.ceiling.get(dist)
        floor = SpecifierSet(",".join(str(s) for s in spec if s.operator != "<"))
        if ceiling and floor.contains(found.effective, prereleases=True) and is_newest(record):
            past.append(
                f"{dist} {found} ({found.source}) is past the ceiling <{ceiling}: newer than "
                "any release this record was verified on"
            )
        else:
            reasons.append(f"{dist} {found} ({found.source}) is outside the required range {spec}")
    if reasons:
        return shown, reasons[0], None
    return shown, None, "; ".join(past) or None


def _shown(versions: Mapping[str, str]) -> str:
    return ", ".join(f"{d} {v}" for d, v in versions.items())
