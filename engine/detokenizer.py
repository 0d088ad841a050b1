"""Incremental, UTF-8 safe detokenization with stop strings.

Decoding one token at a time is wrong twice over: a byte-level BPE token can hold part of a
multi-byte UTF-8 character, and SentencePiece tokenizers drop the leading space of the first token
of a decode. The prefix-offset / read-offset scheme of vLLM and TGI fixes both: decode a short
window of recent tokens twice (with and without the newest tokens) and emit the difference, but
only once the window does not end in U+FFFD (a character still being assembled).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Any one of these in a checkpoint directory lets transformers build its tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
    "vocab.txt",
)
# How many prompt tokens of left context the first window gets (as SGLang / vLLM).
INITIAL_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas, one token at a time.

    Contract:
      - `add(token_id)` returns the new text (possibly ""); `flush()` at finish returns what was
        held back. While no stop string is hit, the concatenation of all deltas plus `flush()`
        equals `tokenizer.decode(output_ids, skip_special_tokens=...)` without its trailing
        U+FFFD characters, for tokenizers whose decode concatenates (byte-level BPE); for
        SentencePiece ones the prompt context additionally gives the first token its leading
        space.
      - A delta never ends inside a multi-byte character: text whose window ends in U+FFFD is
        held until the character completes. `flush()` drops a character left incomplete (the
        output was cut inside it, e.g. by max_tokens) instead of sending U+FFFD, as vLLM does.
      - Stop strings: once the output contains one, `stopped` is True, `stop_str` names it, the
        text is cut just before it (the stop string itself is never emitted) and every later
        `add` / `flush` returns "". A tail that could be the start of a stop string is held back
        and released when it turns out not to be one. With `min_tokens`, stop strings are looked
        for only once more tokens than that exist, in the text that came after (vLLM's rule).
      - `text` is everything emitted so far; `output_ids` every token added.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self.skip_special_tokens = skip_special_tokens
        self._rust = rust_decoder(tokenizer)
        self.stop: list[str] = [s for s in (stop or []) if s]
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # All ids (prompt + output); the window is ids[prefix_offset:], of which
        # ids[prefix_offset:read_offset] has already been turned into text.
        self._ids: list[int] = list(prompt_token_ids)
        self._num_prompt = len(prompt_token_ids)
        self._prefix_offset = max(len(self._ids) - INITIAL_CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        if self._read_offset > self._prefix_offset and self._decode(
            self._ids[self._prefix_offset : self._read_offset]
        ).endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character (ids given directly); its bytes would merge with
            # the output's, so decode the output on its own instead.
            self._prefix_offset = self._read_offset
        self._pending = ""  # decoded text not yet emitted (possible stop-string start)
        self._emitted: list[str] = []
        self.stopped = False
        self.stop_str: str | None = None

    @property
    def text(self) -> str:
        return "".join(self._emitted)

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._num_prompt :]

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text that became final with it."""
        self._ids.append(token_id)
        if self.stopped:
            return ""
        return self._release(self._decode_window(final=False), final=False)

    def flush(self) -> str:
        """At finish: return all held-back text, less a trailing incomplete character."""
        if self.stopped:
            return ""
        return self._release(self._decode_window(final=True), final=True)

    def _decode(self, ids: list[int]) -> str:
        if self._rust is not None:
            fast: str = self._rust.decode(ids, skip_special_tokens=self.skip_special_tokens)
            return fast
        text: str = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return text

    def _decode_window(self, final: bool) -> str:
        """New text of the window ids[prefix_offset:], or "" while it may be incomplete."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            # E.g. a skipped special token; nothing new, offsets stay so context is kept.
            return ""
        if new_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        delta = new_text[len(prefix_text) :]
        return delta.rstrip(REPLACEMENT_CHAR) if final else delta

    def _release(self, delta: str, final: bool) -> str:
        """Check stop strings on pending + delta and emit what can no longer start one."""
        pending = self._pending + delta
        if not self.stop or len(self.output_ids) <= self.min_tokens:
            self._pending = ""
            return self._emit(pending)
        # NOTE: a stop string cannot start inside already emitted text: we always hold back the
        # longest tail that is a prefix of some stop string, so searching `pending` is enough.
        hit: tuple[int, str] | None = None
        for s in self.stop:
            i = pending.find(s)
            if i != -1 and (hit is None or i < hit[0]):
                hit = (i, s)
        if hit is not None:
            self.stopped = True
            self.stop_str = hit[1]
            self._pending = ""
            return self._emit(pending[: hit[0]])
        hold = 0 if final else self._stop_prefix_len(pending)
        self._pending = pending[len(pending) - hold :]
        return self._emit(pending[: len(pending) - hold])

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for k in range(min(len(text), self._max_stop_len - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def _emit(self, s: str) -> str:
        if s:
            self._emitted.append(s)
        return s


def rust_decoder(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer, when its `decode` gives
    the same text as the transformers one (which adds only the optional clean-up of spaces, and
    Python overhead: 8 us against 3 us for a 7-token window; a detokenized token takes two
    decodes, which at 256 running requests was about 5 ms of host time per step). None
    otherwise: decode through transformers."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend


class NoDetokenizer:
    """What an engine without a tokenizer (`skip_tokenizer_init`) uses: outputs carry token ids
    and no text, and there are no stop strings."""

    stopped = False
    stop_str: str | None = None

    def add(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def check_tokenizer_files(model_dir: str | Path) -> None:
    """Raise ValueError when a checkpoint directory (with a config.json) has no tokenizer files,
    before transformers fails on it with a message about its own internals."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        return  # not a checkpoint directory: ModelConfig.from_pretrained says so
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"model directory {str(path)!r} has no tokenizer files (one of "
            f"{', '.join(TOKENIZER_FILES)}); copy the tokenizer the checkpoint was trained with "
            "into it (e.g. tokenizer.save_pretrained(dir))"
        )


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for: its longest vocabulary entry.

    Entries are written one character per byte (byte-level BPE) or per character
    (SentencePiece), so a text of n characters has at least n / max_token_chars tokens.
    """
    return max((len(token) for token in tokenizer.get_vocab()), default=1)
