"""One toggle resolver for every entry path (import, plugin, CLI).

Precedence, highest first (documented in the README; ddtrace #5458 shows what happens
when two mechanisms overlap):

1. explicit arguments in code: ``ucm_patch.activate(patches={"gdn_layerwise": False})``;
2. ``UCM_PATCH_<NAME>=1|0`` (also true/false/on/off/yes/no, any case);
3. the config file named by ``UCM_PATCH_CONFIG`` (TOML or JSON);
4. the record's default.

Toggles address the *logical* patch name, so they follow whichever era is installed.
The config file may scope a toggle to versions::

    [patches]
    kv_ready_event = true                                  # plain switch
    gdn_layerwise = { enabled = false, when = { "vllm-ascend" = "<0.19" } }

    [[patches.reshape_cache_event]]                        # rules: first match wins
    enabled = false
    when = { vllm-ascend = ">=0.13,<0.23" }

A rule whose ``when`` does not match the installed versions makes no decision: the
default applies. ``UCM_PATCH=0`` switches the whole package off.

Past the ceiling. A patch's newest era stays off (``untested-version``) on a release newer
than any it was verified on, unless allowed: ``UCM_PATCH_ALLOW_UNTESTED=1`` (every patch)
or ``=gdn_layerwise,kv_ready_event`` (those), or in the file::

    [patches]
    gdn_layerwise = { allow_untested = true }      # `enabled` may be left out here

The environment wins over the file; either way the record must still pass its signature
check and native-hook detection when it applies.

Every bad input is a :class:`~ucm_patch.errors.ConfigError` naming the variable or key,
the value, and what is accepted; an unknown patch name in the file or in code is one too.
An unknown ``UCM_PATCH_*`` *variable* is not: it may be another tool's, or a typo, and a
server must not stop over it. It gets one WARNING naming it and the nearest known name,
and is an error only under ``UCM_PATCH_STRICT=1`` (:mod:`ucm_patch.environment`, which
reads and parses every variable; this module gets the parsed values from it).
"""

from __future__ import annotations

from collections import namedtuple  # not typing.NamedTuple: see ucm_patch.typing_guard
from collections.abc import Iterable, Mapping

from ucm_patch import environment
from ucm_patch.environment import parse_bool as parse_bool  # re-exported
from ucm_patch.errors import ConfigError
from ucm_patch.typing_guard import TYPE_CHECKING
from ucm_patch.versions import DIST_ALIASES, VersionCache

if TYPE_CHECKING:  # parsed lazily: only version-scoped rules need packaging
    from typing import Any

    from packaging.specifiers import SpecifierSet

ALLOW_UNTESTED_VAR = environment.ALLOW_UNTESTED
env_var_for = environment.toggle_var


class Rule(namedtuple("Rule", ("enabled", "when", "where", "allow_untested"), defaults=(None,))):
    __slots__ = ()
    enabled: bool | None  # None: the rule only sets allow_untested
    allow_untested: bool | None
    when: Mapping[str, SpecifierSet]
    where: str  # file + key, for the report


class Decision(namedtuple("Decision", ("enabled", "source"))):
    __slots__ = ()
    enabled: bool
    source: str  # "code", "env UCM_PATCH_X", "config <file> patches.x", "default"


def _names_hint(known: Iterable[str]) -> str:
    return ", ".join(sorted(known)) or "(none)"


def load_config(path: str, known: Iterable[str]) -> dict[str, list[Rule]]:
    """Read and validate a toggle file (TOML by default, JSON for ``*.json``)."""
    known = set(known)
    var = environment.CONFIG
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise ConfigError(f"{var}={path!r} cannot be read: {exc.strerror or exc}") from exc
    try:
        if path.endswith(".json"):
            import json

            data: Any = json.loads(raw.decode("utf-8"))
        else:
            import tomllib

            data = tomllib.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        kind = "JSON" if path.endswith(".json") else "TOML"
        raise ConfigError(f"{var}={path!r} is not valid {kind}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a table with a 'patches' key")
    extra = set(data) - {"patches"}
    if extra:
        raise ConfigError(f"{path}: unknown top-level key(s) {sorted(extra)}; accepted: 'patches'")
    patches = data.get("patches", {})
    if not isinstance(patches, dict):
        raise ConfigError(f"{path}: 'patches' must be a table of patch name -> switch")
    rules: dict[str, list[Rule]] = {}
    for name, value in patches.items():
        key = f"{path}: patches.{name}"
        if name not in known:
            raise ConfigError(f"{key}: unknown patch name {name!r}; valid: {_names_hint(known)}")
        items = value if isinstance(value, list) else [value]
        rules[name] = [
            _parse_rule(item, f"{key}[{i}]" if isinstance(value, list) else key)
            for i, item in enumerate(items)
        ]
    return rules


def _parse_rule(item: Any, key: str) -> Rule:
    if isinstance(item, bool):
        return Rule(enabled=item, when={}, where=key)
    if not isinstance(item, dict):
        raise ConfigError(
            f"{key} = {item!r}: expected true/false or a table {{ enabled = <bool>, "
            "when = { <distribution> = <PEP 440 range> }, allow_untested = <bool> }"
        )
    extra = set(item) - {"enabled", "when", "allow_untested"}
    if extra:
        raise ConfigError(
            f"{key}: unknown key(s) {sorted(extra)}; accepted: enabled, when, allow_untested"
        )
    if "enabled" not in item and "allow_untested" not in item:
        raise ConfigError(f"{key}: missing 'enabled' (true or false)")
    enabled = item.get("enabled")
    if enabled is not None and not isinstance(enabled, bool):
        raise ConfigError(f"{key}.enabled = {enabled!r}: expected true or false")
    allow = item.get("allow_untested")
    if allow is not None and not isinstance(allow, bool):
        raise ConfigError(f"{key}.allow_untested = {allow!r}: expected true or false")
    when_raw = item.get("when", {})
    if not isinstance(when_raw, dict):
        raise ConfigError(f"{key}.when = {when_raw!r}: expected a table of distribution = range")
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    when: dict[str, SpecifierSet] = {}
    for dist, spec in when_raw.items():
        if dist not in DIST_ALIASES:
            raise ConfigError(
                f"{key}.when: unknown distribution {dist!r}; accepted: {_names_hint(DIST_ALIASES)}"
            )
        try:
            when[dist] = SpecifierSet(str(spec))
        except InvalidSpecifier as exc:
            raise ConfigError(
                f"{key}.when.{dist} = {spec!r} is not a PEP 440 range (example: '>=0.19,<0.23')"
            ) from exc
    return Rule(enabled=enabled, when=when, where=key, allow_untested=allow)


class ToggleResolver:
    """Decides, per logical patch name, whether it is enabled and why."""

    def __init__(
        self,
        known: Iterable[str],
        code: Mapping[str, bool] | None = None,
        env: Mapping[str, str] | None = None,
        versions: VersionCache | None = None,
        strict: bool | None = None,
    ) -> None:
        """``env``: the environment to read (default: this process's, parsed once);
        ``strict``: an unknown ``UCM_PATCH_*`` variable raises instead of warning
        (default: ``UCM_PATCH_STRICT``)."""
        self.known = frozenset(known)
        self.environment = environment.read(env)
        self.versions = versions or VersionCache()
        self.code = self._check_code(code or {})
        self.env_toggles = self.environment.toggles(self.known, strict=strict)
        config_path = self.environment.config_path
        self.config_path = config_path or None
        self.rules = load_config(config_path, self.known) if config_path else {}
        self.allow_env = self.environment.allow_untested(self.known)

    def _check_code(self, code: Mapping[str, bool]) -> dict[str, bool]:
        for name, value in code.items():
            if name not in self.known:
                raise ConfigError(
                    f"activate(patches=...): unknown patch name {name!r}; "
                    f"valid: {_names_hint(self.known)}"
                )
            if not isinstance(value, bool):
                raise ConfigError(
                    f"activate(patches={{{name!r}: {value!r}}}): expected True or False"
                )
        return dict(code)

    def allow_untested(self, name: str) -> str:
        """Who lets patch ``name`` apply past its ceiling ("" = nobody): the environment
        first, then the first matching config rule that says."""
        if self.allow_env is None:
            return ""
        if name in self.allow_env:
            return f"env {ALLOW_UNTESTED_VAR}"
        for rule in self.rules.get(name, ()):
            if rule.allow_untested is not None and self._rule_matches(rule):
                return f"config {rule.where}" if rule.allow_untested else ""
        return ""

    def _rule_matches(self, rule: Rule) -> bool:
        for dist, spec in rule.when.items():
            found = self.versions.get(dist)
            if found is None or not spec.contains(found.effective, prereleases=True):
                return False
        return True

    def decide(self, name: str, default: bool) -> Decision:
        if name in self.code:
            return Decision(self.code[name], "code")
        if name in self.env_toggles:
            return Decision(self.env_toggles[name], f"env {env_var_for(name)}")
        for rule in self.rules.get(name, ()):
            if rule.enabled is not None and self._rule_matches(rule):
                return Decision(rule.enabled, f"config {rule.where}")
        return Decision(default, "default")
