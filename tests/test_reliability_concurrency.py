"""Concurrency: activation from many threads, fork after activation, no double wrap.

Each test runs in a fresh interpreter (patching is process-global). "No deadlock" is
checked with bounded joins / ``signal.alarm`` in the child: a hang fails the test with a
message instead of hanging pytest. Several vLLM processes loading the plugin at once is
covered by tests/test_plugin_vllm.py (API process, engine core and worker each activate).
"""

from __future__ import annotations

import json

from tests.conftest import RunPy

GDN_MODULE = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"

COUNT_WRAPS = """
from ucm_patch.installer import MARKER


def wraps_on(target):
    '''How many ucm_patch wrappers sit on ``module:Qual.attr`` (0, 1, or a double wrap).'''
    import importlib
    mod, _, qual = target.partition(":")
    parent = importlib.import_module(mod)
    parts = qual.split(".")
    for p in parts[:-1]:
        parent = getattr(parent, p)
    obj = vars(parent).get(parts[-1]) if isinstance(parent, type) else getattr(parent, parts[-1])
    n = 0
    while obj is not None:
        n += getattr(obj, MARKER, None) is not None
        obj = getattr(obj, "__wrapped__", None)
    return n
"""

SYNTHETIC = (
    COUNT_WRAPS
    + """
import os, sys, threading
from ucm_patch.records import PatchRecord
from ucm_patch.registry import Registry

sys.path.insert(0, os.getcwd())
CALLS = []


def make_wrapper():
    def wrapper(wrapped, instance, args, kwargs):
        CALLS.append(1)
        return wrapped(*args, **kwargs) + 1
    return wrapper


def write_module(name):
    with open(f"{name}.py", "w") as fh:
        fh.write("import time\\ntime.sleep(0.002)\\n"
                 "class Core:\\n    def run(self, x):\\n        return x * 2\\n")


def record(name):
    return PatchRecord("conc", name, f"{name}:Core.run", {"wrapt": ">=1"}, make_wrapper,
                       why="concurrency test", upstream="test only", removal="never")
"""
)

THREADS = (
    SYNTHETIC
    + """
import importlib, json
ROUNDS, N = 40, 8
bad = []
for r in range(ROUNDS):
    name = f"ucm_conc_target_{r}"
    write_module(name)
    reg = Registry([record(name)])
    barrier = threading.Barrier(N)
    errors = []

    def work(i):
        try:
            barrier.wait(timeout=30)
            if i % 2:
                reg.activate()
            else:
                importlib.import_module(name)
            reg.report()
        except Exception as exc:  # reported below, never swallowed
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    alive = sum(t.is_alive() for t in threads)
    mod = importlib.import_module(name)
    CALLS.clear()
    value = mod.Core().run(3)
    row = reg.report()[0]
    out = (alive, errors, row["state"], wraps_on(f"{name}:Core.run"), value, len(CALLS))
    if out != (0, [], "applied", 1, 7, 1):
        bad.append((r, out))
print("RESULT " + json.dumps({"rounds": ROUNDS, "bad": bad}))
"""
)


def _result(stdout: str) -> dict:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_activation_and_import_from_many_threads(run_py: RunPy) -> None:
    """8 threads race activate() against the target's first import, 40 times over."""
    result = _result(run_py(THREADS, timeout=240).stdout)
    assert result == {"rounds": 40, "bad": []}


REAL_THREADS = (
    COUNT_WRAPS
    + f"""
import importlib, json, threading
import ucm_patch
from ucm_patch import plugin

N = 8
barrier = threading.Barrier(N)
errors = []


def work(i):
    try:
        barrier.wait(timeout=60)
        if i == 0:
            # One importer: importing vLLM from several threads at once failed here with
            # ImportError (Qwen3NextConfig from transformers' lazy module); whether that
            # happens without ucm_patch too has not been checked yet.
            importlib.import_module("{GDN_MODULE}")
        elif i % 2:
            ucm_patch.activate()
        else:
            plugin.register()
    except Exception as exc:  # reported below, never swallowed
        errors.append(repr(exc))


threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(N)]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=180)
rows = [r for r in ucm_patch.report() if r["target"].startswith("{GDN_MODULE}:")]
applied = {{r["id"]: wraps_on(r["target"]) for r in rows if r["state"] == "applied"}}
print("RESULT " + json.dumps({{"alive": sum(t.is_alive() for t in threads),
                              "errors": errors, "applied": applied}}))
"""
)


FORK = (
    COUNT_WRAPS
    + """
import json, os, sys
from ucm_patch.records import PatchRecord
from ucm_patch.registry import Registry

sys.path.insert(0, os.getcwd())
CALLS = []


def make_wrapper():
    def wrapper(wrapped, instance, args, kwargs):
        CALLS.append(1)
        return wrapped(*args, **kwargs) + 1
    return wrapper


for name in ("fork_before", "fork_after"):
    with open(f"{name}.py", "w") as fh:
        fh.write("class Core:\\n    def run(self, x):\\n        return x * 2\\n")

reg = Registry([
    PatchRecord("fork_before", "t", "fork_before:Core.run", {"wrapt": ">=1"}, make_wrapper,
                why="test record here", upstream="test only here", removal="never at all"),
    PatchRecord("fork_after", "t", "fork_after:Core.run", {"wrapt": ">=1"}, make_wrapper,
                why="test record here", upstream="test only here", removal="never at all"),
])
reg.activate()
import fork_before  # noqa: E402
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    reg.activate()  # idempotent in the child
    import fork_after  # first imported here: the child's own hook applies it
    values = [fork_before.Core().run(1), fork_after.Core().run(1)]
    out = {
        "states": [row["state"] for row in reg.report()],
        "wraps": [wraps_on("fork_before:Core.run"), wraps_on("fork_after:Core.run")],
        "values": values,
        "calls": len(CALLS),
    }
    os.write(w, json.dumps(out).encode())
    os._exit(0)
os.close(w)
child = json.loads(os.read(r, 65536).decode())
_, status = os.waitpid(pid, 0)
print("RESULT " + json.dumps({"exit": os.waitstatus_to_exitcode(status), "child": child,
                              "parent": [row["state"] for row in reg.report()]}))
"""
)


def test_fork_after_activation(run_py: RunPy) -> None:
    """The child sees the patch applied once, re-activates idempotently, patches new imports."""
    result = _result(run_py(FORK, timeout=60).stdout)
    assert result["exit"] == 0
    assert result["child"] == {
        "states": ["applied", "applied"],
        "wraps": [1, 1],
        "values": [3, 3],
        "calls": 2,
    }
    assert result["parent"] == ["applied", "waiting-for-import"]  # the child's import is its own


FORK_UNDER_LOAD = """
import json, os, signal, threading
import ucm_patch

reg = ucm_patch.registry()
ucm_patch.report()
# Fork during a *first* import in another thread leaves that module's import lock held in
# the child (CPython); ucm_patch's lazy imports are done by now, so only its locks count.
import packaging.specifiers, packaging.version  # noqa: E401,F401
stop = threading.Event()


def hammer():
    while not stop.is_set():
        reg.report()  # holds the registry lock most of the time


t = threading.Thread(target=hammer, daemon=True)
t.start()
hung = 0
for _ in range(50):
    pid = os.fork()
    if pid == 0:
        signal.alarm(5)  # a lock inherited held would hang here forever
        reg.report()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    hung += os.waitstatus_to_exitcode(status) != 0
stop.set()
t.join(timeout=30)
print("RESULT " + json.dumps({"hung": hung}))
"""


def test_fork_while_another_thread_reports(run_py: RunPy) -> None:
    """vLLM forks workers from a process whose other threads may be inside ucm_patch: a
    registry / import-hook lock inherited held by a thread that does not exist in the child
    must not hang the child (os.register_at_fork)."""
    result = _result(run_py(FORK_UNDER_LOAD, timeout=240).stdout)
    assert result == {"hung": 0}
