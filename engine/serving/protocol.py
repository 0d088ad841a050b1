"""The `llm` model's request/response protocol, that of Triton's vllm_backend, without Triton.

`parse_request` turns a request's inputs into a prompt, SamplingParams and output options;
`Stream` follows one request's engine deltas and says what to send back (`Reply`). The model
(model_repository/llm/1/model.py) only converts: a getter over its `pb_utils` request in, `Reply`
outputs into `pb_utils` tensors out. See config.pbtxt for the inputs and outputs.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from engine.metrics import RequestTimer
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams, SamplingParamsError

RETURN_FLAGS = (
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_cumulative_logprob",
    "return_logprobs",
)

# Keys of a request's parameters that are not sampling settings: HTTP generate puts the body's
# other keys there, among them its request id and KServe's priority and timeout; Triton's own
# start with "triton_".
REQUEST_KEYS = ("id", "priority", "timeout")

# The logprob reported for a token of probability 0 (vLLM's OpenAI server's value).
LOGPROB_FLOOR = -9999.0

# name -> the first element of that input tensor (bytes, str, bool, numpy scalar), None if absent
InputGetter = Callable[[str], Any]


class BadRequest(ValueError):
    """The request is malformed; the message, which names the input, goes back to the client."""


@dataclass
class ParsedRequest:
    prompt: str
    params: SamplingParams
    stream: bool
    returns: dict[str, bool]
    prefix: str = ""  # text sent before the completion (the prompt, non-streaming vllm_backend)


def parse_request(
    get: InputGetter, parameters_json: str, chat_template: Callable[[str], str]
) -> ParsedRequest:
    """Parse one request; raise `BadRequest` naming the input when it is bad.

    `parameters_json` is the request's parameters object (HTTP generate puts extra body keys
    there; vllm_backend reads sampling settings from it when `sampling_parameters` is absent).
    `chat_template` wraps a user message in the model's chat template.
    """
    prompt = _text(get, "text_input")
    if prompt is None:
        raise BadRequest("missing required input 'text_input'")
    if not prompt:
        raise BadRequest("input 'text_input' is empty")
    stream = bool(_flag(get, "stream", False))
    exclude = _flag(get, "exclude_input_in_output", None)
    if stream and exclude is False:
        raise BadRequest(
            "exclude_input_in_output=false is not allowed with stream=true "
            "(a stream carries only new text)"
        )
    raw = _text(get, "sampling_parameters")
    try:
        if raw is None:
            extra = json.loads(parameters_json or "{}")
            params = SamplingParams.from_dict(
                {
                    k: v
                    for k, v in extra.items()
                    if k not in REQUEST_KEYS and not k.startswith("triton_")
                }
            )
        else:
            params = SamplingParams.from_json(raw)
    except ValueError as e:  # SamplingParamsError, or a parameters object it cannot read
        source = "input 'sampling_parameters'" if raw is not None else "request parameters"
        raise BadRequest(f"{source}: {e}") from None
    returns = {name: bool(_flag(get, name, False)) for name in RETURN_FLAGS}
    if returns["return_logprobs"] or returns["return_cumulative_logprob"]:
        params.logprobs = True
    if _flag(get, "apply_chat_template", False):
        prompt = chat_template(prompt)
    prefix = prompt if not stream and not exclude else ""  # vllm_backend's non-streaming default
    return ParsedRequest(prompt, params, stream, returns, prefix)


def _text(get: InputGetter, name: str) -> str | None:
    value = get(name)
    if value is None:
        return None
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        message = f"input '{name}' is not valid UTF-8 ({e.reason} at byte {e.start})"
        raise BadRequest(message) from None


def rejection(error: Exception) -> str:
    """The client's message for an error of `AsyncEngine.add_request`, naming the input."""
    if isinstance(error, SamplingParamsError):
        return f"input 'sampling_parameters': {error}"
    if isinstance(error, ValueError):  # the prompt: too long for the context, bad token ids
        return f"input 'text_input': {error}"
    return str(error)


def merge_deltas(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one: the new text, ids and logprobs of both,
    the totals and the ending of the later."""
    return replace(
        then,
        text=first.text + then.text,
        token_ids=first.token_ids + then.token_ids,
        logprobs=first.logprobs + then.logprobs,
        logprob_ranks=first.logprob_ranks + then.logprob_ranks,
        top_logprobs=first.top_logprobs + then.top_logprobs,
    )


def coalesce(events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The model's queued events with each request's deltas ("out", RequestOutput) gathered
    into one ("out", [RequestOutput, ...]: a merged delta per sequence, the request's final one
    last) at the place of its last: a response thread that fell behind then sends one response
    per request for everything it missed instead of one per step and sequence (a send costs
    about half a millisecond in the Python backend). Other events keep their order; a "stop"
    ends the list."""
    merged: list[tuple[str, Any] | None] = []
    groups: dict[str, dict[int, RequestOutput]] = {}  # request id -> a merged delta a sequence
    at: dict[str, int] = {}  # request id -> the place of its deltas in `merged`
    for kind, item in events:
        if kind == "out":
            rid = item.request_id
            if rid in at:
                merged[at[rid]] = None  # (moved to this place)
            deltas = groups.setdefault(rid, {})
            first = deltas.pop(item.index, None)  # (put back last: the latest sequence last)
            deltas[item.index] = item if first is None else merge_deltas(first, item)
            at[rid] = len(merged)
            merged.append((kind, rid))
            continue
        merged.append((kind, item))
        if kind == "stop":
            break
    return [
        (kind, list(groups[item].values()) if kind == "out" else item)
        for kind, item in (event for event in merged if event is not None)
    ]


# SentencePiece's word-start marker: a vocabulary piece's leading "▁" stands for a space.
SPACE_MARKER = "\u2581"


def token_decoder(tokenizer: Any) -> Callable[[int], str] | None:
    """A token id's text as `logprobs`' `decoded_token` gives it (the tokenizer's decoding of
    the id alone, cached), or None without a tokenizer.

    A SentencePiece tokenizer drops a lone piece's leading space when decoding it ("▁world"
    decodes as "world"); the spaces its piece stands for are put back, so that a token's text
    reads as it does inside a sentence (as vLLM reports it). Byte-level BPE pieces carry no
    such marker and decode with their spaces."""
    if tokenizer is None:
        return None
    piece_of = getattr(tokenizer, "convert_ids_to_tokens", None)

    @functools.lru_cache(maxsize=65536)
    def decode(token_id: int) -> str:
        text: str = tokenizer.decode([token_id])
        piece = piece_of(token_id) if piece_of is not None else None
        if not isinstance(piece, str):
            return text
        markers = len(piece) - len(piece.lstrip(SPACE_MARKER))
        missing = markers - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    return decode


def _flag(get: InputGetter, name: str, default: bool | None) -> bool | None:
    value = get(name)
    return default if value is None else bool(value)


# (output name, its values: one, or one a sequence, numpy dtype name)
Output = tuple[str, list[Any], str]


@dataclass
class Reply:
    """One response to send: outputs (None: the final flag alone), or an error."""

    outputs: list[Output] | None = None
    final: bool = False
    error: str | None = None


@dataclass
class _Sequence:
    """What a stream keeps of one of its request's `n` sequences."""

    texts: list[str] = field(default_factory=list)  # non-streaming: everything so far
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # every token's so far
    logprobs_sent: int = 0  # streaming: how many of them went out
    num_output_tokens: int = 0
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0


@dataclass
class Stream:
    """One in-flight request, fed its engine deltas in order by the model's response thread.

    Its outputs hold one value a sequence (`SamplingParams.n`, as vllm_backend sends them):
    streaming, a reply carries each sequence's new text of the deltas it answers (empty for
    the others); a sequence's finish reason is sent from its end on ("" before)."""

    request_id: str
    sender: Any  # the model's response sender; unused here
    req: ParsedRequest
    timer: RequestTimer = field(default_factory=RequestTimer)
    decode_token: Callable[[int], str] | None = None  # a token id's text; None: no tokenizer
    seqs: list[_Sequence] = field(default_factory=list)
    replied: bool = False  # a response (not the final one) was sent
    cancelled: bool = False  # the client went away; the engine is told to abort once added
    added: bool = False  # the engine has it (an abort before that would be ignored)

    def __post_init__(self) -> None:
        self.seqs = [_Sequence() for _ in range(self.req.params.n)]

    @property
    def unanswered(self) -> bool:
        """Nothing sent yet and not cancelled: Triton would not notice its HTTP client leave."""
        return not self.replied and not self.cancelled

    def on_deltas(self, outs: list[RequestOutput]) -> Reply | None:
        """What to send for these deltas of the request, in order (of its sequences, as
        `coalesce` groups them; only the last may finish the request), as one reply (None:
        nothing yet). A finished delta always replies."""
        stream, returns = self.req.stream, self.req.returns
        for out in outs:
            self._record(out)
        last = outs[-1]
        if not last.finished:
            if self.cancelled or not stream:
                return None
            if any(
                out.text
                or (out.token_ids and returns["return_num_output_tokens"])
                or out.finish_reason is not None  # one sequence of several ended
                for out in outs
            ):
                self.replied = True
                return Reply(self._delta_outputs(outs))
            return None
        if last.error:
            return Reply(final=True, error=last.error)
        if self.cancelled or (
            stream and not any(out.text for out in outs) and not any(returns.values())
        ):
            return Reply(final=True)  # nothing left to say; just close the stream
        if stream:
            return Reply(self._delta_outputs(outs), final=True)
        texts = [self.req.prefix + "".join(s.texts) for s in self.seqs]
        return Reply(self._outputs(last, texts, [s.num_output_tokens for s in self.seqs]), True)

    def _record(self, out: RequestOutput) -> None:
        """A delta's part of its sequence's totals (and, not streaming, of its text)."""
        seq = self.seqs[out.index]
        seq.cumulative_logprob = out.cumulative_logprob
        if out.finish_reason is not None:
            seq.finish_reason = out.finish_reason
        if not self.req.stream:
            seq.texts.append(out.text)
        if out.token_ids:
            self.timer.on_tokens(len(out.token_ids), index=out.index)
            seq.num_output_tokens += len(out.token_ids)
            if self.req.returns["return_logprobs"]:
                # NOTE: kept for every token, also those whose text is held back (part of a
                # character, or of what may be a stop string): the next reply carries them.
                seq.logprobs.extend(self._token_logprobs(out))

    def _delta_outputs(self, outs: list[RequestOutput]) -> list[Output]:
        """A streamed reply: the deltas' text and token counts for their sequences, none for
        the others."""
        texts = ["" for _ in self.seqs]
        counts = [0 for _ in self.seqs]
        for out in outs:
            texts[out.index] += out.text
            counts[out.index] += len(out.token_ids)
        return self._outputs(outs[-1], texts, counts)

    def _token_logprobs(self, out: RequestOutput) -> list[dict[str, Any]]:
        """vllm_backend's `logprobs` entries of the delta's tokens: per token, the chosen and
        the top tokens by id, each with its logprob, rank (1: most likely) and text."""
        entries: list[dict[str, Any]] = []
        tops = out.top_logprobs or [[] for _ in out.token_ids]
        for token, logprob, rank, top in zip(
            out.token_ids, out.logprobs, out.logprob_ranks, tops, strict=False
        ):
            ranked = [(t, p, r) for r, (t, p) in enumerate(top, start=1)] + [(token, logprob, rank)]
            entry: dict[str, Any] = {}
            for t, p, r in ranked:  # (the chosen last: its own rank wins over a tie's)
                # (-inf, a token the model rules out, is no JSON number: vLLM's floor instead)
                entry[str(t)] = {"logprob": max(p, LOGPROB_FLOOR), "rank": r}
                if self.decode_token is not None:
                    entry[str(t)]["decoded_token"] = self.decode_token(t)
            entries.append(entry)
        return entries

    def _outputs(self, out: RequestOutput, texts: list[str], counts: list[int]) -> list[Output]:
        returns = self.req.returns
        outputs: list[Output] = [("text_output", [t.encode() for t in texts], "object")]
        if returns["return_finish_reason"]:
            reasons = [s.finish_reason or "" for s in self.seqs]
            outputs.append(("finish_reason", reasons, "object"))
        if returns["return_num_input_tokens"]:
            outputs.append(("num_input_tokens", [out.num_prompt_tokens], "uint32"))
        if returns["return_num_output_tokens"]:
            outputs.append(("num_output_tokens", counts, "uint32"))
        if returns["return_cumulative_logprob"]:
            cumulative = [s.cumulative_logprob for s in self.seqs]
            outputs.append(("cumulative_logprob", cumulative, "float32"))
        if returns["return_logprobs"]:
            # Streaming: the tokens since the last reply; otherwise every token's.
            sent = []
            for s in self.seqs:
                chosen = s.logprobs[s.logprobs_sent :] if self.req.stream else s.logprobs
                s.logprobs_sent = len(s.logprobs)
                sent.append(json.dumps(chosen).encode())
            outputs.append(("logprobs", sent, "object"))
        return outputs
