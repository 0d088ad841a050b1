"""A request as the scheduler sees it: token ids, slot ids and counters. No tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.mem_cache.radix_cache import TreeNode
    from engine.sampling_params import SamplingParams


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # queued, or retracted back to the queue
    PREFILL = "prefill"  # admitted; its input is being computed chunk by chunk
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    """One generation request.

    NOTE: `kv_slots[i]` holds the KV of token `all_ids[i]`; the first `len(prefix)` of them
    belong to the radix tree (pinned through `last_node`'s lock), the rest to this request.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order, for fcfs and retraction choice
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    req_pool_idx: int = -1
    kv_slots: list[int] = field(default_factory=list)
    last_node: TreeNode | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_retractions: int = 0
    prefill_skips: int = 0  # prefill steps in a row that left this request out (not decoding)
    finish_reason: str | None = None
    # Set by the scheduler when choosing the waiting order (longest prefix match policy).
    match_len_hint: int = 0
    # NOTE: the last `num_pending` output ids are placeholders (negative) for tokens that a
    # launched step is still sampling on the device; `Scheduler.resolve_tokens` replaces them
    # in order. Placeholder -(k + 1) is the k-th sampled row of the latest launched step.
    num_pending: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_computed(self) -> int:
        """Tokens whose KV is in the pool."""
        return len(self.kv_slots)

    @property
    def fill_len(self) -> int:
        """Tokens that must be in the KV cache before the next token can be sampled: the prompt
        and every output token but the last (whose KV is written by the next decode step)."""
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)

    @property
    def finished(self) -> bool:
        return self.status == ReqStatus.FINISHED

    @property
    def num_known_outputs(self) -> int:
        """Output tokens whose values are known on the host (placeholders excluded)."""
        return len(self.output_ids) - self.num_pending

    def reaches_length_limit(self, num_outputs: int, max_context_len: int) -> bool:
        """Whether a request with `num_outputs` output tokens must stop (max_tokens, or the
        context is full); the engine's stop check and the scheduler's look-ahead share it."""
        return (
            num_outputs >= self.params.max_tokens
            or len(self.prompt_ids) + num_outputs >= max_context_len
        )
