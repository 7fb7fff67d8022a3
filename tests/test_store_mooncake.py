"""Mooncake store: the shared contract plus full store, killed master, absent master.

Why the two-process shape: Mooncake clients listen on 0.0.0.0 whatever they are told, so
master, storage node and client must live in a private network namespace. pytest itself
stays outside: a module fixture runs ``scripts/mooncake_netns.sh`` (master + 256 MB node on
loopback in ``unshare -n``), which runs this file as a driver (``--driver OUT``). The driver
runs every contract case and the failure scenarios, writing results to JSON after each
one; the tests below assert on that JSON. A crash, hang (killed after
``DRIVER_TIMEOUT_S``) or failed case inside the namespace therefore fails tests here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# Run as a script (the child driver) too: the repository root makes tests.support importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.store_contract import CASES, Harness
from ucm_patch.hooks.stores import parse_store_config
from ucm_patch.hooks.stores.base import KVStore

REPO = Path(__file__).resolve().parent.parent
NETNS = REPO / "scripts" / "mooncake_netns.sh"
DRIVER_TIMEOUT_S = 420
OP_BOUND_S = 30.0  # an operation against a dead master must fail within this
SETUP_BOUND_S = 20.0  # setup against no master must fail within this


# ==== driver: runs inside the network namespace ==========================================


_children: list[subprocess.Popen[bytes]] = []  # extra masters / nodes, killed at the end


def _only_loopback() -> list[str]:
    lines = Path("/proc/self/net/dev").read_text().splitlines()[2:]
    return [line.split(":")[0].strip() for line in lines]


def tamper_mooncake(store: KVStore, key: str, mode: object) -> None:
    """Replace the stored object of ``key`` with damaged bytes, through the raw client."""
    client = store._client  # type: ignore[attr-defined]
    framed = client.get(key)
    assert framed, f"nothing stored under {key!r} to tamper with"
    if mode == "flip":
        mid = len(framed) // 2 + 10
        damaged = framed[:mid] + bytes([framed[mid] ^ 0x10]) + framed[mid + 1 :]
    elif mode == "truncate":
        damaged = framed[:-7]
    elif isinstance(mode, tuple) and mode[0] == "swap":
        damaged = client.get(mode[1])
    else:
        raise ValueError(f"unknown tamper mode {mode!r}")
    assert client.remove(key, True) == 0
    assert client.put(key, damaged) == 0


def _start_master(port: int, log_dir: str) -> subprocess.Popen[bytes]:
    binary = shutil.which("mooncake_master") or str(
        Path(sys.executable).with_name("mooncake_master")
    )
    args = [binary, "-rpc_address=127.0.0.1", f"-rpc_port={port}", "-metrics_host=127.0.0.1"]
    with open(os.path.join(log_dir, f"master-{port}.log"), "wb") as log:
        proc = subprocess.Popen([*args, f"-metrics_port={port + 1}"], stdout=log, stderr=log)
    _children.append(proc)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"extra master on port {port} did not start")


def _start_node(master_port: int, port: int, log_dir: str) -> subprocess.Popen[bytes]:
    """A mooncake_client storage node (64 MB) registered with the master on master_port."""
    binary = shutil.which("mooncake_client") or str(
        Path(sys.executable).with_name("mooncake_client")
    )
    args = [binary, "-host=127.0.0.1", f"-port={port}", "-global_segment_size=64MB"]
    args += ["-local_buffer_size=16MB", f"-master_server_address=127.0.0.1:{master_port}"]
    args += ["-metadata_server=P2PHANDSHAKE", "-protocol=tcp"]
    with open(os.path.join(log_dir, f"node-{port}.log"), "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=log)
    _children.append(proc)
    url = f"http://127.0.0.1:{master_port + 1}/metrics/summary"
    before = _clients(url)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _clients(url) > before:
            return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"storage node on port {port} did not register")


def _clients(url: str) -> int:
    import re
    import urllib.request

    with urllib.request.urlopen(url, timeout=2) as reply:
        found = re.search(r"Clients: (\d+)", reply.read().decode())
    return int(found.group(1)) if found else 0


def _poll(fn: Callable[[], Any], ok: Callable[[Any], bool], limit: float) -> dict[str, Any]:
    """Call ``fn`` every 0.5 s until ``ok(result)``; report attempts, errors and time taken."""
    started = time.monotonic()
    errors: list[str] = []
    while time.monotonic() - started < limit:
        r = _bounded(fn, 60)
        if r.get("hung"):
            return {"hung": True, "errors": errors[-3:]}
        if "raised" not in r and ok(r["result"]):
            return {
                "ok": True,
                "seconds": round(time.monotonic() - started, 1),
                "errors": errors[-3:],
            }
        errors.append(r.get("message", repr(r.get("result")))[:200])
        time.sleep(0.5)
    return {"ok": False, "errors": errors[-3:]}


def _bounded(fn: Callable[[], Any], limit: float) -> dict[str, Any]:
    """Run ``fn`` in a thread; report what it raised and how long it took (or that it hung)."""
    box: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        try:
            box["result"] = fn()
        except BaseException as exc:  # reported to the test, which decides
            box["raised"] = type(exc).__name__
            box["message"] = str(exc)[:500]
        box["seconds"] = round(time.monotonic() - started, 2)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        return {"hung": True, "seconds": limit}
    return box


def _zero_copy(store: Any) -> dict[str, Any]:
    """Values inside memory the caller registered are put from there (zero-copy); the
    store keeps the bytes of the put, the frame still catches damage, and once the region
    is withdrawn its values go through the staging buffers again."""
    import ctypes

    page = 64 << 10
    region = bytearray(8 * page)
    view = memoryview(region)
    view[:] = os.urandom(len(region))
    addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    out: dict[str, Any] = {"registered": store.register_host_memory(addr, len(region))}
    items = [(f"zc-{i}", view[i * page : (i + 2) * page]) for i in range(0, 8, 2)]
    items.append(("zc-bytes", b"q" * 5000))  # not in the region: staged
    expect = [bytes(v) for _k, v in items]
    out["flags"] = store.put_many(items)
    out["zero_copy_puts"] = store.stats["zero_copy_puts"]
    view[:] = bytes(len(region))  # the region is reused: what was put stays stored
    out["same"] = store.get_many([k for k, _v in items]) == expect
    tamper_mooncake(store, "zc-0", "flip")
    out["tampered"] = store.get_many(["zc-0"]) == [None] and store.stats["corrupt"] == 1
    store.unregister_host_memory(addr)
    out["after_unregister"] = store.put_many([("zc-late", view[:page])]) == [True]
    out["zero_copy_after_unregister"] = store.stats["zero_copy_puts"]
    out["late_same"] = store.get_many(["zc-late"]) == [bytes(page)]
    store.close()
    return out


def _driver(out: Path) -> None:
    from ucm_patch.hooks.stores.mooncake import MooncakeStore

    results: dict[str, Any] = {"interfaces": _only_loopback(), "cases": {}, "scenarios": {}}

    def save() -> None:
        out.write_text(json.dumps(results, indent=1, default=lambda o: repr(o)[:200]))

    save()
    if results["interfaces"] != ["lo"]:
        raise SystemExit("driver must run inside scripts/mooncake_netns.sh (private netns)")
    master = os.environ["MOONCAKE_MASTER"]
    port = int(master.rsplit(":", 1)[1])
    log_dir = os.environ["MOONCAKE_LOG_DIR"]

    def make() -> MooncakeStore:  # the storage node owns the memory; 1 MiB staging buffers
        return MooncakeStore(
            master=master, global_segment_bytes=0, staging_bytes=1 << 20, staging_buffers=2
        )

    harness = Harness(make=make, tamper=tamper_mooncake)
    for name, case in CASES.items():
        started = time.monotonic()
        try:
            case(harness)
            entry: dict[str, Any] = {"ok": True}
        except BaseException:  # reported per case
            entry = {"ok": False, "error": traceback.format_exc()[-3000:]}
        entry["seconds"] = round(time.monotonic() - started, 2)
        results["cases"][name] = entry
        save()

    sc = results["scenarios"]
    sc["zero_copy"] = _zero_copy(make())
    save()
    sc["unreachable"] = _bounded(
        lambda: MooncakeStore(master="127.0.0.1:1", global_segment_bytes=0), 120
    )
    save()

    # A private master whose only memory is this client's 32 MiB segment.
    _start_master(port + 10, log_dir)
    small = MooncakeStore(
        master=f"127.0.0.1:{port + 10}", global_segment_bytes=32 << 20, staging_bytes=64 << 20
    )
    values = [(f"full-{i}", os.urandom(1 << 20)) for i in range(48)]
    flags = small.put_many(values)
    got = small.get_many([k for k, _ in values])
    sc["full"] = {
        "stored": sum(flags),
        "skipped": flags.count(False),
        "skipped_full_stat": small.stats["skipped_full"],
        "wrong_values": sum(
            g is not None and g != v for (_, v), g in zip(values, got, strict=True)
        ),
        "skipped_but_readable": sum(
            g is not None and not f for f, g in zip(flags, got, strict=True)
        ),
        "readable": sum(g is not None for g in got),
    }
    save()

    # Another private master, killed under a connected client: every call must fail, bounded.
    doomed = _start_master(port + 20, log_dir)
    victim = MooncakeStore(master=f"127.0.0.1:{port + 20}", global_segment_bytes=16 << 20)
    assert victim.put_many([("before-kill", b"x" * 1000)]) == [True]
    assert victim.get_many(["before-kill"]) == [b"x" * 1000]
    doomed.send_signal(signal.SIGKILL)
    doomed.wait()
    sc["killed_put"] = _bounded(lambda: victim.put_many([("after-kill", b"y" * 1000)]), 120)
    save()
    sc["killed_get"] = _bounded(lambda: victim.get_many(["before-kill", "nope"]), 120)
    save()
    sc["killed_exists"] = _bounded(lambda: victim.exists_many(["before-kill"]), 120)
    sc["killed_errors_stat"] = victim.stats["errors"]
    save()

    # A storage node dies under a client; the master forgets it; a new node takes over.
    mport = port + 30
    _start_master(mport, log_dir)
    node = _start_node(mport, mport + 2, log_dir)
    client = MooncakeStore(
        master=f"127.0.0.1:{mport}", global_segment_bytes=0, staging_bytes=4 << 20, quarantine_s=2
    )
    kept = [(f"node-{i}", os.urandom(100_000)) for i in range(4)]
    assert client.put_many(kept) == [True] * 4
    node.send_signal(signal.SIGKILL)
    node.wait()
    first = _bounded(lambda: client.get_many(["node-1"]), 120)
    second = _bounded(lambda: client.get_many(["node-2"]), 120)
    third = _bounded(lambda: client.get_many(["node-3"]), 120)
    sc["node_killed"] = {"first": first, "second": second, "third": third}
    save()
    sc["node_killed"]["forgotten"] = _poll(
        lambda: client.get_many(["node-1"]), lambda got: got == [None], 60
    )
    save()
    _start_node(mport, mport + 3, log_dir)
    sc["node_killed"]["new_node_put"] = _poll(
        lambda: client.put_many([("after-new-node", b"z" * 5000)]), lambda r: r == [True], 30
    )
    sc["node_killed"]["new_node_get"] = client.get_many(["after-new-node"]) == [b"z" * 5000]
    sc["node_killed"]["quarantined"] = client.stats["quarantined"]
    save()


# ==== tests: run by pytest outside the namespace ==========================================


@pytest.fixture(scope="module")
def netns_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("mooncake") / "results.json"
    cmd = [str(NETNS), "--node", "256MB", "--", sys.executable, __file__, "--driver", str(out)]
    env = {**os.environ, "MOONCAKE_BIN_DIR": str(Path(sys.executable).parent)}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        output, _ = proc.communicate(timeout=DRIVER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script, master, node and driver
        output, _ = proc.communicate()
        output += f"\n[killed after {DRIVER_TIMEOUT_S}s]"
    results = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, output, results


#: A line of Mooncake's own log (glog: severity, date, time).
_GLOG_LINE = re.compile(r"^\s*[IWEF]\d{4} \d\d:\d\d:\d\d")


def _why(run: tuple[int, str, dict[str, Any]]) -> str:
    """The driver's own lines (its traceback, when it raised) and the output's tail. Why
    apart: the netns script ends with the tails of the master's and the node's logs,
    which alone filled the last 40 lines when the driver failed once in CI."""
    rc, output, _ = run
    lines = [line for line in output.splitlines() if "Master Admin Metrics" not in line]
    own = [line for line in lines if not _GLOG_LINE.match(line) and not line.startswith("----")]
    return (
        f"driver rc={rc}; the driver's own lines, last 40:\n" + "\n".join(own[-40:])
        + "\noutput tail:\n" + "\n".join(lines[-20:])
    )  # fmt: skip


def test_driver_ran_cleanly_in_private_netns(netns_run: tuple[int, str, dict[str, Any]]) -> None:
    rc, _, results = netns_run
    assert rc == 0, _why(netns_run)
    assert results["interfaces"] == ["lo"], results["interfaces"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_contract(case: str, netns_run: tuple[int, str, dict[str, Any]]) -> None:
    entry = netns_run[2].get("cases", {}).get(case)
    assert entry is not None, f"case {case!r} never reported. " + _why(netns_run)
    assert entry["ok"], entry.get("error")


def _scenario(run: tuple[int, str, dict[str, Any]], name: str) -> Any:
    found = run[2].get("scenarios", {}).get(name)
    assert found is not None, f"scenario {name!r} never reported. " + _why(run)
    return found


def test_puts_from_registered_memory_are_zero_copy(
    netns_run: tuple[int, str, dict[str, Any]],
) -> None:
    zc = netns_run[2].get("scenarios", {}).get("zero_copy")
    assert zc is not None, _why(netns_run)
    assert zc["registered"] and zc["flags"] == [True] * 5
    assert zc["zero_copy_puts"] == 4  # the four region slices; the bytes value was staged
    assert zc["same"] and zc["tampered"]
    assert zc["after_unregister"] and zc["late_same"]
    assert zc["zero_copy_after_unregister"] == 4


def test_unreachable_master_fails_setup_fast(netns_run: tuple[int, str, dict[str, Any]]) -> None:
    r = _scenario(netns_run, "unreachable")
    assert not r.get("hung"), r
    assert r.get("raised") == "StoreError", r
    assert "setup failed" in r["message"] and "127.0.0.1:1" in r["message"], r
    assert r["seconds"] < SETUP_BOUND_S, r


def test_full_store_skips_without_raising(netns_run: tuple[int, str, dict[str, Any]]) -> None:
    r = _scenario(netns_run, "full")
    assert r["skipped"] > 0 and r["stored"] > 0, r  # 48 MiB offered to a 32 MiB segment
    assert r["skipped_full_stat"] == r["skipped"], r
    assert r["wrong_values"] == 0 and r["skipped_but_readable"] == 0, r
    assert r["readable"] > 0, r


def test_storage_node_death_fails_then_recovers(
    netns_run: tuple[int, str, dict[str, Any]],
) -> None:
    """Transfers to a dead node raise StoreError (their buffers quarantined, then reused);
    once the master drops the node, reads are misses; a new node makes puts work again."""
    r = _scenario(netns_run, "node_killed")
    first, second, third = r["first"], r["second"], r["third"]
    assert first.get("raised") == "StoreError" and "TRANSFER_FAIL" in first["message"], r
    assert second.get("raised") == "StoreError" and "TRANSFER_FAIL" in second["message"], r
    assert third.get("raised") == "StoreError" and "quarantined" in third["message"], r
    assert all(x["seconds"] < OP_BOUND_S for x in (first, second, third)), r
    assert r["quarantined"] >= 2, r
    assert r["forgotten"].get("ok"), r
    assert r["new_node_put"].get("ok") and r["new_node_get"] is True, r


@pytest.mark.parametrize("op", ["killed_put", "killed_get", "killed_exists"])
def test_killed_master_raises_within_bound(
    op: str, netns_run: tuple[int, str, dict[str, Any]]
) -> None:
    r = _scenario(netns_run, op)
    assert not r.get("hung"), f"{op} hung: {r}"
    assert r.get("raised") == "StoreError", r
    assert r["seconds"] < OP_BOUND_S, r
    assert _scenario(netns_run, "killed_errors_stat") == 3


def test_mooncake_is_imported_only_when_configured(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from ucm_patch.hooks.stores import make_store\n"
        f"make_store({{'local_path': {str(tmp_path)!r}}})\n"
        "assert 'mooncake' not in sys.modules, 'mooncake imported eagerly'\n"
        "from ucm_patch.hooks.stores import mooncake\n"
        "assert 'mooncake' not in sys.modules, 'importing the module must not import mooncake'\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_mooncake_config_defaults_and_values() -> None:
    kind, c = parse_store_config({"store": "mooncake"})
    assert kind == "mooncake"
    assert c["mooncake_master"] == "127.0.0.1:50051"
    assert (c["mooncake_protocol"], c["mooncake_metadata_server"]) == ("tcp", "P2PHANDSHAKE")
    kind, c = parse_store_config(
        {"store": "mooncake", "mooncake_master": "[::1]:6000", "mooncake_staging_bytes": "8MiB"}
    )
    assert c["mooncake_master"] == "[::1]:6000" and c["mooncake_staging_bytes"] == 8 << 20


if __name__ == "__main__" and sys.argv[1:2] == ["--driver"]:
    status = 0
    try:
        _driver(Path(sys.argv[2]))
    except BaseException:  # reported through the exit status and the output tail
        traceback.print_exc()
        status = 1
    finally:
        for child in _children:
            child.kill()
            child.wait()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # skip native destructors: a client of the killed master may block in them
