"""A request's checks before it is queued: the sampling settings this engine can honour, the
prompt's length, and its token ids. Shared by the engine itself and by `EngineProcess`, which
tokenizes in the caller's process and sends only token ids to the engine's process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.detokenizer import max_token_chars
from engine.sampling_params import SamplingParams, SamplingParamsError


@dataclass
class InputProcessor:
    tokenizer: Any  # None with skip_tokenizer_init: token ids only
    vocab_size: int
    max_context_len: int  # already capped at the KV pool's size
    max_tokens_cap: int | None = None

    def __post_init__(self) -> None:
        # A text longer than this cannot fit the context, whatever it tokenizes to.
        self.max_prompt_chars = 0  # no tokenizer: text prompts are refused by tokenize()
        if self.tokenizer is not None:
            self.max_prompt_chars = self.max_context_len * max_token_chars(self.tokenizer)

    def process(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids; raise before tokenizing where it can.

        SamplingParamsError when `max_tokens` is above `max_tokens_cap` (refused, as vLLM refuses
        a max_tokens beyond the context); ValueError for a prompt that cannot fit or settings
        the engine cannot honour.
        """
        cap = self.max_tokens_cap
        if cap is not None and params.max_tokens > cap:
            raise SamplingParamsError(
                f"max_tokens={params.max_tokens} is above this server's limit of {cap} "
                "(max_tokens_cap)"
            )
        limit = self.max_prompt_chars
        if isinstance(prompt, str) and limit and len(prompt) > limit:
            raise ValueError(
                f"prompt has {len(prompt)} characters; the context limit of "
                f"{self.max_context_len} tokens holds at most {limit}"
            )
        ids = self.tokenize(prompt)
        self.check_params(params)
        return ids

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (text is encoded as `tokenizer(text)` would), validated."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "the engine runs without a tokenizer (skip_tokenizer_init): send the prompt "
                    "as token ids"
                )
            ids = list(self.tokenizer(prompt).input_ids)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
                )
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_context_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the context limit is {self.max_context_len} "
                "tokens (prompt plus at least one generated token)"
            )
        return ids

    def check_params(self, params: SamplingParams) -> None:
        """Raise ValueError for settings this engine cannot honour (before anything is queued)."""
        if self.tokenizer is None and params.stop:
            raise ValueError(
                "stop strings need a tokenizer and the engine runs without one "
                "(skip_tokenizer_init): use stop_token_ids"
            )
