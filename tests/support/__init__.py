"""Helpers the tests share; no tests here (pytest collects only ``test_*.py``).

- ``standin_connector``: the one stand-in KV connector (vLLM's active connector in tests).
- ``connector_harness``: both sides of UCMPatchConnector in one process, without an engine.
- ``connector_child``: real vLLM with UCMPatchConnector in a child process
  (``python -m tests.support.connector_child``).
- ``vllm_helpers``: real vLLM with the stand-in connector in a child process.
- ``fakes_store``: a KVStore whose latency, capacity and failures a test controls.
- ``store_contract``: the contract every KVStore keeps, as plain functions.

Kept light (no vLLM, no torch): child processes import it before anything else.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]

# The KVTransferConfig fields that make vLLM load the stand-in connector; the child needs
# the repository root on PYTHONPATH (:func:`repo_pythonpath`).
STANDIN_CONNECTOR = {
    "kv_connector": "StandInConnector",
    "kv_connector_module_path": "tests.support.standin_connector",
}


def repo_pythonpath() -> str:
    """``PYTHONPATH`` for a child that imports ``tests.support``: the repository root first."""
    return os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


def remove_tier_dir(path: Path) -> None:
    """Remove a memory-tier directory a test made on /dev/shm. A store the test dropped
    without close() may still be warming it (allocating segments in a thread until the
    store is collected): collect it first, and retry while a last segment lands."""
    import gc
    import shutil
    import time

    gc.collect()
    for _ in range(50):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.02)


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` imported as module ``name`` (the scripts are not a package;
    tests drive the very functions ``make`` runs)."""
    path = REPO / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
