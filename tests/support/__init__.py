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

import os
from pathlib import Path

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
