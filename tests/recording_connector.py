"""A KV connector for tests: records every worker-side call as a JSON line.

Loaded by vLLM through ``kv_connector_module_path="recording_connector"`` (``tests/`` on
``PYTHONPATH``). It transfers nothing. It implements ``SupportsHMA`` because vLLM refuses
a hybrid model (Qwen3-Next: GDN + attention) with a connector that does not (targets.md
gotcha 7). Each line is one call, in call order, written to ``$UCM_TEST_RECORD``.

For ``save_kv_layer`` it records what a real connector would need to trust the call: the
shapes and dtypes of what it received, and whether those are *the layer's own cache
tensors* (identity against ``forward_context.no_compile_layers[name].kv_cache``), plus the
KV-ready event a ``kv_ready_event`` patch attached to the metadata.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Any

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


class RecordingMetadata(KVConnectorMetadata):
    """Carries the scheduler step number to the worker."""

    def __init__(self, step: int) -> None:
        self.step = step


def _describe(kv: Any) -> dict[str, Any]:
    if isinstance(kv, (list, tuple)):
        return {"kind": "list", "items": [_describe(t) for t in kv]}
    return {"kind": "tensor", "shape": list(kv.shape), "dtype": str(kv.dtype)}


def _is_layer_cache(layer_name: str, kv: Any) -> bool:
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


class RecordingConnector(KVConnectorBase_V1, SupportsHMA):
    """Records calls; never loads or saves anything."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        if _HAS_KV_CACHE_CONFIG:
            super().__init__(vllm_config, role, kv_cache_config)
        else:  # pragma: no cover - vLLM <= 0.11
            super().__init__(vllm_config, role)
        self._path = os.environ["UCM_TEST_RECORD"]
        self._step = 0
        self._log("init", role=str(role))

    def _log(self, call: str, **fields: Any) -> None:
        with open(self._path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"call": call, "pid": os.getpid(), **fields}) + "\n")

    # -- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._log("register_kv_caches", layers=sorted(kv_caches))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._log("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._log("wait_for_layer_load", layer=layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        event = getattr(attn_metadata, "reshape_cache_event", None)
        self._log(
            "save_kv_layer",
            layer=layer_name,
            kv=_describe(kv_layer),
            is_layer_cache=_is_layer_cache(layer_name, kv_layer),
            metadata=type(attn_metadata).__name__,
            event=None if event is None else type(event).__name__,
            event_ready=None if event is None else bool(event.query()),
        )

    def wait_for_save(self) -> None:
        self._log("wait_for_save")

    # -- scheduler side --------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._step += 1
        return RecordingMetadata(self._step)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None
