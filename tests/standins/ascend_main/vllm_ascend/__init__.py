"""Stand-in vllm_ascend main (commit 182b75ea84ff, 2026-08-22) for tests: a *partial* one.

Only the modules listed in ``../STANDIN_OF`` imitate main (checked against the facts of
``main@182b75ea84ff`` in scripts/data/ascend_signatures.json by
tests/test_patches_ascend_standins.py). Every other submodule comes from the 0.23 stand-in,
appended to this package's search path: main's hook functions in ``attention/utils.py`` have
the 0.23 signatures (same data file).
"""

from pathlib import Path

__path__.append(str(Path(__file__).resolve().parents[2] / "ascend_0_23" / "vllm_ascend"))
