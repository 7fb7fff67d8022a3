"""The generated sections of docs/PATCHES.md, between ``<!-- name:start -->`` and ``end``.

The verifiers write their matrices there; ``ucm-patch docs`` carries the sections over
when it regenerates the rest of the file.
"""

from __future__ import annotations

from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def write_section(doc: Path, name: str, body: str) -> None:
    """Replace (or append) the section ``name`` of ``doc`` with ``body``."""
    start, end = markers(name)
    text = doc.read_text(encoding="utf-8") if doc.exists() else ""
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text, encoding="utf-8")


def read_section(doc: Path, name: str) -> str | None:
    """The body of section ``name`` of ``doc`` (stripped), or None when it has none."""
    start, end = markers(name)
    text = doc.read_text(encoding="utf-8") if doc.exists() else ""
    if start not in text or end not in text:
        return None
    return text[text.index(start) + len(start) : text.index(end)].strip()
