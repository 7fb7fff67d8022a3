"""The value checks of every key ucm_patch reads from vLLM's ``kv_connector_extra_config``:
one module. (The environment variables, the "settings" of :mod:`ucm_patch.environment`,
are parsed there.)

Each check takes ``(key, value)`` and returns the parsed value, or raises
:class:`SettingError` (a ``ValueError``) whose message starts with the key and says what
is accepted. The key tables that use them (``hooks.stores.keys`` for store keys,
``hooks.dump.keys`` for the dump engine's, ``ucm_patch.connector.config`` for the
connector's own) re-raise it as their own error type, message unchanged.

Sizes are ints (bytes) or strings with a binary unit: ``"512MiB"``, ``"64GiB"``. Decimal
units (``"GB"``) are refused because tools disagree on whether they mean 10^9 or 2^30.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from typing import Any

#: A check: ``(key, value) -> parsed value``, raising :class:`SettingError`.
Check = Callable[[str, object], Any]

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_HOST_PORT_RE = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:\[\]]+):(?P<port>\d{1,5})$")


class SettingError(ValueError):
    """A setting's value is invalid; the message names the key."""


def parse_size(key: str, value: object, minimum: int = 0) -> int:
    """Bytes from an int or a ``"<number><KiB|MiB|GiB|TiB>"`` string."""
    if isinstance(value, bool):
        raise SettingError(f"{key}: expected a size in bytes, got bool {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        unit = m.group(2).lower()
        if unit not in _UNITS:
            raise SettingError(
                f"{key}: unknown unit {m.group(2)!r} in {value!r}; use bytes or one of "
                "KiB, MiB, GiB, TiB"
            )
        size = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise SettingError(
            f"{key}: expected a size (int bytes or a string like '512MiB'), got {value!r}"
        )
    if size < minimum:
        raise SettingError(f"{key}: must be at least {minimum} bytes, got {value!r}")
    return size


def size_at_least(minimum: int) -> Check:
    def parse(key: str, value: object) -> int:
        return parse_size(key, value, minimum=minimum)

    return parse


def flag(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise SettingError(f"{key}: expected true or false, got {value!r}")
    return value


def int_in(lo: int, hi: int) -> Check:
    def parse(key: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise SettingError(f"{key}: expected an int in [{lo}, {hi}], got {value!r}")
        return value

    return parse


def one_of(*choices: str) -> Check:
    def parse(key: str, value: object) -> str:
        if value not in choices:
            raise SettingError(f"{key}: expected one of {list(choices)}, got {value!r}")
        return str(value)

    return parse


def seconds(key: str, value: object) -> float:
    """A finite number of seconds, 0 included."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SettingError(f"{key}: expected a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise SettingError(f"{key}: expected a finite number >= 0, got {value!r}")
    return float(value)


def seconds_up_to(hi: float) -> Check:
    """Seconds in ``(0, hi]``."""

    def parse(key: str, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= hi:
            raise SettingError(f"{key}: expected seconds in (0, {hi:g}], got {value!r}")
        return float(value)

    return parse


def text(key: str, value: object) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value.strip():
        raise SettingError(f"{key}: expected a non-empty string, got {value!r}")
    return value


def any_text(key: str, value: object) -> str:
    if not isinstance(value, str):
        raise SettingError(f"{key}: expected a string, got {value!r}")
    return value


def path(key: str, value: object) -> str:
    """A non-empty path, ``~`` expanded."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    return os.path.expanduser(text(key, value))


def host_port(key: str, value: object) -> str:
    m = _HOST_PORT_RE.match(value) if isinstance(value, str) else None
    if m is None or not 0 < int(m.group("port")) < 65536:
        raise SettingError(f"{key}: expected 'host:port' (port 1-65535), got {value!r}")
    return value  # type: ignore[return-value]


def file_mode(owner_bits: int) -> Check:
    """A permission mode (int like 0o700 or an octal string like "0700") that keeps the
    owner's ``owner_bits``: a mode that locks the store out of its own files would only
    fail later, one put at a time."""

    def parse(key: str, value: object) -> int:
        mode: int | None = None
        if isinstance(value, int) and not isinstance(value, bool):
            mode = value
        elif isinstance(value, str) and re.fullmatch(r"\s*(0o?)?[0-7]{1,4}\s*", value):
            mode = int(value.strip().removeprefix("0o") or "0", 8)
        if mode is None or not 0 <= mode <= 0o777:
            raise SettingError(
                f"{key}: expected a permission mode such as 0o{owner_bits:o} or "
                f"'0{owner_bits:o}' (octal, at most 0777), got {value!r}"
            )
        if mode & owner_bits != owner_bits:
            raise SettingError(
                f"{key}: the owner needs at least 0{owner_bits:o} (read/write"
                f"{'/search' if owner_bits & 0o100 else ''}), got 0{mode:o}"
            )
        return mode

    return parse


#: A settings table: key -> (check, default, help).
Table = dict[str, tuple[Check, Any, str]]


def parse_table(table: Table, given: dict[str, object], error: type[ValueError]) -> dict[str, Any]:
    """Every key of ``table`` parsed from ``given`` (all of whose keys it knows), defaults
    for the rest; a failed check raises ``error`` with its message."""
    parsed: dict[str, Any] = {}
    try:
        for key, value in given.items():
            parsed[key] = table[key][0](key, value)
    except SettingError as exc:
        raise error(str(exc)) from exc
    for key, (_check, default, _help) in table.items():
        parsed.setdefault(key, default)
    return parsed
