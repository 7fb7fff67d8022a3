"""Weights rewritten in place at the same path: the next run must not load the old KV.

Real vLLM CPU, three fresh processes on one store directory:

1. the tiny "sharp" Qwen3 (outputs depend on the KV) with the connector: request 1 dumps
   its prefix; request 2 (salted, so it cannot hit) records the old weights' output;
2. the checkpoint's weights are rewritten in place: same path, same file name and size,
   every tensor scaled; then a fresh process with the connector runs request 2: it must
   load nothing (the key fingerprint covers the weights) and compute with the new weights;
3. a fresh process without the connector runs request 2 on the new weights: the reference.

Before, the fingerprint was the path string: process 2 loaded the prefix computed with
the old weights and its output differed from the reference.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.connector_child import prompt, run_child, whole_units

PREFIX = prompt(9, 300)
R1 = [*PREFIX, 5, 6, 7]
R2 = [*PREFIX, 8, 9, 10, 11]

pytestmark = pytest.mark.vllm


def gen(name: str, ids: list[int], salt: str | None = None) -> dict[str, Any]:
    return {"op": "gen", "name": name, "prompt": ids, "salt": salt, "max_tokens": 8}


def rewrite_weights_in_place(model: Path) -> None:
    """Scale every floating tensor by 1.25 and save under the same file name."""
    path = model / "model.safetensors"
    tensors = load_file(str(path))
    changed = {
        name: (t * 1.25).to(t.dtype) if t.is_floating_point() else t for name, t in tensors.items()
    }
    assert any(not torch.equal(changed[n], tensors[n]) for n in tensors)
    save_file(changed, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def runs(tiny_qwen3_sharp: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("ucm_identity")
    model = tmp / "model"
    shutil.copytree(tiny_qwen3_sharp, model)
    extra = {"store": "local", "local_path": str(tmp / "store")}

    def spec(connector: dict[str, Any] | None, steps: list[dict[str, Any]]) -> dict[str, Any]:
        return {"model": str(model), "extra": connector, "steps": steps}

    old = run_child(
        spec(extra, [gen("r1", R1), {"op": "flush"}, gen("r2_old", R2, salt="old")]), tmp, "old"
    )
    size_before = (model / "model.safetensors").stat().st_size
    rewrite_weights_in_place(model)
    size_after = (model / "model.safetensors").stat().st_size
    new = run_child(spec(extra, [gen("r2", R2)]), tmp, "new")
    plain = run_child(spec(None, [gen("r2", R2)]), tmp, "plain")
    return {"old": old, "new": new, "plain": plain, "sizes": (size_before, size_after)}


def test_old_weights_dumped_the_prefix(runs: dict[str, Any]) -> None:
    old = runs["old"]
    block = old["vllm"]["block_size"]
    assert old["r1"]["stats"]["dump_blocks"] == whole_units(old, len(R1)) // block > 0
    assert runs["sizes"][0] == runs["sizes"][1]  # in place: same path, name and size


def test_new_weights_load_nothing_from_before_the_update(runs: dict[str, Any]) -> None:
    r2 = runs["new"]["r2"]
    assert r2["num_cached_tokens"] == 0
    assert r2["stats"]["hit_tokens"] == 0
    assert r2["stats"]["loaded_pages"] == 0
    assert runs["new"]["layout"]["fingerprint"] != runs["old"]["layout"]["fingerprint"]


def test_output_equals_the_new_weights_without_connector(runs: dict[str, Any]) -> None:
    new, plain, old = runs["new"]["r2"], runs["plain"]["r2"], runs["old"]["r2_old"]
    assert new["tokens"] == plain["tokens"]
    assert new["logprobs"] == plain["logprobs"]
    # the update really changed the model: old KV would have been a detectable error
    assert old["tokens"] != plain["tokens"] or old["logprobs"] != plain["logprobs"]
