"""Continuous batching with chunked prefill, prefix-aware admission and retraction. No tensors.

Each `schedule()` returns one batch: a prefill batch (chunks of waiting or partly prefilled
requests, up to `chunked_prefill_size` tokens) when there is prefill work that fits, otherwise a
decode batch of every running request. New requests therefore join between decode steps. Three
rules keep one long prompt from stalling everyone else: while requests are decoding, a prefill
step is always followed by a decode step, and it takes only as many tokens as fit in about the
time of a decode step, or PREFILL_STALL_S if that is longer (from the step times the engine
reports, `record_step`, fit as a fixed cost plus a cost per token: step_cost.py); and in a
prefill step, requests whose whole remaining input fits go before the chunks of longer ones.
A waiting request whose next uncached tokens a request of the same prefill step computes (the
sequences of an n > 1 request, a burst of prompts behind one new system prompt) waits a step and
then takes them from the radix cache. When a decode step cannot get a slot for every running
request, even after evicting unlocked prefixes from the radix cache, the most recently admitted
requests are retracted: their computed tokens go into the radix tree (unlocked, so they can be
evicted and recomputed later) and they return to the front of the queue, keeping their output so
far.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.mem_cache.allocator import TokenSlotAllocator
from engine.mem_cache.radix_cache import MatchResult, RadixCache
from engine.scheduler.batch import BatchEntry, ForwardMode, ScheduledBatch
from engine.scheduler.request import Req, ReqStatus
from engine.scheduler.step_cost import PrefillCost

LPM_MAX_QUEUE = 128  # above this many waiting requests, lpm sorting costs more than it saves
MIN_PREFILL_TOKENS = 32  # a prefill step beside decoding requests takes at least this many
# A partly prefilled or waiting request left out of this many prefill steps in a row goes first
# in the next: prompts that fit the budget go ahead of longer ones, but not for ever.
PREFILL_MAX_SKIPS = 8
# A prefill step may always take this long, however short the decode steps: a pause this short
# in a stream goes unnoticed, and on a GPU it keeps prefill chunks whole (a 2,048-token chunk of
# a 16B MoE model takes tens of ms there), so prefill throughput does not suffer. On a CPU a
# chunk takes seconds, and the budget below shrinks it to about one decode step's time.
PREFILL_STALL_S = 0.1
STEP_TIME_EMA = 0.5  # weight of the newest step in the step-time averages
# A waiting request whose next uncached tokens (this many, or a page if longer) are what a
# request in the same prefill step computes at the same positions waits for the next step and
# takes them from the radix cache instead of computing them again: the sequences of an n > 1
# request, or a burst of prompts behind one uncached system prompt (SGLang's in-batch prefix
# check).
IN_BATCH_PREFIX_TOKENS = 32


@dataclass
class ScheduleOutput:
    """The batch to run, the requests in it (same order), and which rows need a sampled token."""

    batch: ScheduledBatch
    reqs: list[Req]
    sample_rows: list[int]


@dataclass
class SchedulerCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cache_hit_tokens: int = 0
    cache_queried_tokens: int = 0
    computed_prefill_tokens: int = 0  # prefill tokens actually run through the model
    retractions: int = 0


class Scheduler:
    def __init__(
        self, config: EngineConfig, max_total_tokens: int, max_context_len: int, max_running: int
    ) -> None:
        self.config = config
        self.max_context_len = max_context_len
        self.max_running = max_running
        self.allocator = TokenSlotAllocator(max_total_tokens, config.page_size)
        self.tree = RadixCache(self.allocator, config.page_size, disable=config.disable_radix_cache)
        self.free_rows = list(range(max_running - 1, -1, -1))
        self.waiting: list[Req] = []
        self.prefilling: list[Req] = []  # admitted, input not fully computed yet
        self.running: list[Req] = []  # decoding
        self.counters = SchedulerCounters()
        self._arrival = itertools.count()
        self._row_dirty: set[str] = set()  # rids whose req_to_token row must be rewritten
        self._last_mode: ForwardMode | None = None
        self._decode_step_s: float | None = None  # average seconds of a decode step
        self._prefill_cost = PrefillCost()  # seconds of a prefill step against its tokens

    # ---- queue -------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        limit = min(self.max_context_len, self.allocator.size)
        if len(req.prompt_ids) == 0:
            raise ValueError("the prompt is empty")
        if len(req.prompt_ids) >= limit:
            raise ValueError(
                f"prompt has {len(req.prompt_ids)} tokens; the context limit is {limit} tokens "
                "(prompt plus at least one generated token)"
            )
        req.arrival = next(self._arrival)
        self.waiting.append(req)
        self.counters.prompt_tokens += len(req.prompt_ids)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.running)

    # ---- scheduling --------------------------------------------------------------------------
    def schedule(self) -> ScheduleOutput | None:
        out = None
        if self.running and self._last_mode == ForwardMode.EXTEND:
            out = self._schedule_decode()  # decoders get a step after every prefill step
        if out is None:
            out = self._schedule_prefill()
        if out is None and self.running:
            out = self._schedule_decode()
        if out is None and self.prefilling:
            # Only partly prefilled requests hold memory and none can proceed: push back all but
            # the oldest, whose input always fits once the others' slots are evictable.
            # (Newest first: each goes to the queue's front, so the older ones lead it.)
            for req in sorted(self.prefilling, key=lambda r: r.arrival, reverse=True)[:-1]:
                self.retract(req)
            out = self._schedule_prefill()
        self._last_mode = None if out is None else out.batch.mode
        return out

    def record_step(self, out: ScheduleOutput, seconds: float) -> None:
        """How long the batch of `out` took to run (the engine reports it after each step)."""
        if out.batch.mode == ForwardMode.DECODE:
            self._decode_step_s = _ema(self._decode_step_s, seconds)
        elif out.batch.num_tokens:
            self._prefill_cost.add(out.batch.num_tokens, seconds)

    def prefill_budget(self) -> int:
        """Prefill tokens for the next prefill step: `chunked_prefill_size`, but while requests
        are decoding only what runs in about the time of one decode step (or PREFILL_STALL_S,
        if longer), so a running request's next token waits about that long for prefill work."""
        budget = self.config.chunked_prefill_size
        if self.running and self._decode_step_s and self._prefill_cost.seen:
            limit = max(self._decode_step_s, PREFILL_STALL_S)
            floor = min(MIN_PREFILL_TOKENS, budget)  # (a smaller chunked_prefill_size holds)
            budget = self._prefill_cost.budget(limit, budget, floor)
        return budget

    def prefill_cost_fit(self) -> tuple[float, float] | None:
        """The (fixed seconds, seconds per token) line the budget uses, None before two sizes."""
        return self._prefill_cost.fit()

    def _can_admit(self) -> bool:
        return bool(self.free_rows) and self.num_running < self.max_running

    def _waiting_order(self) -> list[Req]:
        """The waiting requests in the policy's order (none while no request can be admitted:
        matching every queued prompt against the cache costs host time on every step)."""
        if not self._can_admit():
            return []
        if self.config.schedule_policy == "lpm" and len(self.waiting) <= LPM_MAX_QUEUE:
            for req in self.waiting:
                req.match_len_hint = len(self.tree.match_prefix(req.all_ids).slots)
            # Stable sort: equal matches keep arrival order; retracted requests sit in front.
            return sorted(self.waiting, key=lambda r: -r.match_len_hint)
        return list(self.waiting)

    def _schedule_prefill(self) -> ScheduleOutput | None:
        budget = self.prefill_budget()
        entries: list[BatchEntry] = []
        reqs: list[Req] = []
        sample_rows: list[int] = []
        candidates = list(self.prefilling) + self._waiting_order()
        # Requests that finish their input in this step first (in the policy's order), then
        # the chunks of longer ones: a short prompt never waits behind a long prompt's chunks.
        starved = [r for r in candidates if r.prefill_skips >= PREFILL_MAX_SKIPS]
        rest = [r for r in candidates if r.prefill_skips < PREFILL_MAX_SKIPS]
        queue = list(self.waiting)  # arrival order (retracted requests in front)
        fits = [r for r in rest if _to_compute(r) <= budget]
        candidates = starved + fits + [r for r in rest if _to_compute(r) > budget]
        admission_open = True
        for req in candidates:
            if budget <= 0:
                break
            admitted_now = req.status == ReqStatus.WAITING
            if admitted_now and admission_open and self._can_admit():
                match = self.tree.match_prefix(req.all_ids[: req.fill_len - 1])
                if self._computed_in_batch(req, len(match.slots), entries, reqs):
                    continue  # the next step finds these tokens in the cache
                self._admit(req, match)
            elif admitted_now:
                admission_open = False  # no row free: admitted requests may still go on
                continue
            prefix_len = req.num_computed
            n = min(req.fill_len - prefix_len, budget)
            # Keep room for every decoding request's next step; retraction handles the rest if
            # they grow past what is left.
            got = self._alloc([(req, n)], reserve=self._decode_reserve())
            if got is None:
                if not admitted_now:
                    break
                # Admit nobody else, but let the admitted requests go on: their next chunk may
                # need no new page (the last one has room), and with nothing decoding nothing
                # else would ever free memory for this one.
                self._unadmit(req)
                admission_open = False
                continue
            slots = got[0]
            rewrite = admitted_now or req.rid in self._row_dirty
            self._row_dirty.discard(req.rid)
            entries.append(
                BatchEntry(
                    req.req_pool_idx,
                    req.all_ids[prefix_len : prefix_len + n],
                    prefix_len,
                    slots,
                    prefix_slots=list(req.kv_slots) if rewrite else None,
                )
            )
            req.kv_slots += slots
            if prefix_len + n == req.fill_len and not req.output_ids:
                sample_rows.append(len(reqs))
            reqs.append(req)
            budget -= n
            self.counters.computed_prefill_tokens += n
        for req in self.prefilling:
            req.prefill_skips = 0 if req in reqs else req.prefill_skips + 1
        # A waiting request counts the steps in which one queued behind it was admitted: under
        # load every request waits, but only being overtaken can go on for ever. (One
        # unadmitted above keeps its count.)
        overtaken = max(
            (i for i, r in enumerate(queue) if r.status != ReqStatus.WAITING), default=0
        )
        for req in queue[:overtaken]:
            if req.status == ReqStatus.WAITING:
                req.prefill_skips += 1
        if not entries:
            return None
        return ScheduleOutput(ScheduledBatch(ForwardMode.EXTEND, entries), reqs, sample_rows)

    def _admit(self, req: Req, match: MatchResult) -> None:
        """Give a waiting request a req_to_token row and its cached prefix (`match`, of its
        input but the last token: at least one token is always computed, so that the last
        input token yields logits), locked."""
        self.tree.inc_lock_ref(match.last_node)
        req.last_node = match.last_node
        req.kv_slots = list(match.slots)
        req.req_pool_idx = self.free_rows.pop()
        req.status = ReqStatus.PREFILL
        if req.num_retractions == 0:
            req.cached_tokens = len(match.slots)
            self.counters.cache_hit_tokens += len(match.slots)
            self.counters.cache_queried_tokens += len(req.prompt_ids)
        self.waiting.remove(req)
        self.prefilling.append(req)

    def _computed_in_batch(
        self, req: Req, cached: int, entries: list[BatchEntry], reqs: list[Req]
    ) -> bool:
        """Whether a request of this prefill step (`entries` of `reqs`) computes the next
        IN_BATCH_PREFIX_TOKENS (or a page) of `req`'s input after its `cached` tokens, with the
        same tokens before them (from within the page where `cached` ends: a match ends at a
        whole page)."""
        if self.tree.disable:
            return False
        page = self.config.page_size
        want = max(IN_BATCH_PREFIX_TOKENS, page)
        if req.fill_len - 1 - cached < want:
            return False
        ids = req.all_ids
        for e, other in zip(entries, reqs, strict=True):
            start = max(cached, e.prefix_len)
            at = start - e.prefix_len
            if start - cached < page and at + want <= len(e.input_ids):
                if e.input_ids[at : at + want] == ids[start : start + want]:
                    # (the head last: only a request the window matched pays for it)
                    if other.all_ids[:start] == ids[:start]:
                        return True
        return False

    def _unadmit(self, req: Req) -> None:
        assert req.last_node is not None
        self.tree.dec_lock_ref(req.last_node)
        if req.num_retractions == 0:
            self.counters.cache_hit_tokens -= req.cached_tokens
            self.counters.cache_queried_tokens -= len(req.prompt_ids)
        self._release_row(req)
        req.status = ReqStatus.WAITING
        req.kv_slots, req.last_node = [], None  # (the prefix is matched again at admission)
        self.prefilling.remove(req)
        self.waiting.insert(0, req)

    def _schedule_decode(self) -> ScheduleOutput | None:
        # NOTE: with the overlap schedule a request's last output id may be a placeholder for a
        # token still being sampled. If that token reaches the length limit, the engine finishes
        # the request when it processes the token, so it gets no further step.
        decoding = [
            r
            for r in self.running
            if not r.reaches_length_limit(len(r.output_ids), self.max_context_len)
        ]
        if not decoding:
            return None
        got = self._alloc([(req, 1) for req in decoding], reserve=0)
        while got is None:
            # Retract the newest admitted request, but keep at least one decoding.
            victims = self.prefilling + (decoding if len(decoding) > 1 else [])
            if not victims and len(decoding) < len(self.running):
                # Requests whose last token is in the step in flight (overlap schedule) hold
                # slots they free once it is processed: decode next step, not fail now.
                return None
            if not victims:
                raise RuntimeError("the KV pool cannot hold one request; raise max_total_tokens")
            victim = max(victims, key=lambda r: r.arrival)
            self.retract(victim)
            if victim in decoding:
                decoding.remove(victim)
            got = self._alloc([(req, 1) for req in decoding], reserve=0)
        entries = []
        for req, (slot,) in zip(decoding, got, strict=True):
            rewrite = req.rid in self._row_dirty
            self._row_dirty.discard(req.rid)
            entries.append(
                BatchEntry(
                    req.req_pool_idx,
                    [req.output_ids[-1]],  # a placeholder when its value is still on the device
                    req.num_computed,
                    [slot],
                    prefix_slots=list(req.kv_slots) if rewrite else None,
                )
            )
            req.kv_slots.append(slot)
        return ScheduleOutput(
            ScheduledBatch(ForwardMode.DECODE, entries), decoding, list(range(len(decoding)))
        )

    def _pages_needed(self, req: Req, n: int) -> int:
        """New pages for the request's next n tokens (its last page may have room)."""
        p, have = self.allocator.page_size, len(req.kv_slots)
        return -(-(have + n) // p) - -(-have // p)

    def _decode_reserve(self) -> int:
        """Slots the decoding requests' next step needs (a page each for those whose last
        page is full)."""
        return sum(self._pages_needed(r, 1) for r in self.running) * self.allocator.page_size

    def _alloc(self, wants: list[tuple[Req, int]], reserve: int) -> list[list[int]] | None:
        """Slots for the next n tokens of each (request, n), evicting unlocked cached prefixes
        if needed; None if they cannot be had while leaving `reserve` slots obtainable.

        Token i of a request lives in slot first_slot(page i // p) + i % p: a token that starts
        a page gets a new page, the others the slot after the previous token's.
        """
        p = self.allocator.page_size
        pages = [self._pages_needed(req, n) for req, n in wants]
        need = sum(pages) * p + reserve
        short = need - self.allocator.available_size()
        if short > self.tree.evictable_size():
            return None  # (evicting would not be enough: the cached prefixes stay)
        if short > 0:
            self.tree.evict(short)
        out = []
        for (req, n), k in zip(wants, pages, strict=True):
            firsts = iter(self.allocator.alloc_pages(k) or [])
            last = req.kv_slots[-1] if req.kv_slots else -1
            slots = []
            for i in range(len(req.kv_slots), len(req.kv_slots) + n):
                last = next(firsts) if i % p == 0 else last + 1
                slots.append(last)
            out.append(slots)
        return out

    # ---- after the forward -------------------------------------------------------------------
    # A batch's results are recorded in two parts, so that the engine can schedule the next
    # batch before this one's sampled tokens reach the host (the overlap schedule):
    # `on_batch_launched` right after the batch is queued on the device, `resolve_tokens` once
    # its token ids are known. `process_batch` does both, for callers that wait for the ids.
    def on_batch_launched(self, out: ScheduleOutput) -> None:
        """The batch of `out` is queued on the device: record what does not depend on the
        values it samples. Finished prefill chunks are shared through the radix tree (a request
        that matches them runs in a later batch, after their KV is written), requests whose
        input is complete start decoding, and each sampled request gets a placeholder output id
        (-(k + 1) for the k-th sampled row) until `resolve_tokens` replaces it."""
        if out.batch.mode == ForwardMode.EXTEND:
            for req in out.reqs:
                self._cache_progress(req)
                if req.num_computed == req.fill_len:
                    self.prefilling.remove(req)
                    self.running.append(req)
                    req.status = ReqStatus.DECODE
        for k, row in enumerate(out.sample_rows):
            req = out.reqs[row]
            req.output_ids.append(-(k + 1))
            req.num_pending += 1

    def resolve_tokens(self, out: ScheduleOutput, next_ids: dict[int, int]) -> list[Req]:
        """Replace the placeholders of `out`'s sampled rows with their tokens (`next_ids` maps
        each sampled row to its token). Returns the requests that received a token, in row
        order; requests finished since the launch (their placeholders dropped) are skipped."""
        got_token: list[Req] = []
        for k, row in enumerate(out.sample_rows):
            req = out.reqs[row]
            if req.finished:
                continue
            i = len(req.output_ids) - req.num_pending  # placeholders resolve in launch order
            assert req.output_ids[i] == -(k + 1), f"{req.rid}: output {i} is not row {row}'s"
            req.output_ids[i] = next_ids[row]
            req.num_pending -= 1
            self.counters.generation_tokens += 1
            got_token.append(req)
        return got_token

    def process_batch(self, out: ScheduleOutput, next_ids: dict[int, int]) -> list[Req]:
        """Record a finished forward: `on_batch_launched`, then `resolve_tokens`."""
        self.on_batch_launched(out)
        return self.resolve_tokens(out, next_ids)

    def _cache_progress(self, req: Req) -> None:
        """Share what a prefill chunk computed through the radix tree."""
        assert req.last_node is not None
        computed = req.all_ids[: req.num_computed]
        match = self.tree.cache_unfinished(computed, req.kv_slots, req.last_node)
        if not self.tree.disable:
            if match.slots != req.kv_slots[: len(match.slots)]:
                self._row_dirty.add(req.rid)  # another request had cached these tokens first
            req.kv_slots = match.slots + req.kv_slots[len(match.slots) :]
            req.last_node = match.last_node

    def finish(self, req: Req, reason: str, keep_kv: bool = True) -> None:
        """End a request (stop, length or abort): cache its KV, release its row and lock.

        `keep_kv=False` after a failed forward: the last batch's KV was never written, so the
        request's own slots are freed instead of entering the prefix cache."""
        if req.finished:
            return
        if req.num_pending:  # the tokens of launched steps that it no longer takes
            del req.output_ids[-req.num_pending :]
            req.num_pending = 0
        if req.status == ReqStatus.WAITING:
            self.waiting.remove(req)
        else:
            self._release(req, keep_kv)
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason

    def drop_prefix_cache(self) -> None:
        """Free everything the radix tree holds (no request may be running). After a failed
        step: a prefill chunk enters the tree when its step is launched, so the tree may hold
        KV that the failed step never wrote."""
        self.tree.reset()

    def retract(self, req: Req) -> None:
        """Preempt an admitted request back to the front of the queue, keeping its output."""
        self._release(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.counters.retractions += 1
        self.waiting.insert(0, req)

    def _release(self, req: Req, keep_kv: bool = True) -> None:
        """Hand an admitted request's computed KV to the tree (unlocked), or free the slots it
        owns when `keep_kv` is False; free its row."""
        if keep_kv:
            # NOTE: a request finished while a launched decode step extends it holds one slot
            # past fill_len: that step writes the KV of its last output token, which the tree
            # does not get (as without overlap); cache_finished frees it with the tail.
            computed = req.all_ids[: min(req.num_computed, req.fill_len)]
            self.tree.cache_finished(computed, req.kv_slots, req.last_node)
        else:
            assert req.last_node is not None
            self.allocator.free(req.kv_slots[self._tree_owned(req) :])
            self.tree.dec_lock_ref(req.last_node)
        self._release_row(req)
        (self.running if req.status == ReqStatus.DECODE else self.prefilling).remove(req)
        req.kv_slots = []
        req.last_node = None
        self._row_dirty.discard(req.rid)

    def _release_row(self, req: Req) -> None:
        self.free_rows.append(req.req_pool_idx)
        req.req_pool_idx = -1

    # ---- checks and stats --------------------------------------------------------------------
    def active(self) -> Iterable[Req]:
        return itertools.chain(self.prefilling, self.running)

    def _tree_owned(self, req: Req) -> int:
        """How many of the request's leading slots belong to the tree (its locked prefix)."""
        owned, node = 0, req.last_node
        while node is not None and node is not self.tree.root:
            owned += len(node.key)
            node = node.parent
        return owned

    def in_use_slots(self) -> int:
        """Slots owned by requests, not by the tree (whole pages: a request's own slots start
        on a page boundary, after its page-aligned cached prefix)."""
        p = self.allocator.page_size
        return sum(-(-(len(r.kv_slots) - self._tree_owned(r)) // p) * p for r in self.active())

    def check_integrity(self) -> None:
        """free + cached + in use == total (raises AssertionError naming the numbers)."""
        self.allocator.check_integrity()
        self.tree.check_integrity(self.in_use_slots())

    def kv_usage(self) -> float:
        """Fraction of slots held by requests or locked prefixes (evictable cache counts free)."""
        free = self.allocator.available_size() + self.tree.evictable_size()
        return 1.0 - free / self.allocator.size


def _to_compute(req: Req) -> int:
    """The input tokens a request has left to prefill; for a waiting one, those past the cached
    prefix it matched when the queue was last ordered (`match_len_hint`, 0 without lpm)."""
    if req.status == ReqStatus.WAITING:
        return req.fill_len - min(req.match_len_hint, req.fill_len - 1)
    return req.fill_len - req.num_computed


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1.0 - STEP_TIME_EMA) * old + STEP_TIME_EMA * new
