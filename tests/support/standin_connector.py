"""The one stand-in KV connector the tests (and benchmarks) install as vLLM's active connector.

It transfers nothing. It is a real ``KVConnectorBase_V1`` (so the base's metadata methods,
``has_connector_metadata`` included, behave as on any connector) and implements
``SupportsHMA``, because vLLM refuses a hybrid model (Qwen3-Next: GDN + attention) with a
connector that does not.

What differs between its users is only where its calls go, so that is what is configured:

* built by vLLM (``kv_connector="StandInConnector"``, ``kv_connector_module_path=
  "tests.support.standin_connector"``, the repository root on ``PYTHONPATH``): every call is
  written as one JSON line to ``$UCM_TEST_RECORD`` (:class:`JsonLinesLog`);
* built by a test: the calls go to ``log`` (any object with ``append``; by default a new
  list, ``connector.log``) as tuples of what was received, identity kept:
  ``("wait", layer_name)``, ``("save", layer_name, kv_layer, attn_metadata)``,
  ``("notified", layer_name)``. The vLLM-Ascend scenarios pass a log that describes the
  objects. ``has_metadata`` says whether connector metadata is bound from the start (a step
  with metadata) or not (every per-layer hook must stay gated);
* ``record=False``: nothing is recorded (``connector.log`` is None) and the per-layer calls
  return at once, so a benchmark measures the hooks' own cost.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Any, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from vllm.forward_context import get_forward_context

try:  # vLLM >= 0.12
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - vLLM <= 0.11
    SupportsHMA = object  # type: ignore[assignment,misc]

_HAS_KV_CACHE_CONFIG = (
    "kv_cache_config" in inspect.signature(KVConnectorBase_V1.__init__).parameters
)

Entry = tuple[Any, ...]


class CallLog(Protocol):
    """Where the stand-in's calls go: ``append((call, *arguments))``."""

    def append(self, entry: Entry, /) -> None: ...


class StandInMetadata(KVConnectorMetadata):
    """Carries the scheduler step number to the worker."""

    def __init__(self, step: int) -> None:
        self.step = step


class StandInConnector(KVConnectorBase_V1, SupportsHMA):
    """Records calls (see the module docstring); never loads or saves anything."""

    def __init__(
        self,
        vllm_config: Any = None,
        role: Any = None,
        kv_cache_config: Any = None,
        *,
        log: CallLog | None = None,
        record: bool = True,
        has_metadata: bool = True,
    ) -> None:
        if vllm_config is None:
            # Built by a test: the base needs a VllmConfig; only its metadata slot is used.
            self._connector_metadata = StandInMetadata(0) if has_metadata else None
        else:
            # Built by vLLM, which binds and clears the metadata around each forward step.
            if _HAS_KV_CACHE_CONFIG:
                super().__init__(vllm_config, role, kv_cache_config)
            else:  # pragma: no cover - vLLM <= 0.11
                super().__init__(vllm_config, role)
        if not record:
            log = None
        elif log is None:
            log = [] if vllm_config is None else JsonLinesLog(os.environ["UCM_TEST_RECORD"])
        self.log: CallLog | None = log
        if vllm_config is not None and log is not None:
            log.append(("init", role))
        self._step = 0

    # -- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.log is not None:
            self.log.append(("register_kv_caches", kv_caches))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.log is not None:
            self.log.append(("start_load_kv",))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.log is not None:
            self.log.append(("wait", layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        # No **kwargs: vLLM and the hooks pass exactly these three, and a catch-all would
        # allocate a dict per call, cost the benchmarks would count as the hooks'.
        if self.log is not None:
            self.log.append(("save", layer_name, kv_layer, attn_metadata))

    def on_kv_cache_written(self, layer_name: str) -> None:
        """vLLM-Ascend >= 0.23 notifies a connector that has this method after a cache write."""
        if self.log is not None:
            self.log.append(("notified", layer_name))

    def wait_for_save(self) -> None:
        if self.log is not None:
            self.log.append(("wait_for_save",))

    # -- scheduler side --------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._step += 1
        return StandInMetadata(self._step)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None


def _describe(kv: Any) -> dict[str, Any]:
    if isinstance(kv, (list, tuple)):
        return {"kind": "list", "items": [_describe(t) for t in kv]}
    return {"kind": "tensor", "shape": list(kv.shape), "dtype": str(kv.dtype)}


def _is_layer_cache(layer_name: str, kv: Any) -> bool:
    """Whether ``kv`` is the layer's own cache (identity against its ``kv_cache``)."""
    layer = get_forward_context().no_compile_layers.get(layer_name)
    if layer is None:
        return False
    own = layer.kv_cache
    if isinstance(kv, (list, tuple)):
        return (
            isinstance(own, (list, tuple))
            and len(own) == len(kv)
            and all(a is b for a, b in zip(own, kv, strict=True))
        )
    return kv is own


def _save_fields(layer_name: str, kv_layer: Any, attn_metadata: Any) -> dict[str, Any]:
    event = getattr(attn_metadata, "reshape_cache_event", None)
    return {
        "layer": layer_name,
        "kv": _describe(kv_layer),
        "is_layer_cache": _is_layer_cache(layer_name, kv_layer),
        "metadata": type(attn_metadata).__name__,
        "event": None if event is None else type(event).__name__,
        "event_ready": None if event is None else bool(event.query()),
    }


class JsonLinesLog:
    """Writes each call as one JSON line to ``path``, in call order (vLLM runs in a child).

    For ``save_kv_layer`` it writes what a real connector would need to trust the call: the
    shapes and dtypes it received, whether those are the layer's own cache tensors, and the
    KV-ready event a ``kv_ready_event`` patch attached to the metadata.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def append(self, entry: Entry, /) -> None:
        call, *args = entry
        fields: dict[str, Any]
        if call == "init":
            fields = {"role": str(args[0])}
        elif call == "register_kv_caches":
            fields = {"layers": sorted(args[0])}
        elif call == "wait":
            call, fields = "wait_for_layer_load", {"layer": args[0]}
        elif call == "save":
            call, fields = "save_kv_layer", _save_fields(*args)
        else:
            fields = {}
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"call": call, "pid": os.getpid(), **fields}) + "\n")
