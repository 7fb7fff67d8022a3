"""docs/PATCHES.md is generated from the records; this fails when it is stale."""

from __future__ import annotations

from tests.conftest import REPO
from ucm_patch.docs import render_patches_md
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
