"""engine.input_processor: the fast encoder gives the tokenizer's own ids, or is not used."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine.input_processor import InputProcessor, fast_encoder


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_tokenizer)


def texts(tokenizer: Any) -> list[str]:
    rng = random.Random(0)
    decoded = [
        tokenizer.decode([rng.randrange(tokenizer.vocab_size) for _ in range(n)]) for n in (5, 512)
    ]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return ["a", "  two  spaces", "tab\tand\nnewline", "ünïcödé ✓ 日本語", chat, *decoded]


def test_fast_encoder_equals_tokenizer(tokenizer: Any) -> None:
    encode = fast_encoder(tokenizer)
    assert encode is not None  # the default model's tokenizer has a Rust backend
    for text in texts(tokenizer):
        assert encode(text) == list(tokenizer(text).input_ids), text[:40]


def test_input_processor_uses_it(tokenizer: Any) -> None:
    ip = InputProcessor(tokenizer, tokenizer.vocab_size, 4096)
    assert ip.encode.__name__ == "encode"
    text = texts(tokenizer)[-1]
    assert ip.tokenize(text) == list(tokenizer(text).input_ids)


class Disagrees:
    """A tokenizer whose `__call__` adds a token its Rust backend does not (a Python-side BOS)."""

    def __init__(self, inner: Any) -> None:
        self._tokenizer = inner._tokenizer
        self.inner = inner

    def __call__(self, text: str) -> Any:
        out = self.inner(text)
        out["input_ids"] = [1, *out["input_ids"]]
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_disagreeing_backend_is_not_used(tokenizer: Any) -> None:
    wrapped = Disagrees(tokenizer)
    assert fast_encoder(wrapped) is None
    ip = InputProcessor(wrapped, tokenizer.vocab_size, 4096)
    assert ip.tokenize("Hello")[0] == 1


def test_no_rust_backend(tokenizer: Any) -> None:
    class Plain:
        def __call__(self, text: str) -> Any:
            return tokenizer(text)

    assert fast_encoder(Plain()) is None


def test_token_ids_must_be_integers() -> None:
    """A float or bool token id was truncated (2.7 -> 2, True -> 1) and the request served."""
    import numpy as np

    proc = InputProcessor(None, 100, 64)
    assert proc.tokenize([1, np.int64(2), np.int32(3)]) == [1, 2, 3]
    for bad in ([1, 2.7], [True, 2], [1, "2"]):
        with pytest.raises(ValueError, match="token ids must be integers"):
            proc.tokenize(bad)
