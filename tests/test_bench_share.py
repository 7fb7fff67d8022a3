"""How the store benchmark turns rates into shares of memcpy (``bench_common.memcpy_share``).

A share is what the store targets of issue #27 are judged on, so its arithmetic is tested:
paired per round when the bench measured a memcpy right before each round, else against
the run's memcpy median.
"""

from __future__ import annotations

import pytest

from tests.support import load_script

bc = load_script("bench_common")


def test_paired_rounds_give_the_median_of_their_ratios() -> None:
    # the host slows down by half in round 2: store and memcpy both see it
    ops = {"put": [600.0, 300.0, 620.0], "memcpy_put": [1000.0, 500.0, 1000.0]}
    assert bc.memcpy_share(ops, "put", ceiling=2000.0) == pytest.approx(0.6)


def test_unpaired_rates_use_the_run_ceiling() -> None:
    ops = {"put": [300.0, 500.0, 400.0]}
    assert bc.memcpy_share(ops, "put", ceiling=1000.0) == pytest.approx(0.4)
    # a pairing list of another length is not a pairing
    ops["memcpy_put"] = [1000.0]
    assert bc.memcpy_share(ops, "put", ceiling=1000.0) == pytest.approx(0.4)


def test_missing_rates_or_ceiling_give_none() -> None:
    assert bc.memcpy_share({}, "put", ceiling=1000.0) is None
    assert bc.memcpy_share({"put": [1.0]}, "put", ceiling=None) is None


def _row(mib_s: float, slowest_ms: float = 1.0) -> dict:
    return {"stored": mib_s * (1 << 20), "wall_s": 1.0, "slowest_ms": slowest_ms,
            "slowest_cpu_ms": slowest_ms / 10}  # fmt: skip


def test_writers_vs_one_is_the_median_of_each_rounds_own_ratio() -> None:
    # the host's disk halves its speed in round 2: both phases of that round see it, and
    # a ratio of the rounds' medians (4 writers' 1000 against one's 1000) would hide that
    # the 4 writers lost to the one writer of their own round in two rounds of three
    rs = load_script("bench_render_stores")
    bs = load_script("bench_stores")
    one = [_row(1000.0), _row(500.0), _row(1200.0, slowest_ms=11.0)]
    four = [_row(900.0), _row(520.0), _row(1000.0)]
    d = {
        "with room": _row(2000.0),
        "host jitter": {"beside_disk_writes_ms": 5.0},
        "full, 1 process": bs._median_round(one),
        "full, 4 processes": bs._median_round(four),
        "together_vs_one": {"4": [f / o for f, o in zip(
            [900.0, 520.0, 1000.0], [1000.0, 500.0, 1200.0], strict=True)]},
    }  # fmt: skip
    rows = {r[0]: r for r in rs.full_store_targets(d, "1 MiB")}
    four_row = rows["full two-tier store, 4 processes at once vs one alone, 1 MiB"]
    assert four_row[2].startswith("90 % (median of 3 rounds: 90, 104, 83 %)")
    assert "missed" in four_row[3]
    # the median round's rate, the slowest call of any round
    assert bs._median_round(one)["stored"] == 1000.0 * (1 << 20)
    slowest = rows["full two-tier store, slowest put call, 1 MiB"]
    assert slowest[2].startswith("11.0 ms (on a CPU 1.1 ms of it;") and "missed" in slowest[3]


def _proxy_run(first_s: float, steady_s: list[float]) -> dict:
    passes = [{"wall_s": s, "cpu_s": 0.01, "waits": 0} for s in steady_s]
    return {"values": 900, "value_bytes": 1 << 20, "threads": 2, "floor_s": 0.05,
            "floor_samples": [0.05], "first": {"wall_s": first_s, "cpu_s": 0.01, "waits": 0},
            "alone": passes, "beside_python": passes}  # fmt: skip


def test_first_vs_steady_pairs_each_processs_first_pass_with_its_own_steady_ones() -> None:
    # three processes whose steady passes differ by 1.5x, each first pass 1.05x its own:
    # against the pooled steady median the median first pass read 1.26x (the slow
    # processes' firsts against the fast ones' steady passes)
    lp = load_script("bench_load_proxy")
    runs = [_proxy_run(0.042, [0.040] * 5), _proxy_run(0.063, [0.060] * 5),
            _proxy_run(0.0525, [0.050] * 5), _proxy_run(0.0525, [0.050] * 5),
            _proxy_run(0.063, [0.060] * 5)]  # fmt: skip
    merged = lp.merged(runs)
    assert merged["first_ratios"] == pytest.approx([1.05] * 5)
    assert lp.summarize(merged)["first_vs_steady"] == pytest.approx(1.05)
    pooled = merged["first"]["wall_s"] / 0.050
    assert pooled == pytest.approx(1.05)  # here the same; below it is not
    runs[2] = _proxy_run(0.063 * 1.2, [0.060] * 5)  # one slow process's first pass 1.26x
    merged = lp.merged(runs)
    assert lp.summarize(merged)["first_vs_steady"] == pytest.approx(1.05)
    rl = load_script("bench_render_load")
    rows = {r[0]: r for r in rl.load_proxy_targets({**merged, "summary": lp.summarize(merged)})}
    each = rows["load proxy, each process's first pass vs its own steady median"]
    assert each[2] == "1.05x, 1.05x, 1.05x, 1.05x, 1.26x"
    target = next(r for k, r in rows.items() if k.startswith("load proxy, first load"))
    assert "own ratios" in target[0] and target[2] == "1.05x" and target[3] == "met"


def test_a_dump_pass_ends_when_its_last_value_is_stored() -> None:
    """The dump proxy's pass ends as the last ``put_many`` returns (each stamped), not
    when a thread that waits for the dumps gets the GIL back; everything else of the
    store is the store's own."""
    import threading
    import time

    lp = load_script("bench_load_proxy")

    class Store:
        path = "here"

        def put_many(self, items: list[tuple[str, bytes]]) -> list[bool]:
            time.sleep(0.01 * len(items))
            return [True] * len(items)

    stamped = lp._Stamped(Store())
    assert stamped.path == "here" and stamped.last == 0.0
    started = time.perf_counter()
    threads = [threading.Thread(target=stamped.put_many, args=([("k", b"v")] * n,)) for n in (3, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    waited_on = time.perf_counter()
    time.sleep(0.02)  # the waiter's late wake is not in the pass
    assert started + 0.03 <= stamped.last <= waited_on


def test_the_proxies_read_every_page_of_the_memory_tier_once(tmp_path, monkeypatch) -> None:
    """Before a proxy's first pass, one byte of every page of every segment of the memory
    tier is read, the last segment first, and a segment that was never allocated is
    passed over (not created)."""
    import shutil

    from ucm_patch.hooks.stores.local import default_memory_path

    lp = load_script("bench_load_proxy")
    store = lp._store(tmp_path, 64 << 20, 1 << 20)  # keeps its memory tier at close
    try:
        _reads_every_page(lp, store, monkeypatch)
    finally:
        store.close()
        shutil.rmtree(default_memory_path(tmp_path / "disk"), ignore_errors=True)


def _reads_every_page(lp, store, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import mmap

    tier = store.memory
    assert tier is not None
    for seg in range(tier.count):  # allocated and mapped, as the warmer does where it runs
        tier.files.mapping(seg, 0, write=True)
    seen: list[tuple[int, int]] = []
    real = type(tier.files).mapping

    def mapping(self, seg: int, end: int, write: bool = False):  # type: ignore[no-untyped-def]
        assert not write, "a page reader must not create or write a segment"
        if seg == tier.count - 2:
            raise FileNotFoundError(seg)  # as a segment the warmer left unallocated
        view = real(self, seg, end, write)

        class Counted:
            def __getitem__(self, key: slice) -> memoryview:
                part = view[key]
                seen.append((seg, len(part)))
                return part

        return Counted()

    monkeypatch.setattr(type(tier.files), "mapping", mapping)
    assert lp._read_every_page(tier) >= 0.0
    pages = tier.segment_bytes // mmap.PAGESIZE
    expect = [(seg, pages) for seg in reversed(range(tier.count)) if seg != tier.count - 2]
    assert seen == expect


def test_a_ratio_that_misses_its_limit_never_reads_as_the_limit() -> None:
    """A ratio over its limit that two decimals would round onto it (1.254 against 1.25)
    gets a third decimal; every other ratio keeps two."""
    rl = load_script("bench_render_load")
    assert rl._times(1.254, 1.25) == "1.254x"
    assert rl._times(1.104, 1.1) == "1.104x"
    assert rl._times(1.25, 1.25) == "1.25x"  # met: at the limit
    assert rl._times(1.26, 1.25) == "1.26x"
    assert rl._times(1.03, 1.1) == "1.03x"
