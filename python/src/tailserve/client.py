"""A small client for tailserve's gRPC API (tailserve.v1.Generation, proto/.../generation.proto).

It keeps the protobuf details a caller should not need: text goes out as UTF-8 bytes (the API
declares it `bytes` so that the server, not the protobuf parser, judges the encoding), a parameter
left as None stays unset so the server's documented default applies, a stream becomes chunks or one
finished Completion, and a failed call becomes a TailserveError.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import grpc
from google.protobuf.message import Message

from tailserve.v1 import generation_pb2 as pb
from tailserve.v1 import generation_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50051"  # the server's default --host and --port

_M = TypeVar("_M", bound=Message)


class TailserveError(Exception):
    """A failed call. `code` is the gRPC status name ("INVALID_ARGUMENT", "UNAVAILABLE", ...);
    `message` is the server's, and for a bad request it names the offending field."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> TailserveError:
        # The RpcErrors a channel raises are also grpc.Call objects, which carry code and details.
        return cls(err.code().name, err.details() or "")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Timing:
    """Where the call's time went inside the server, in microseconds (the proto's Timing).

    preprocess: arrival to the engine's queue (validation, tokenization); queue: waiting for a
    slot and KV blocks; prefill_wait: behind the prompts ahead of it; prefill: its own chunks to
    the first token; decode: first token to last. Server TTFT = all but decode.
    """

    preprocess_us: int
    queue_us: int
    prefill_wait_us: int
    prefill_us: int
    decode_us: int


@dataclass(frozen=True)
class Chunk:
    """One streamed response.

    `text` may lag `token_ids` by a few characters: the server holds back text that could begin a
    stop string, and never splits a UTF-8 character. The last chunk carries the rest of the text
    and the finish fields, which are None on every other chunk.
    """

    text: str
    token_ids: list[int]
    request_id: str
    seed: int | None  # the seed the server used; first chunk only
    finish_reason: str | None  # "eos", "length", "stop_string", "stop_token" or "cancelled"
    matched_stop: str | None  # stop_string: the string; stop_token: the id in decimal
    usage: Usage | None
    timing: Timing | None  # last chunk of a stream that ends OK (None from an older server)


@dataclass(frozen=True)
class Completion:
    """A finished generation: the chunks of one stream put together."""

    text: str
    token_ids: list[int]
    finish_reason: str
    matched_stop: str | None
    usage: Usage
    seed: int
    request_id: str
    timing: Timing | None


class Client:
    """A connection to one tailserve server; close it, or use it as a context manager.

    `timeout` (seconds, None = none) is the deadline of every call; for stream() and generate() it
    covers the whole generation, not each token.
    """

    def __init__(self, target: str = DEFAULT_TARGET, timeout: float | None = None) -> None:
        self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._timeout = timeout

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def stream(
        self,
        prompt: str | bytes | Sequence[int],
        *,
        max_new_tokens: int | None = None,
        min_new_tokens: int | None = None,
        temperature: float | None = 0.0,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        add_special_tokens: bool | None = None,
        skip_special_tokens: bool | None = None,
        request_id: str | None = None,
    ) -> Iterator[Chunk]:
        """Generates from `prompt`, yielding a Chunk per server response.

        `prompt` is text (sent as UTF-8), bytes (sent as they are, for text already encoded) or
        token ids. `temperature` defaults to greedy (0.0) here; None leaves it, like every other
        parameter left None, to the server's default (proto/tailserve/v1/generation.proto documents
        them). `stop` is one string or several. Leaving the loop early cancels the request, so the
        server frees its KV blocks at once.
        """
        request = pb.GenerateRequest(
            request_id=request_id,
            sampling=_message(
                pb.SamplingParams, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty, seed=seed),
            stop=_message(
                pb.StopParams, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                stop_token_ids=stop_token_ids, ignore_eos=ignore_eos or None,
                stop_strings=_stop_strings(stop)),
            text=_message(pb.TextParams, add_special_tokens=add_special_tokens,
                          skip_special_tokens=skip_special_tokens),
            **_prompt(prompt))
        # Built before the generator so that a bad argument raises here, not at the first next().
        return self._chunks(request)

    def generate(
        self,
        prompt: str | bytes | Sequence[int],
        *,
        max_new_tokens: int | None = None,
        min_new_tokens: int | None = None,
        temperature: float | None = 0.0,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        add_special_tokens: bool | None = None,
        skip_special_tokens: bool | None = None,
        request_id: str | None = None,
    ) -> Completion:
        """Runs one generation to its end; the arguments are stream()'s."""
        chunks = list(self.stream(
            prompt, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, seed=seed, stop=stop,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
            add_special_tokens=add_special_tokens, skip_special_tokens=skip_special_tokens,
            request_id=request_id))
        first, last = chunks[0], chunks[-1]  # _chunks() ends with a finish_reason or raises
        assert first.seed is not None and last.finish_reason is not None and last.usage is not None
        return Completion(
            text="".join(c.text for c in chunks),
            token_ids=[t for c in chunks for t in c.token_ids],
            finish_reason=last.finish_reason, matched_stop=last.matched_stop, usage=last.usage,
            seed=first.seed, request_id=last.request_id, timing=last.timing)

    def tokenize(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """The server tokenizer's ids for `text` (None: the server's default, which adds BOS for
        Llama)."""
        request = pb.TokenizeRequest(
            text=text.encode("utf-8"),
            params=_message(pb.TextParams, add_special_tokens=add_special_tokens))
        return list(self._call(self._stub.Tokenize, request).token_ids)

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool | None = None) -> str:
        """The text of `ids` (None: the server's default, which leaves special tokens out)."""
        request = pb.TokenizeRequest(
            token_ids=pb.TokenIds(ids=ids),
            params=_message(pb.TextParams, skip_special_tokens=skip_special_tokens))
        return self._call(self._stub.Tokenize, request).text

    def model_info(self) -> dict[str, Any]:
        """GetModelInfo: the model and the limits a request must respect (ModelInfo's fields)."""
        return _as_dict(self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest()))

    def stats(self) -> dict[str, Any]:
        """GetStats: the server's and engine's counters (ServerStats' fields)."""
        return _as_dict(self._call(self._stub.GetStats, pb.GetStatsRequest()))

    def _call(self, method: Callable[..., _M], request: Message) -> _M:
        try:
            return method(request, timeout=self._timeout)
        except grpc.RpcError as err:
            raise TailserveError.from_rpc_error(err) from err

    def _chunks(self, request: pb.GenerateRequest) -> Iterator[Chunk]:
        call = self._stub.Generate(request, timeout=self._timeout)
        finished = False
        try:
            for i, response in enumerate(call):
                chunk = _chunk(response, first=i == 0)
                finished = chunk.finish_reason is not None
                yield chunk
        except grpc.RpcError as err:
            raise TailserveError.from_rpc_error(err) from err
        finally:
            # A consumer that left early ends the request now, not whenever the call object is
            # collected (grpc cancels then too); after the stream's end this is a no-op.
            call.cancel()
        if not finished:
            raise TailserveError("UNKNOWN", "the stream ended without a finish_reason")


def _prompt(prompt: str | bytes | Sequence[int]) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt_text": prompt.encode("utf-8")}
    if isinstance(prompt, bytes | bytearray):
        return {"prompt_text": bytes(prompt)}
    return {"prompt_token_ids": pb.TokenIds(ids=prompt)}


def _stop_strings(stop: str | Sequence[str] | None) -> list[bytes] | None:
    if stop is None:
        return None
    if isinstance(stop, str):  # one stop string, not one per character
        stop = [stop]
    return [s.encode("utf-8") for s in stop]


def _message(cls: type[_M], **fields: Any) -> _M | None:
    """`cls` holding the fields that are not None, or None when all are: an unset message or
    optional field is how the API says "use the server's default"."""
    present = {name: value for name, value in fields.items() if value is not None}
    return cls(**present) if present else None


def _chunk(response: pb.GenerateResponse, first: bool) -> Chunk:
    last = response.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    usage = response.usage
    return Chunk(
        text=response.text,
        token_ids=list(response.token_ids),
        request_id=response.request_id,
        seed=response.seed if first else None,
        finish_reason=_finish_reason(response.finish_reason) if last else None,
        matched_stop=response.matched_stop or None,
        usage=Usage(usage.prompt_tokens, usage.completion_tokens) if last else None,
        timing=_timing(response.timing) if response.HasField("timing") else None)


def _timing(t: pb.Timing) -> Timing:
    return Timing(t.preprocess_us, t.queue_us, t.prefill_wait_us, t.prefill_us, t.decode_us)


def _finish_reason(value: int) -> str:
    """FINISH_REASON_STOP_STRING -> "stop_string". Read from the enum, so a reason added to the
    proto needs no change here; a value newer than these stubs is given as its number."""
    try:
        name: str = pb.FinishReason.Name(value)
        return name.removeprefix("FINISH_REASON_").lower()
    except ValueError:
        return str(value)


def _as_dict(message: Message) -> dict[str, Any]:
    """Every field by its proto name, repeated ones as lists. Not json_format.MessageToDict: that
    renders 64-bit counters as strings."""
    fields: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        fields[field.name] = list(value) if field.is_repeated else value
    return fields
