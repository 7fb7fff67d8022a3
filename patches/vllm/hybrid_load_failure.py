"""``hybrid_load_failure``: a failed KV load of a hybrid model recomputes its request
instead of killing vLLM 0.22 - 0.29's engine core (the connector serves hybrid hits on 0.22
and from 0.26: states found by position to 0.28, offered from 0.29; 0.23 - 0.25 refuse
them at start).

Why: vLLM 0.22 - 0.29 learn of a failed KV-connector load only from the block ids the connector
reports (``get_block_ids_with_load_errors``; ``KVConnectorOutput`` has no
``failed_recving`` yet). ``Scheduler._update_requests_with_invalid_blocks`` then unpacks
one KV-cache group per request, ``(req_block_ids,) = kv_cache_manager.get_block_ids(...)``:
with a hybrid model (Qwen3-Next: GDN + attention, several groups) any reported block raises
``ValueError: too many values to unpack`` in ``update_from_output`` and the engine core
dies. Truncating to the first failed block would be wrong there too: a GDN / Mamba group
holds one state for the whole prefix, and the groups' block sizes differ.

How (vLLM 0.30's own multi-group path, backported): with more than one KV-cache group, a
request any of whose blocks failed (in any group; the shared null block never counts)
goes back to token 0, ``num_computed_tokens = 0``. For an async load (``WAITING_FOR_REMOTE_KVS``)
vLLM's ``_handle_invalid_blocks`` then marks it failed, ``_update_waiting_for_remote_kv``
frees its blocks, and the request is scheduled afresh: vLLM's own prefix cache gives it
back its local prefix, the rest is recomputed. That is what vLLM 0.30-0.32 do with a
request reported in ``failed_recving`` (``_handle_failed_recving``). Under
``kv_load_failure_policy="fail"`` vLLM finishes the request with an error instead, as it
does for one group; the engine serves on either way. With one KV-cache group (a dense
model) vLLM's own code runs, unchanged.
"""

from __future__ import annotations

from typing import Any

from ucm_patch.records import PatchRecord, records_from_rows
from ucm_patch.source_checks import arg_index, leading
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from ucm_patch.records import Wrapper

NAME = "hybrid_load_failure"
#: The patch set's one-line description (docs/PATCHES.md, ucm-patch status).
DESCRIPTION = "Recompute a hybrid request whose KV load failed instead of killing vLLM 0.22 - 0.29."

WHY = (
    "vLLM 0.22 - 0.29 hear of a failed KV-connector load only as invalid block ids, and "
    "Scheduler._update_requests_with_invalid_blocks unpacks one KV-cache group per request: "
    "on a hybrid model (GDN + attention, several groups) the first failed load raises "
    "ValueError in update_from_output and the engine core dies. With several groups the "
    "wrapper sends an affected request back to token 0 (vLLM 0.30's own path): its blocks "
    "are freed and it is scheduled afresh from vLLM's local prefix cache, as 0.30+ does "
    "for failed_recving; never a truncation that leaves a GDN state for another prefix. "
    "One group: vLLM's code, unchanged."
)
REMOVAL = (
    "Delete with vLLM 0.22 - 0.29 support: from 0.30 vLLM recomputes a multi-group request itself "
    "and takes failed_recving, which the connector reports there."
)
RETIRED = (
    "vLLM 0.30: _update_requests_with_invalid_blocks recomputes a multi-group request in "
    "full, and KVConnectorTransferResults.failed_recving / Scheduler._handle_failed_recving "
    "take a failed async load by request (what UCMPatchConnector reports from 0.30 on)."
)

#: ``Scheduler._update_requests_with_invalid_blocks``'s parameters (a ``leading`` check).
PARAMS = ("self", "requests", "invalid_block_ids", "num_scheduled_tokens", "evict_blocks")
_REQUESTS = arg_index(PARAMS, "requests")
_INVALID = arg_index(PARAMS, "invalid_block_ids")
_SCHEDULED = arg_index(PARAMS, "num_scheduled_tokens")
_EVICT = arg_index(PARAMS, "evict_blocks")


def recompute_whole_requests(
    kv_cache_manager: Any,
    requests: Iterable[Any],
    invalid_block_ids: set[int],
    num_scheduled_tokens: dict[str, int],
    evict_blocks: bool = True,
) -> tuple[set[str], int, set[int]]:
    """``_update_requests_with_invalid_blocks`` for several KV-cache groups: vLLM 0.30's.

    A request with a failed block in any group restarts from token 0. Returns what vLLM's
    method returns: (affected request ids, tokens to recompute, blocks to evict: every
    non-null block of an affected request when ``evict_blocks``).
    """
    null_block_id = kv_cache_manager.block_pool.null_block.block_id
    affected: set[str] = set()
    total_tokens = 0
    to_evict: set[int] = set()
    for request in requests:
        req_id = request.request_id
        per_group = kv_cache_manager.get_block_ids(req_id)
        if not any(b != null_block_id and b in invalid_block_ids for ids in per_group for b in ids):
            continue
        total_tokens += request.num_computed_tokens - num_scheduled_tokens.get(req_id, 0)
        request.num_computed_tokens = 0
        if evict_blocks:
            to_evict.update(b for ids in per_group for b in ids if b != null_block_id)
        affected.add(req_id)
    return affected, total_tokens, to_evict


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    """A call argument, positional (a trampoline passes them all) or by keyword; a
    missing ``evict_blocks`` is its default, True."""
    if len(args) > index:
        return args[index]
    return kwargs[name] if name in kwargs or name != "evict_blocks" else True


def make_invalid_blocks_wrapper() -> Wrapper:
    """``Scheduler._update_requests_with_invalid_blocks``: several groups -> the whole
    request is recomputed; one group -> vLLM's own method."""

    def invalid_blocks(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        config = getattr(instance, "kv_cache_config", None)
        if len(getattr(config, "kv_cache_groups", ())) <= 1:
            return wrapped(*args, **kwargs)
        return recompute_whole_requests(
            instance.kv_cache_manager,
            _arg(args, kwargs, _REQUESTS, "requests"),
            _arg(args, kwargs, _INVALID, "invalid_block_ids"),
            _arg(args, kwargs, _SCHEDULED, "num_scheduled_tokens"),
            _arg(args, kwargs, _EVICT, "evict_blocks"),
        )

    return invalid_blocks


RECORDS: tuple[PatchRecord, ...] = records_from_rows(
    NAME,
    "vllm",
    "era target requires upstream expect",
    (
        (
            "vllm-0.22",
            "vllm.v1.core.sched.scheduler:Scheduler._update_requests_with_invalid_blocks",
            ">=0.22,<0.30",
            "vLLM 0.22 - 0.29 (the connector serves hybrid hits on 0.22, with the "
            "hybrid_async_load patch, and from 0.26: states found by position to 0.28, "
            "offered from 0.29): v1/core/sched/scheduler.py "
            "_update_requests_with_invalid_blocks "
            "unpacks `(req_block_ids,) = self.kv_cache_manager.get_block_ids(req_id)` "
            '("TODO: add support for hybrid memory allocator"; vllm-project/vllm#50687), '
            "and KVConnectorOutput has no failed_recving. One BlockPool serves every group "
            "(kv_cache_coordinator.py), so a block id names one block. 0.30 recomputes a "
            "multi-group request in full there and adds failed_recving.",
            (leading(PARAMS),),
        ),
    ),
    make_wrapper=make_invalid_blocks_wrapper,
    why=WHY,
    removal=REMOVAL,
    retired=RETIRED,
)
