"""Never break the host, on real vLLM: every in-range patch record, faulted two ways.

For every record that is in range on the installed vLLM (taken from ``ucm_patch.report()``
in the child, with the opt-in ``kv_ready_event`` switched on so its records count too):

* **target missing**: the record's target is renamed (attribute suffix) or removed (its
  owner renamed) before activation, exactly what an upstream refactor does to us. vLLM
  still imports and generates, and the record reports ``failed`` with the reason; with
  ``strict`` the same activation raises :class:`PatchFailed`.
* **wrapper raising at call time**: the record's ``make_wrapper`` returns a wrapper that
  raises (before the original for half the records, after it for the other half).
  Generation completes with the same greedy tokens, and every record whose wrapper ran
  reports ``failed``; with ``strict`` the first call raises :class:`PatchFailed`.

Both generation runs use tiny Qwen3-Next (GDN + full attention) with the recording
connector, so the GDN and KV-ready wrappers really run (a skip_when gate would otherwise
keep them idle). Two vLLM starts in all; the strict checks need no engine.

Why the target is renamed in the *record* rather than deleted from vLLM: deleting a
method vLLM itself calls breaks vLLM whatever we do; renaming the record's target is
what ucm_patch sees when upstream renames it, and leaves vLLM intact to prove it runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import RunPy
from tests.support import repo_pythonpath

pytestmark = pytest.mark.vllm

COMMON = """
import importlib, json, sys
import ucm_patch
from ucm_patch.registry import Registry

ENV = {"UCM_PATCH_KV_READY_EVENT": "1"}
IGNORED = {"skipped-version", "disabled"}


def in_range():
    '''Records in range and enabled here (no import: vLLM's import order is left alone).'''
    probe = Registry([ucm_patch.registry().status(r["id"]).record for r in ucm_patch.report()])
    probe.activate(env=ENV)
    out = [row["id"] for row in probe.report() if row["state"] not in IGNORED]
    probe.revert()
    return out


def imported(ids):
    '''Ids whose target module this process imported (the others stay waiting).'''
    reg = ucm_patch.registry()
    return [i for i in ids if reg.status(i).record.module in sys.modules]


def optional_ids(ids):
    return [i for i in ids if ucm_patch.registry().status(i).record.optional]


def renamed(target, i):
    mod, _, qual = target.partition(":")
    parts = qual.split(".")
    if i % 2 == 0 or len(parts) == 1:
        parts[-1] += "_renamed_upstream"  # attribute renamed
    else:
        parts[0] += "Removed"  # owning class removed
    return mod + ":" + ".".join(parts)
"""

GENERATE = """
def generate(model):
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    llm = LLM(model=model, dtype="bfloat16", max_model_len=128, max_num_seqs=4, seed=0,
              disable_hybrid_kv_cache_manager=False,
              kv_transfer_config=KVTransferConfig(kv_connector="StandInConnector",
                  kv_connector_module_path="tests.support.standin_connector", kv_role="kv_both"))
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate(["hello world this is", "the quick brown fox jumps",
                         "one two three four five six"], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
"""

MISSING = (
    COMMON
    + GENERATE
    + """
if __name__ == "__main__":
    # ``import ucm_patch`` activated from the environment; records apply when vLLM imports
    # their modules, which has not happened yet.
    reg = ucm_patch.registry()
    ids = in_range()
    for i, rid in enumerate(ids):
        rec = reg.status(rid).record
        rec.target = renamed(rec.target, i)
    tokens = generate(sys.argv[1])
    rows = {r["id"]: r for r in ucm_patch.report()}
    print("RESULT " + json.dumps({"ids": ids, "tokens": tokens, "optional": optional_ids(ids),
          "imported": imported(ids), "rows": {i: rows[i] for i in ids}}))
"""
)

RAISING = (
    COMMON
    + GENERATE
    + """
CALLED = {}


def raising(rid, before, real_factory):
    def factory():
        real_factory()  # keeps the record's apply-time setup (e.g. layerwise.bind())

        def wrapper(wrapped, instance, args, kwargs):
            CALLED[rid] = CALLED.get(rid, 0) + 1
            if before:
                raise RuntimeError("injected pre-call fault in " + rid)
            out = wrapped(*args, **kwargs)
            raise RuntimeError("injected post-call fault in " + rid)
        return wrapper
    return factory


if __name__ == "__main__":
    reg = ucm_patch.registry()
    ids = in_range()
    for i, rid in enumerate(ids):
        rec = reg.status(rid).record
        rec.make_wrapper = raising(rid, i % 2 == 0, rec.make_wrapper)
    tokens = generate(sys.argv[1])
    rows = {r["id"]: r for r in ucm_patch.report()}
    print("RESULT " + json.dumps({"ids": ids, "tokens": tokens, "called": CALLED,
          "optional": optional_ids(ids), "imported": imported(ids),
          "rows": {i: rows[i] for i in ids}}))
"""
)

STRICT = (
    COMMON
    + """
import inspect

from ucm_patch.errors import PatchFailed


def always_raises():
    def wrapper(wrapped, instance, args, kwargs):
        raise RuntimeError("injected strict fault")
    return wrapper


if __name__ == "__main__":
    out = {}
    ids = in_range()
    for i, rid in enumerate(ids):
        original = ucm_patch.registry().status(rid).record
        try:
            importlib.import_module(original.module)
        except (ImportError, AttributeError) as exc:  # e.g. fusion passes needing CUDA ops
            out[rid] = {"unimportable": repr(exc)}
            continue
        # (a) target missing, strict: activation itself raises
        rec = original
        ON = {rec.name: True}
        saved = rec.target
        rec.target = renamed(saved, i)
        try:
            Registry([rec]).activate(patches=ON, env={}, strict=True)
            missing = "no exception"
        except PatchFailed as exc:
            missing = "PatchFailed: " + str(exc)
        finally:
            rec.target = saved
        # (b) wrapper raising, strict: the first call raises
        saved_factory, saved_skip = rec.make_wrapper, rec.skip_when
        rec.make_wrapper = always_raises
        rec.skip_when = None  # no connector here: the idle gate would bypass the wrapper
        reg = Registry([rec])
        reg.activate(patches=ON, env={}, strict=not rec.optional)
        if reg.report()[0]["state"] == "target-missing":  # optional and absent on this build
            out[rid] = {"missing": missing, "call": "absent", "state": "target-missing"}
            rec.make_wrapper, rec.skip_when = saved_factory, saved_skip
            continue
        reg.activate(patches=ON, env={}, strict=True)
        mod, _, qual = rec.target.partition(":")
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
        # One None per required parameter: a trampoline binds arguments like the
        # original does, so a call of the wrong shape would fail before the wrapper.
        params = inspect.signature(obj).parameters.values()
        args = [None for p in params if p.default is p.empty and p.kind <= p.POSITIONAL_OR_KEYWORD]
        kwargs = {p.name: None for p in params if p.default is p.empty and p.kind == p.KEYWORD_ONLY}
        try:
            obj(*args, **kwargs)
            call = "no exception"
        except PatchFailed as exc:
            call = "PatchFailed: " + str(exc)
        state = reg.report()[0]["state"]
        reg.revert()
        rec.make_wrapper, rec.skip_when = saved_factory, saved_skip
        out[rid] = {"missing": missing, "call": call, "state": state}
    print("RESULT " + json.dumps({"ids": ids, "out": out, "optional": optional_ids(ids),
                                  "imported": imported(ids)}))
"""
)

ENV = {
    "UCM_PATCH_KV_READY_EVENT": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "PYTHONPATH": repo_pythonpath(),
    "UCM_TEST_RECORD": os.devnull,
}


def _result(stdout: str) -> dict:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.fixture(scope="module")
def missing_run(tiny_qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(MISSING, tiny_qwen3_next, tmp_path_factory.mktemp("missing"))


@pytest.fixture(scope="module")
def raising_run(tiny_qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(RAISING, tiny_qwen3_next, tmp_path_factory.mktemp("raising"))


def _run(code: str, model: Path, tmp: Path) -> dict:
    import subprocess

    from tests.conftest import PY, clean_env

    script = tmp / "child.py"
    script.write_text(code)
    proc = subprocess.run(
        [PY, str(script), str(model)],
        cwd=tmp,
        env=clean_env(ENV),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return _result(proc.stdout)


def _records_under_test(result: dict) -> list[str]:
    ids = result["imported"]
    # The GDN core (CPU op kernel and the Python core) and the KV-ready op must be among
    # them, or this test would prove nothing on this build.
    assert any(i.startswith("gdn_layerwise@") for i in ids), ids
    assert any(i.startswith("kv_ready_event@") for i in ids), ids
    return ids


def test_target_missing_reports_failed_and_vllm_generates(missing_run: dict) -> None:
    ids = _records_under_test(missing_run)
    assert all(len(t) == 6 for t in missing_run["tokens"]), missing_run["tokens"]
    for rid in set(missing_run["ids"]) - set(ids):
        assert missing_run["rows"][rid]["state"] == "waiting-for-import"  # never imported
    for rid in ids:
        row = missing_run["rows"][rid]
        expected = "target-missing" if rid in missing_run["optional"] else "failed"
        assert row["state"] == expected, row
        assert "has no attribute" in row["reason"], row
        assert "_renamed_upstream" in row["reason"] or "Removed" in row["reason"], row


def test_wrapper_raising_reports_failed_and_tokens_unchanged(
    missing_run: dict, raising_run: dict
) -> None:
    ids = _records_under_test(raising_run)
    assert raising_run["imported"] == missing_run["imported"]
    # Nothing was applied in the target-missing run: it is vLLM as shipped.
    assert raising_run["tokens"] == missing_run["tokens"]
    called = raising_run["called"]
    assert any(c.startswith("gdn_layerwise@") for c in called), called
    assert any(c.startswith("kv_ready_event@") for c in called), called
    for rid in ids:
        row = raising_run["rows"][rid]
        if rid in called:
            assert called[rid] == 1, (rid, called)  # a pass-through after the first fault
            assert row["state"] == "failed", row
            assert row["reason"].startswith("wrapper raised at call time: RuntimeError"), row
            assert "injected p" in row["reason"] and rid in row["reason"], row
        elif rid in raising_run["optional"] and row["state"] == "target-missing":
            assert "has no attribute" in row["reason"], row  # e.g. the ROCm core on CPU
        else:
            assert row["state"] == "applied", row  # never called on this model: untouched


def test_strict_mode_raises_for_every_record(run_py: RunPy) -> None:
    proc = run_py(STRICT, env={**ENV, "UCM_PATCH": "0"})
    result = _result(proc.stdout)
    ids = _records_under_test(result)
    for rid in ids:
        got = result["out"][rid]
        if rid in result["optional"]:
            # optional records may legitimately be absent: reported, never raised
            assert got["missing"] == "no exception", (rid, got)
            if got["call"] == "absent":
                continue
        else:
            assert got["missing"].startswith(f"PatchFailed: {rid}"), (rid, got)
            assert "has no attribute" in got["missing"], (rid, got)
        assert got["call"] == "PatchFailed: wrapper raised at call time: " + repr(
            RuntimeError("injected strict fault")
        ), (rid, got)
        assert got["state"] == "failed", (rid, got)


BAD_EXTRA = """
import sys
from vllm import LLM
from vllm.config import KVTransferConfig
from ucm_patch.connector.config import ConnectorConfigError

if __name__ == "__main__":
    try:
        LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=128, max_num_seqs=2,
            kv_transfer_config=KVTransferConfig(
                kv_connector="UCMPatchConnector", kv_role="kv_both",
                kv_connector_extra_config={"prefetch_rows": 2}))
    except ConnectorConfigError as exc:
        print("ERROR " + str(exc))
"""


def test_bad_extra_config_through_real_vllm_names_the_key(run_py: RunPy, tiny_qwen3: Path) -> None:
    """The user's ``LLM(...)`` call gets our ConnectorConfigError itself (not a wrapped or
    deep vLLM error), and its message names the bad key and the accepted ones."""
    proc = run_py(
        BAD_EXTRA,
        args=(str(tiny_qwen3),),
        env={
            "VLLM_PLUGINS": "ucm_patch",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        },
    )
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("ERROR "))
    for name in ("prefetch_rows", "accepted keys", "load_prefetch_rows"):
        assert name in line, line
