"""docs/PATCHES.md is generated from the records; this fails when it is stale."""

from __future__ import annotations

from tests.conftest import REPO
from ucm_patch.docs import render_patches_md
from ucm_patch.environment import toggle_var
from ucm_patch.patches import all_patch_sets


def test_patches_md_is_up_to_date() -> None:
    path = REPO / "docs" / "PATCHES.md"
    current = path.read_text(encoding="utf-8")
    assert current == render_patches_md(current), "run `make docs` (ucm-patch docs)"


def test_every_record_is_documented_and_valid() -> None:
    text = (REPO / "docs" / "PATCHES.md").read_text(encoding="utf-8")
    all_ids = {r.id for ps in all_patch_sets() for r in ps.records}
    ids: set[str] = set()
    for ps in all_patch_sets():
        for rec in ps.records:
            rec.validate()  # PEP 440 ranges parse
            assert rec.id not in ids, f"duplicate record id {rec.id}"
            ids.add(rec.id)
            assert f"### `{rec.id}`" in text
            assert set(rec.supersedes) <= all_ids, f"{rec.id} supersedes unknown ids"
            for field in (rec.why, rec.upstream, rec.removal):
                assert len(field.split()) >= 3, f"{rec.id}: write a real sentence"


def test_every_toggle_is_in_the_toggles_table() -> None:
    """Toggle names are not always module names (``ascend_hook_bindings`` lives in
    ``patches/vllm_ascend/hook_bindings.py``): the Toggles table maps each to its files."""
    text = (REPO / "docs" / "PATCHES.md").read_text(encoding="utf-8")
    section = text.split("\n## Toggles\n", 1)[1].split("\n## ", 1)[0]
    rows = {
        line.split("|")[1].strip().strip("`"): line
        for line in section.splitlines()
        if line.startswith("| `")
    }
    toggles: set[str] = set()
    for ps in all_patch_sets():
        path = "patches/" + ps.module.removeprefix("ucm_patch.patches.").replace(".", "/") + ".py"
        assert (REPO / path).is_file(), path
        for rec in ps.records:
            toggles.add(rec.name)
            assert rec.name in rows, f"toggle {rec.name!r} is missing from the Toggles table"
            assert f"`{path}`" in rows[rec.name], f"{rec.name}: {path} not in its row"
            assert f"`{toggle_var(rec.name)}`" in rows[rec.name]
    assert set(rows) == toggles, "the Toggles table names a toggle no record has"
