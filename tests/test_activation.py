"""Activation through ``import ucm_patch``: cheap, lazy, switchable, never breaks the host."""

from __future__ import annotations

import json
import textwrap

VLLM_ATTN = "vllm.model_executor.layers.attention.attention"


def test_import_imports_neither_vllm_nor_torch(run_py) -> None:
    proc = run_py("""
        import sys, ucm_patch
        # packaging too: ranges are parsed when a target's module is imported, not here
        # (scripts/bench_core.py measures the start cost in a site without it); and
        # dataclasses / inspect: a dataclass in a module imported at start pulled in
        # inspect, ast, dis and tokenize, half of the start budget
        heavy = sorted(
            m for m in ("vllm", "torch", "wrapt", "asyncio", "packaging", "dataclasses",
                        "inspect") if m in sys.modules
        )
        print(heavy)
        assert ucm_patch.registry().active
    """)
    assert proc.stdout.strip() == "[]"


def test_global_switch_off(run_py) -> None:
    proc = run_py(
        """
        import json, ucm_patch
        print(json.dumps(sorted({r["state"] for r in ucm_patch.report()})))
        print(ucm_patch.registry().active)
    """,
        env={"UCM_PATCH": "0"},
    )
    states, active = proc.stdout.split()
    assert active == "False"
    assert set(json.loads(states)) <= {"inactive"}


def test_bad_global_switch_is_a_clear_error(run_py) -> None:
    proc = run_py("import ucm_patch", env={"UCM_PATCH": "perhaps"}, check=False)
    assert proc.returncode != 0
    assert "UCM_PATCH='perhaps' is not a switch; accepted: 1/0, true/false" in proc.stderr


UNKNOWN = {"UCM_PATCH_MATRIX_DIR": "/x", "UCM_PATCH_GDN_LAYERWSE": "0"}


def test_unknown_variables_are_one_warning_naming_the_nearest_name(run_py) -> None:
    """Issue #36: a stray ``UCM_PATCH_*`` name (another tool's, or a typo) is one WARNING
    per process naming each one and what it probably meant; the package still activates,
    and activating again does not repeat it."""
    proc = run_py(
        """
        import ucm_patch
        ucm_patch.activate()
        print(ucm_patch.registry().active)
    """,
        env=UNKNOWN,
    )
    assert proc.stdout.strip() == "True"
    warned = [ln for ln in proc.stderr.splitlines() if "UCM_PATCH_GDN_LAYERWSE" in ln]
    assert len(warned) == 1, proc.stderr
    assert "did you mean UCM_PATCH_GDN_LAYERWISE?" in warned[0]
    assert "UCM_PATCH_MATRIX_DIR (moved: make matrix reads UCM_MATRIX_DIR)" in warned[0]
    assert "UCM_PATCH_STRICT=1" in warned[0]
    assert "/x" not in proc.stderr  # names only, never values


def test_unknown_variable_is_an_error_in_strict_mode(run_py) -> None:
    proc = run_py("import ucm_patch", env={**UNKNOWN, "UCM_PATCH_STRICT": "1"}, check=False)
    assert proc.returncode != 0
    assert (
        "ConfigError: UCM_PATCH_GDN_LAYERWSE (did you mean UCM_PATCH_GDN_LAYERWISE?), "
        "UCM_PATCH_MATRIX_DIR (moved: make matrix reads UCM_MATRIX_DIR) are not ucm_patch "
        "variables"
    ) in proc.stderr


FAILING = textwrap.dedent(f"""
    import sys
    from ucm_patch.records import PatchRecord
    from ucm_patch.registry import Registry

    def boom():
        raise RuntimeError("factory exploded")

    def ok():
        return lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)

    reg = Registry([
        PatchRecord("moved", "t", "{VLLM_ATTN}:NoSuchClass.forward", {{"vllm": ">=0.1"}}, ok,
                    why="t", upstream="t", removal="t"),
        PatchRecord("raises", "t", "{VLLM_ATTN}:get_attention_context", {{"vllm": ">=0.1"}},
                    boom, why="t", upstream="t", removal="t"),
        PatchRecord("too_new", "t", "{VLLM_ATTN}:get_attention_context", {{"vllm": ">=99"}},
                    ok, why="t", upstream="t", removal="t"),
    ])
    reg.activate(strict=STRICT)
    import {VLLM_ATTN} as mod
    assert callable(mod.get_attention_context)
    for r in reg.report():
        print(r["id"], r["state"], r["reason"])
""")


def test_failures_are_reported_and_vllm_still_imports(run_py) -> None:
    proc = run_py("STRICT = False\n" + FAILING)
    lines = dict(ln.split(" ", 1) for ln in proc.stdout.strip().splitlines())
    assert lines["moved@t"].startswith("failed ")
    assert "has no attribute 'NoSuchClass'" in lines["moved@t"]
    assert lines["raises@t"] == "failed RuntimeError: factory exploded"
    assert lines["too_new@t"].startswith("skipped-version vllm 0.32.0")
    assert "outside the required range >=99" in lines["too_new@t"]


def test_strict_mode_raises(run_py) -> None:
    proc = run_py("STRICT = True\n" + FAILING, check=False)
    assert proc.returncode != 0
    assert "ucm_patch.errors.PatchFailed: moved@t" in proc.stderr


def test_strict_from_environment(run_py) -> None:
    proc = run_py(
        """
        import ucm_patch
        print(ucm_patch.registry().strict)
    """,
        env={"UCM_PATCH_STRICT": "1"},
    )
    assert proc.stdout.strip() == "True"


def test_debug_prints_the_report_to_stderr(run_py) -> None:
    proc = run_py("import ucm_patch", env={"UCM_PATCH_DEBUG": "1"})
    assert proc.stderr.splitlines()[0].split()[:3] == ["ID", "STATE", "TARGET"]
