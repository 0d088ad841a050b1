"""Offline, synchronous generation: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from numbers import Integral
from typing import Any

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Runs the same engine loop as `AsyncEngine`, driven from the caller's thread."""

    def __init__(self, model: str | None = None, **overrides: Any) -> None:
        values = dict(overrides)
        if model is not None:
            values["model"] = model
        self.config = EngineConfig.from_dict(values)
        self.core = EngineCore(self.config)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    def shutdown(self) -> None:
        """Release the engine's device memory and stop its tensor-parallel worker processes now
        (both also go when the LLM is collected or the process exits)."""
        self.core.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (text or token ids) at once; results in input order (a
        prompt whose params ask for `n` sequences gives n results in a row, by `index`)."""
        prompt_list: list[Prompt]
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], Integral)):
            prompt_list = [prompts]  # type: ignore[list-item]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"{len(prompt_list)} prompts but {len(param_list)} sampling params")
        # Validate everything before queuing anything.
        token_ids = [self.core.tokenize(p) for p in prompt_list]
        for p in param_list:
            self.core.check_params(p)
        results: dict[tuple[str, int], CompletionOutput] = {}  # by request id and index

        def collect(delta: RequestOutput) -> None:
            out = results[delta.request_id, delta.index]
            out.text += delta.text
            out.token_ids += delta.token_ids
            if out.logprobs is not None and out.logprob_ranks is not None:
                out.logprobs += delta.logprobs
                out.logprob_ranks += delta.logprob_ranks
            if out.top_logprobs is not None:
                out.top_logprobs += delta.top_logprobs
            out.cumulative_logprob = delta.cumulative_logprob
            out.cached_tokens = delta.cached_tokens
            if delta.finish_reason is not None or delta.finished:
                out.finish_reason = delta.finish_reason or "stop"

        try:
            # (inside: a request that cannot be added fails those added before it too)
            for ids, p in zip(token_ids, param_list, strict=True):
                rid = f"llm-{next(self._ids)}"
                for index in range(p.n):
                    results[rid, index] = CompletionOutput(
                        rid,
                        ids,
                        "",
                        [],
                        "",
                        logprobs=[] if p.logprobs else None,
                        logprob_ranks=[] if p.logprobs else None,
                        top_logprobs=[] if p.top_logprobs else None,
                        index=index,
                    )
                self.core.add_request(rid, ids, p, collect)
            while self.core.has_work():
                if not self.core.step():
                    raise RuntimeError("requests are queued but none can be scheduled")
        except BaseException as e:
            # NOTE: as the async engine does: after a failed step the scheduler records KV that
            # was never written, so a later call must neither run these requests nor cache it.
            self.core.fail_all(f"generate failed: {e!r}")
            raise
        return list(results.values())
