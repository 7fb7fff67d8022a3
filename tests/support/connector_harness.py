"""Drive both sides of UCMPatchConnector in one process, without a vLLM engine.

Real vLLM objects where they matter (``KVCacheConfig``, specs, ``BlockPool``,
``MultiConnector``, the connector base classes, the dump scheduler, the stores); a small
stand-in config namespace for ``VllmConfig`` (building a real one needs a model), and
stand-in requests / scheduler outputs carrying exactly the fields the connector reads.

:class:`Harness.step` plays one engine step in vLLM 0.32's order: scheduler builds the
metadata, the worker handles preemptions, binds, starts loads, runs each layer (wait ->
"compute" -> save), ``wait_for_save``, ``get_transfer_results``, worker metadata, and the
scheduler consumes the worker output.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

from ucm_patch.hooks.stores.local import LocalStore

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
BS = 4
NUM_BLOCKS = 32
SPEC = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
PAGE = SPEC.page_size_bytes


def kv_cache_config(num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    """Two attention layers, layer-outermost in one allocation (vLLM 0.32 CPU shape)."""
    tensor = KVCacheTensor(
        size=len(LAYERS) * num_blocks * PAGE,
        layers=list(LAYERS),
        layer_stride=num_blocks * PAGE,
        block_stride=PAGE,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), SPEC)],
    )


def vllm_config(
    extra: dict[str, Any] | None = None,
    *,
    kv_role: str = "kv_both",
    model: str = "tiny",
    tp: int = 1,
    connector: str = "UCMPatchConnector",
    disable_hma: bool = False,
    block_size: int = BS,
) -> SimpleNamespace:
    """The parts of ``VllmConfig`` the connector (and MultiConnector) read."""
    return SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_role=kv_role,
            # one block per stored value unless a test asks for chunks: these tests name
            # blocks; tests/test_connector_chunks.py covers chunks of several blocks
            kv_connector_extra_config={"chunk_tokens": block_size, **(extra or {})},
        ),
        model_config=SimpleNamespace(model=model, dtype=torch.bfloat16),
        cache_config=SimpleNamespace(
            block_size=block_size, hash_block_size=block_size, cache_dtype="auto"
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp, pipeline_parallel_size=1, world_size=tp
        ),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=disable_hma),
    )


def block_hashes(tokens: Sequence[int], block_size: int = BS, salt: str = "") -> list[bytes]:
    """A prefix-chained content hash per full block (what vLLM's block hasher yields)."""
    out: list[bytes] = []
    prev = salt.encode()
    for i in range(len(tokens) // block_size):
        chunk = ",".join(map(str, tokens[i * block_size : (i + 1) * block_size])).encode()
        prev = hashlib.sha256(prev + b"|" + chunk).digest()
        out.append(prev)
    return out


class Req(SimpleNamespace):
    """The request fields the connector reads."""

    def __init__(
        self, rid: str, tokens: Sequence[int], salt: str = "", block_size: int = BS
    ) -> None:
        super().__init__(
            request_id=rid,
            block_hashes=block_hashes(tokens, block_size, salt=salt),
            num_tokens=len(tokens),
            tokens=list(tokens),
        )


def blocks(*groups: Sequence[int]) -> SimpleNamespace:
    """A stand-in ``KVCacheBlocks`` with ``get_block_ids()``."""
    ids = tuple(list(g) for g in groups)
    return SimpleNamespace(get_block_ids=lambda: ids)


def new_req(rid: str, block_ids: Sequence[Sequence[int]], num_computed: int) -> SimpleNamespace:
    return SimpleNamespace(
        req_id=rid, block_ids=tuple(list(b) for b in block_ids), num_computed_tokens=num_computed
    )


def sched_output(
    new: Iterable[SimpleNamespace] = (),
    cached: Iterable[tuple[str, int, Sequence[Sequence[int]] | None]] = (),
    scheduled: dict[str, int] | None = None,
    preempted: Iterable[str] = (),
    finished: Iterable[str] = (),
    spec_tokens: dict[str, list[int]] | None = None,
    block_state: Any = None,
) -> SimpleNamespace:
    """A stand-in ``SchedulerOutput``; ``cached`` rows are (req_id, computed, new_block_ids)."""
    cached = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            num_computed_tokens=[c[1] for c in cached],
            new_block_ids=[tuple(list(b) for b in c[2]) if c[2] else None for c in cached],
            resumed_req_ids=set(),
        ),
        num_scheduled_tokens=dict(scheduled or {}),
        preempted_req_ids=set(preempted),
        finished_req_ids=set(finished),
        scheduled_spec_decode_tokens=dict(spec_tokens or {}),
        kv_connector_block_state=block_state,
    )


class Harness:
    """A scheduler-side and a worker-side connector over one KV-cache tensor."""

    def __init__(
        self,
        cls: Any,
        extra: dict[str, Any] | None = None,
        *,
        kv_role: str = "kv_both",
        config: Any = None,
        kvcc: KVCacheConfig | None = None,
        layers: Sequence[str] = LAYERS,
    ) -> None:
        self.cfg = config or vllm_config(extra, kv_role=kv_role)
        self.kvcc = kvcc or kv_cache_config()
        self.layers = tuple(layers)
        self.sched = cls(self.cfg, KVConnectorRole.SCHEDULER, self.kvcc)
        self.worker = cls(self.cfg, KVConnectorRole.WORKER, self.kvcc)
        t0 = self.kvcc.kv_cache_tensors[0]
        self.page_bytes = min(t0.layer_stride, t0.block_stride)
        size = t0.size
        self.buf = torch.zeros(size, dtype=torch.int8)
        self.worker.register_kv_caches(dict.fromkeys(self.layers, self.buf))
        self.sent: list[set[str]] = []
        self.recved: list[set[str]] = []
        self.failed_recv: list[set[str]] = []

    # -- pages ----------------------------------------------------------------------------
    def _offset(self, layer: int, block: int) -> int:
        t = self.kvcc.kv_cache_tensors[0]
        return t.offset + layer * t.layer_stride + block * t.block_stride

    def page(self, layer: int, block: int) -> bytes:
        off = self._offset(layer, block)
        return self.buf[off : off + self.page_bytes].numpy().tobytes()

    def fill(self, layer: int, block: int, seed: int) -> bytes:
        gen = torch.Generator().manual_seed(seed)
        data = torch.randint(-128, 127, (self.page_bytes,), dtype=torch.int8, generator=gen)
        off = self._offset(layer, block)
        self.buf[off : off + self.page_bytes] = data
        return data.numpy().tobytes()

    # -- one engine step ------------------------------------------------------------------
    def step(
        self,
        so: SimpleNamespace,
        compute: Callable[[int], None] | None = None,
        finished: Iterable[str] = (),
    ) -> Any:
        md = self.sched.build_connector_meta(so)
        worker = self.worker
        worker.handle_preemptions(md)
        worker.bind_connector_metadata(md)
        worker.start_load_kv(None)
        for i, layer in enumerate(self.layers):
            worker.wait_for_layer_load(layer)
            if compute is not None:
                compute(i)
            worker.save_kv_layer(layer, None, None)
        worker.wait_for_save()
        self.collect(finished)
        worker.clear_connector_metadata()
        return md

    def collect(self, finished: Iterable[str] = ()) -> None:
        """get_transfer_results + worker metadata -> scheduler (what ends every step)."""
        res = self.worker.get_transfer_results(set(finished))
        self.sent.append(set(res.finished_sending))
        self.recved.append(set(res.finished_recving))
        self.failed_recv.append(set(res.failed_recving))
        meta = self.worker.build_connector_worker_meta()
        self.sched.update_connector_output(
            SimpleNamespace(kv_connector_worker_meta=meta, failed_recving=res.failed_recving)
        )

    def all_sent(self) -> list[str]:
        return [rid for s in self.sent for rid in sorted(s)]


# ======================================================================================
# The real local store, with the two controls the connector tests need
# ======================================================================================
class ControlledLocalStore(LocalStore):
    """vLLM's view of the connector's store is the real :class:`LocalStore` in a test
    directory; on top of it a test can hold puts (dumps "in flight") and remove or
    rewrite one value (an eviction, a value damaged between lookup and load).

    Removing goes through the store's own file and index, so a lookup afterwards sees
    exactly what it would after an eviction by another process."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, capacity_bytes=1 << 30)
        self._gate = threading.Event()
        self._gate.set()
        self._cv = threading.Condition()
        self.busy = 0  # puts currently inside put_many

    # -- holding puts ---------------------------------------------------------------
    def hold(self) -> None:
        """Block every put until :meth:`release`."""
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def wait_busy(self, n: int, timeout: float = 5.0) -> bool:
        """Wait until at least ``n`` puts are inside ``put_many``."""
        with self._cv:
            return self._cv.wait_for(lambda: self.busy >= n, timeout)

    def put_many(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]]) -> list[bool]:
        with self._cv:
            self.busy += 1
            self._cv.notify_all()
        try:
            self._gate.wait()
            return super().put_many(items)
        finally:
            with self._cv:
                self.busy -= 1
                self._cv.notify_all()

    # -- inspecting and changing values -----------------------------------------------
    def payload(self, key: str) -> bytes | None:
        """``key``'s value through the store's own read (frame checked)."""
        return self.get_many([key])[0]

    def remove(self, key: str) -> bytes:
        """Drop ``key``'s value (as an eviction would) and return its payload."""
        value = self.payload(key)
        if value is None:
            raise KeyError(f"remove: no value stored under key {key!r}")
        assert self.forget([key]) == 1, key
        return value

    def replace(self, key: str, payload: bytes) -> None:
        """Store ``payload`` under ``key`` with a valid frame, replacing any old value."""
        if self.payload(key) is not None:
            self.remove(key)
        assert self.put_many([(key, payload)]) == [True], key


@pytest.fixture(name="store")
def store_fixture(monkeypatch: Any, tmp_path: Path) -> Iterator[ControlledLocalStore]:
    """The real local store every UCMPatchConnector in the test uses (fixture ``store``;
    a test module imports ``store_fixture`` to get it)."""
    with local_store(monkeypatch, tmp_path / "store") as real:
        yield real


@contextmanager
def local_store(monkeypatch: Any, path: Path) -> Iterator[ControlledLocalStore]:
    """Every UCMPatchConnector built in this process uses one :class:`ControlledLocalStore`
    in ``path``; the process-wide state (store cache, dump scheduler, counters) is reset
    before and after, and held puts are released at the end."""
    from ucm_patch.connector import counters as connector_stats
    from ucm_patch.connector import kv_connector as connector
    from ucm_patch.hooks.dump import reset_scheduler

    store = ControlledLocalStore(path)
    monkeypatch.setattr(connector, "make_store", lambda _config, **_kw: store)
    connector._stores.clear()
    reset_scheduler()
    connector_stats.reset()
    try:
        yield store
    finally:
        store.release()
        connector._stores.clear()
        reset_scheduler()
        connector_stats.reset()
