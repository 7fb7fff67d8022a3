"""Import / activate / revert orderings, each in a fresh interpreter (ddtrace's matrix).

A throw-away target module stands in for vLLM here so that every ordering runs in about
a second; tests/test_registry_vllm.py repeats the important ones on the real records and
the real vLLM modules.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TARGET = """
def helper(x):
    return x * 10

class Layer:
    def core(self, x):
        return x + 1

class Child(Layer):
    pass
"""

HARNESS = '''
import json, sys
from ucm_patch.records import PatchRecord
from ucm_patch.installer import MARKER
from ucm_patch.registry import Registry

CALLS = []

def make_wrapper():
    def wrapper(wrapped, instance, args, kwargs):
        CALLS.append(wrapped.__name__)
        return wrapped(*args, **kwargs)
    return wrapper

RECORDS = [
    PatchRecord("demo_core", "t1", "fake_target:Layer.core", {"wrapt": ">=1"}, make_wrapper,
                why="test", upstream="none", removal="never"),
    PatchRecord("demo_helper", "t1", "fake_target:helper", {"wrapt": ">=1"}, make_wrapper,
                why="test", upstream="none", removal="never"),
]
REG = Registry(RECORDS)

def depth(obj):
    """How many of our wrappers are stacked on obj."""
    n = 0
    while obj is not None:
        if getattr(obj, MARKER, None):
            n += 1
        obj = getattr(obj, "__wrapped__", None)
    return n

def result():
    import fake_target
    CALLS.clear()
    out = {
        "core": fake_target.Layer().core(1),
        "child": fake_target.Child().core(2),
        "helper": fake_target.helper(3),
        "calls": list(CALLS),
        "depth_core": depth(vars(fake_target.Layer)["core"]),
        "depth_helper": depth(fake_target.helper),
        "states": {r["id"]: r["state"] for r in REG.report()},
    }
    print("RESULT " + json.dumps(out))
'''

ORDERINGS = {
    "import_then_activate": "import fake_target\nREG.activate()\n",
    "activate_then_import": "REG.activate()\nimport fake_target\n",
    "activate_twice": "REG.activate()\nimport fake_target\nREG.activate()\nREG.activate()\n",
    "activate_revert_activate": "REG.activate()\nimport fake_target\nREG.revert()\n"
    "REG.activate()\n",
    "activate_import_revert_activate_twice": "import fake_target\nREG.activate()\n"
    "REG.revert()\nREG.activate()\nREG.activate()\n",
}
REVERTED = {
    "revert_twice": "REG.activate()\nimport fake_target\nREG.revert()\nREG.revert()\n",
    "revert_before_import": "REG.activate()\nREG.revert()\nimport fake_target\n",
}


def _run(run_py, tmp_path: Path, body: str) -> dict:
    (tmp_path / "fake_target.py").write_text(TARGET)
    (tmp_path / "harness.py").write_text(HARNESS)
    proc = run_py("from harness import *\n" + body + "result()\n")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize("ordering", sorted(ORDERINGS))
def test_ordering_applies_exactly_once(run_py, tmp_path: Path, ordering: str) -> None:
    out = _run(run_py, tmp_path, ORDERINGS[ordering])
    assert (out["core"], out["child"], out["helper"]) == (2, 3, 30)  # behaviour unchanged
    assert out["calls"] == ["core", "core", "helper"]  # each call wrapped exactly once
    assert out["depth_core"] == 1 and out["depth_helper"] == 1  # never double-wrapped
    assert set(out["states"].values()) == {"applied"}


@pytest.mark.parametrize("ordering", sorted(REVERTED))
def test_revert_restores_the_exact_original(run_py, tmp_path: Path, ordering: str) -> None:
    out = _run(run_py, tmp_path, REVERTED[ordering])
    assert (out["core"], out["child"], out["helper"]) == (2, 3, 30)
    assert out["calls"] == []
    assert out["depth_core"] == 0 and out["depth_helper"] == 0
    assert set(out["states"].values()) == {"reverted"}


def test_revert_leaves_a_foreign_replacement_alone(run_py, tmp_path: Path) -> None:
    body = (
        "import warnings\nREG.activate()\nimport fake_target\n"
        "foreign = lambda self, x: -1\nfake_target.Layer.core = foreign\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    REG.revert()\n"
        "print('WARN', [str(x.message) for x in w])\n"
        "assert fake_target.Layer.core is foreign\n"
    )
    out = _run(run_py, tmp_path, body)
    assert out["core"] == -1  # the foreign function stays in place
    assert out["states"]["demo_core@t1"] == "revert-refused"
    assert out["states"]["demo_helper@t1"] == "reverted"


def test_inherited_attribute_is_deleted_on_revert(run_py, tmp_path: Path) -> None:
    """Wrapping Child.core (inherited) must not leave a copy of Layer.core on Child."""
    body = (
        "REG._status.clear()\n"
        "rec = PatchRecord('demo_child', 't1', 'fake_target:Child.core', {'wrapt': '>=1'},\n"
        "                  make_wrapper, why='t', upstream='t', removal='t')\n"
        "from ucm_patch.registry import RecordStatus\nREG._status[rec.id] = RecordStatus(rec)\n"
        "REG.activate()\nimport fake_target\n"
        "assert 'core' in vars(fake_target.Child)\n"
        "REG.revert()\nassert 'core' not in vars(fake_target.Child)\n"
    )
    out = _run(run_py, tmp_path, body)
    assert out["calls"] == []
