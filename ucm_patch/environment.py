"""Every ``UCM_PATCH*`` environment variable: declared, read and parsed here, and only here.

Other modules ask for parsed values (``environment.current().strict``,
``.setting(DUMP_EXIT_FLUSH_S)``, ``.toggles(names)``); none of them reads ``os.environ``
for a ``UCM_PATCH*`` name. Declared here (:data:`VARIABLES`):

* the core's settings (``UCM_PATCH``, ``_STRICT``, ``_DEBUG``, ``_CONFIG``, ``_REPORT_DIR``,
  ``_ALLOW_UNTESTED``, the version overrides),
* the settings of the rooms above the core (the dump engine's exit flush, the stores'
  integrity key): named here so that one place knows every variable, read by those rooms
  through this module;
* the patch toggles ``UCM_PATCH_<NAME>``, one per logical patch name, which come from the
  records (:meth:`Environment.toggles` is handed the names).

Read once, parsed once. :func:`current` reads the ``UCM_PATCH*`` entries of ``os.environ``
and parses each variable on first use; the parsed values are kept while those entries stay
the same, so a process whose environment does not change (every server) parses each
variable once. A program that sets one after ``import ucm_patch`` (a store key set before
building the engine) is still seen. :func:`read` parses a given mapping instead (tests,
``activate(env=...)``).

Unknown names are reported, never fatal: a ``UCM_PATCH_*`` name that is neither declared
nor a toggle of a known patch gets one WARNING per process (logger ``ucm_patch``) naming
it and the nearest known name; only ``UCM_PATCH_STRICT=1`` (or ``activate(strict=True)``)
makes it a :class:`~ucm_patch.errors.ConfigError`. Tools and instrumentation libraries
ignore names they do not know (OpenTelemetry, ddtrace); a misspelt toggle is worth a line,
not a stopped server. A bad *value* of a known variable stays an error naming the variable:
whoever set it meant this package. Values never appear in a message (the store key is a
secret, and an unknown name may be a misspelt one).

Why no dataclass, ``re`` or ``logging`` here: ``import ucm_patch`` runs this in every vLLM
process, and ``tests/test_activation.py`` holds its import cost down (``logging`` and
``difflib`` are imported only when there is something to report).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterable, Mapping

from ucm_patch.errors import ConfigError

#: The namespace: the global switch, and every name starting ``UCM_PATCH_``.
SWITCH = "UCM_PATCH"
PREFIX = "UCM_PATCH_"

STRICT = "UCM_PATCH_STRICT"
DEBUG = "UCM_PATCH_DEBUG"
CONFIG = "UCM_PATCH_CONFIG"
REPORT_DIR = "UCM_PATCH_REPORT_DIR"
ALLOW_UNTESTED = "UCM_PATCH_ALLOW_UNTESTED"
VLLM_VERSION = "UCM_PATCH_VLLM_VERSION"
VLLM_ASCEND_VERSION = "UCM_PATCH_VLLM_ASCEND_VERSION"
DUMP_EXIT_FLUSH_S = "UCM_PATCH_DUMP_EXIT_FLUSH_S"
STORE_KEY = "UCM_PATCH_STORE_KEY"
STORE_KEY_FILE = "UCM_PATCH_STORE_KEY_FILE"

#: Names that were ``UCM_PATCH_*`` once and now live elsewhere: the warning says where.
MOVED = {"UCM_PATCH_MATRIX_DIR": "make matrix reads UCM_MATRIX_DIR"}

TRUE_WORDS = frozenset({"1", "true", "on", "yes"})
FALSE_WORDS = frozenset({"0", "false", "off", "no"})
ACCEPTED_BOOL = "1/0, true/false, on/off, yes/no"

#: A parser: ``(variable name, raw value) -> parsed value``, raising ConfigError.
Parser = Callable[[str, str], object]


def parse_bool(value: str, where: str) -> bool:
    """Parse an on/off word; ``where`` names the variable or key for the error."""
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ConfigError(f"{where}={value!r} is not a switch; accepted: {ACCEPTED_BOOL}")


def _switch(name: str, value: str) -> bool:
    return parse_bool(value, name)


def _text(name: str, value: str) -> str:
    return value.strip()


def _raw(name: str, value: str) -> str:
    return value  # secrets and paths as given: no stripping of what the operator wrote


def _seconds(name: str, value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ConfigError(f"{name}={value.strip()!r}: expected a finite number of seconds >= 0")
    return seconds


class Variable:
    """One declared variable: its parser, the value when unset or empty, the module that
    uses it and what it does (one line; tests check each is documented)."""

    __slots__ = ("default", "doc", "name", "parse", "reader", "secret")

    def __init__(
        self,
        name: str,
        parse: Parser,
        default: object,
        reader: str,
        doc: str,
        secret: bool = False,
    ) -> None:
        self.name = name
        self.parse = parse
        self.default = default
        self.reader = reader
        self.doc = doc
        self.secret = secret  # never logged, never in a message, kept unstripped


#: Every variable that is not a patch toggle.
VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable(SWITCH, _switch, True, "ucm_patch", "0 switches the whole package off"),
        Variable(STRICT, _switch, False, "ucm_patch", "raise on any failure (CI)"),
        Variable(DEBUG, _switch, False, "ucm_patch", "print the report at activation"),
        Variable(CONFIG, _text, "", "ucm_patch.toggles", "TOML/JSON file of patch toggles"),
        Variable(REPORT_DIR, _text, "", "ucm_patch", "append each process's events here"),
        Variable(ALLOW_UNTESTED, _text, "", "ucm_patch.toggles", "newest eras past their ceiling"),
        Variable(VLLM_VERSION, _text, "", "ucm_patch.versions", "gate as this vLLM"),
        Variable(VLLM_ASCEND_VERSION, _text, "", "ucm_patch.versions", "gate as this vLLM-Ascend"),
        Variable(
            DUMP_EXIT_FLUSH_S,
            _seconds,
            None,
            "ucm_patch.hooks.dump.lifecycle",
            "seconds the exit flush waits for dumps in flight",
        ),
        Variable(
            STORE_KEY, _raw, "", "ucm_patch.hooks.stores.framing", "integrity key", secret=True
        ),
        Variable(
            STORE_KEY_FILE, _raw, "", "ucm_patch.hooks.stores.framing", "file holding the key"
        ),
    )
}


def user_cache_dir() -> str:
    """``$XDG_CACHE_HOME/ucm_patch``, else ``~/.cache/ucm_patch``: where this package keeps
    what it makes for this user (the local store's default directory, native helpers)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ucm_patch")


def toggle_var(name: str) -> str:
    """The variable of patch ``name``'s toggle: ``UCM_PATCH_<NAME>``."""
    return PREFIX + name.upper()


def in_namespace(var: str) -> bool:
    return var == SWITCH or var.startswith(PREFIX)


class Environment:
    """The ``UCM_PATCH*`` variables of one environment, each parsed on first use.

    Holds the raw values (the store key among them): no ``__repr__`` shows them.
    """

    __slots__ = ("_parsed", "raw")

    def __init__(self, raw: Mapping[str, str]) -> None:
        self.raw = dict(raw)  # name -> value, namespace only
        self._parsed: dict[str, object] = {}

    def setting(self, name: str) -> object:
        """The parsed value of declared variable ``name`` (its default when unset or empty);
        ConfigError naming the variable for a bad value."""
        try:
            return self._parsed[name]
        except KeyError:
            pass
        var = VARIABLES[name]
        value = self.raw.get(name, "")
        if not (value if var.secret else value.strip()):
            parsed = var.default
        else:
            parsed = var.parse(name, value)
        self._parsed[name] = parsed
        return parsed

    # -- the core's settings ---------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return bool(self.setting(SWITCH))

    @property
    def strict(self) -> bool:
        return bool(self.setting(STRICT))

    @property
    def debug(self) -> bool:
        return bool(self.setting(DEBUG))

    @property
    def config_path(self) -> str:
        return str(self.setting(CONFIG))

    @property
    def report_dir(self) -> str:
        return str(self.setting(REPORT_DIR))

    def version_override(self, var: str) -> str:
        """The version ``var`` (a version override variable) forces; "" when unset. Checked
        as PEP 440 where it is used (``ucm_patch.versions``): ``packaging`` is not imported
        at start."""
        return str(self.setting(var))

    def allow_untested(self, known: Iterable[str]) -> frozenset[str] | None:
        """Patch names ``UCM_PATCH_ALLOW_UNTESTED`` allows past their ceilings (all of
        ``known`` for a true word, none when unset); None when it says no (a false word),
        which also overrides the config file."""
        value = str(self.setting(ALLOW_UNTESTED))
        known = frozenset(known)
        if not value:
            return frozenset()
        word = value.lower()
        if word in TRUE_WORDS:
            return known
        if word in FALSE_WORDS:
            return None
        names = {n.strip() for n in value.split(",") if n.strip()}
        unknown = sorted(names - known)
        if unknown:
            raise ConfigError(
                f"{ALLOW_UNTESTED}={value!r}: unknown patch name(s) {unknown}; expected "
                f"{ACCEPTED_BOOL} or patch names separated by commas: {_listed(known)}"
            )
        return frozenset(names)

    # -- the settings of hooks/ --------------------------------------------------------------
    @property
    def dump_exit_flush_s(self) -> float | None:
        """``UCM_PATCH_DUMP_EXIT_FLUSH_S`` in seconds; None when unset (the reader's
        default applies)."""
        value = self.setting(DUMP_EXIT_FLUSH_S)
        return None if value is None else float(value)  # type: ignore[arg-type]

    def store_key_source(self) -> tuple[str, str] | None:
        """Where the stores' integrity key comes from: ``(STORE_KEY, the key)`` or
        ``(STORE_KEY_FILE, its path)``; None when neither is set. ConfigError when both
        are (which one was meant?). The key's length and the file are checked by the
        store (``hooks.stores.framing.load_store_key``)."""
        inline, path = str(self.setting(STORE_KEY)), str(self.setting(STORE_KEY_FILE))
        if inline and path:
            raise ConfigError(f"set only one of {STORE_KEY} and {STORE_KEY_FILE}, not both")
        if inline:
            return STORE_KEY, inline
        if path:
            return STORE_KEY_FILE, path
        return None

    # -- toggles and unknown names -----------------------------------------------------------
    def toggles(self, names: Iterable[str], strict: bool | None = None) -> dict[str, bool]:
        """Patch name -> switch, for the ``UCM_PATCH_<NAME>`` variables set for ``names``.

        Any other undeclared ``UCM_PATCH_*`` name is reported (:func:`report_unknown`):
        a WARNING, or a ConfigError when ``strict`` (default: ``UCM_PATCH_STRICT``).
        """
        by_var = {toggle_var(n): n for n in names}
        found: dict[str, bool] = {}
        unknown: list[str] = []
        for var, value in self.raw.items():
            if var in VARIABLES:
                continue
            name = by_var.get(var)
            if name is None:
                unknown.append(var)
            elif value.strip():
                found[name] = parse_bool(value, var)
        if unknown:
            report_unknown(unknown, by_var, self.strict if strict is None else strict)
        return found


def _listed(names: Iterable[str]) -> str:
    return ", ".join(sorted(names)) or "(none)"


def nearest(var: str, toggles: Iterable[str] = ()) -> str:
    """The known name ``var`` most likely meant ("" when none is close): compared without
    the common ``UCM_PATCH_`` prefix, which would make every name look alike."""
    import difflib

    known = {k[len(PREFIX) :]: k for k in (*VARIABLES, *toggles) if k.startswith(PREFIX)}
    close = difflib.get_close_matches(var[len(PREFIX) :], list(known), n=1, cutoff=0.6)
    return known[close[0]] if close else ""


def describe_unknown(var: str, toggles: Iterable[str] = ()) -> str:
    """``var`` with the name it probably meant, for a message."""
    if var in MOVED:
        return f"{var} (moved: {MOVED[var]})"
    hint = nearest(var, toggles)
    return f"{var} (did you mean {hint}?)" if hint else var


_warned: set[str] = set()
_warned_lock = threading.Lock()


def report_unknown(unknown: Iterable[str], toggles: Iterable[str], strict: bool) -> None:
    """Say that the ``unknown`` variables are not ucm_patch's: one WARNING (logger
    ``ucm_patch``) naming those not reported before in this process, or, when ``strict``,
    a ConfigError naming them all and every known name. Names only, never values."""
    toggles = sorted(toggles)
    unknown = sorted(unknown)
    if strict:
        named = ", ".join(describe_unknown(v, toggles) for v in unknown)
        verb = "is not a ucm_patch variable" if len(unknown) == 1 else "are not ucm_patch variables"
        raise ConfigError(
            f"{named} {verb} (an error in strict mode, a warning otherwise); patch toggles "
            f"and settings are: {_listed([*toggles, *VARIABLES])}"
        )
    with _warned_lock:
        new = [v for v in unknown if v not in _warned]
        _warned.update(new)
    if new:
        import logging

        logging.getLogger("ucm_patch").warning(
            "ucm_patch: ignoring unknown variable(s) %s; %s=1 makes this an error (README, "
            "Toggles, lists the variables)",
            ", ".join(describe_unknown(v, toggles) for v in new),
            STRICT,
        )


_lock = threading.Lock()
_current: Environment | None = None


def current() -> Environment:
    """This process's variables (``os.environ``), parsed once while they stay the same."""
    global _current
    raw = {k: v for k, v in os.environ.items() if k == SWITCH or k.startswith(PREFIX)}
    env = _current
    if env is None or env.raw != raw:
        with _lock:
            env = _current
            if env is None or env.raw != raw:
                env = _current = Environment(raw)
    return env


def read(env: Mapping[str, str] | None = None) -> Environment:
    """The variables of ``env``; this process's (:func:`current`) when None or
    ``os.environ`` itself."""
    if env is None or env is os.environ:
        return current()
    return Environment({k: v for k, v in env.items() if in_namespace(k)})
