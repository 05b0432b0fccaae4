"""Unit tests of tailserve.Client against a fake Generation server in process (no tailserve binary).

The fake records each request exactly as it arrived on the wire and answers with what the test
scripted, so these tests check both directions: what the client sends (UTF-8 bytes, unset optional
fields left unset) and how it assembles streams, finish reasons and errors.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

import tailserve
from tailserve.v1 import generation_pb2 as pb
from tailserve.v1 import generation_pb2_grpc as pb_grpc


@dataclass
class FakeGeneration(pb_grpc.GenerationServicer):
    """Records requests; Generate yields `responses`, then aborts with `error` if one is set."""

    responses: list[pb.GenerateResponse] = field(default_factory=lambda: [pb.GenerateResponse(
        request_id="r1", token_ids=[5], text="hi", seed=7, finish_reason=pb.FINISH_REASON_LENGTH,
        usage=pb.Usage(prompt_tokens=3, completion_tokens=1))])
    error: tuple[grpc.StatusCode, str] | None = None
    hold_open: bool = False  # after the responses, wait (forever) until the call ends
    requests: list[pb.GenerateRequest | pb.TokenizeRequest] = field(default_factory=list)
    time_remaining: list[float | None] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)  # set when an RPC terminates

    def Generate(self, request: pb.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        self._record(request, context)
        context.add_callback(self.ended.set)
        yield from self.responses
        if self.hold_open:
            self.ended.wait()
            return
        if self.error is not None:
            context.abort(*self.error)

    def Tokenize(self, request: pb.TokenizeRequest,
                 context: grpc.ServicerContext) -> pb.TokenizeResponse:
        self._record(request, context)
        if self.error is not None:
            context.abort(*self.error)
        if request.WhichOneof("input") == "text":
            return pb.TokenizeResponse(token_ids=[1, 2, 3], count=3)
        return pb.TokenizeResponse(text="déjà vu", count=len(request.token_ids.ids))

    def GetModelInfo(self, request: pb.GetModelInfoRequest,
                     context: grpc.ServicerContext) -> pb.ModelInfo:
        return pb.ModelInfo(model="tiny", backend="cpu", vocab_size=311, eos_token_ids=[2, 9],
                            has_tokenizer=True, max_stop_strings=4)

    def GetStats(self, request: pb.GetStatsRequest,
                 context: grpc.ServicerContext) -> pb.ServerStats:
        return pb.ServerStats(steps=2**40, tokens_generated=5, draining=True)

    def _record(self, request: pb.GenerateRequest | pb.TokenizeRequest,
                context: grpc.ServicerContext) -> None:
        self.requests.append(request)
        self.time_remaining.append(context.time_remaining())


@dataclass
class Harness:
    fake: FakeGeneration
    target: str

    def client(self, timeout: float | None = None) -> tailserve.Client:
        return tailserve.Client(self.target, timeout=timeout)

    def last_request(self) -> pb.GenerateRequest:
        request = self.fake.requests[-1]
        assert isinstance(request, pb.GenerateRequest)
        return request


@pytest.fixture
def harness() -> Iterator[Harness]:
    fake = FakeGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield Harness(fake, f"127.0.0.1:{port}")
    finally:
        server.stop(grace=None)


def response(text: str = "", token_ids: tuple[int, ...] = (), **kwargs: Any) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id="r1", text=text, token_ids=token_ids, **kwargs)


def set_fields(message: pb.SamplingParams | pb.StopParams | pb.TextParams) -> dict[str, object]:
    """The fields present on the wire: an unset optional field is absent, even if its value is 0."""
    return {f.name: (list(v) if f.is_repeated else v) for f, v in message.ListFields()}


# --- what the client sends ---

def test_text_prompt_is_sent_as_utf8_bytes(harness: Harness) -> None:
    with harness.client() as client:
        client.generate("naïve 日本 🎉")
    request = harness.last_request()
    assert request.WhichOneof("prompt") == "prompt_text"
    assert request.prompt_text == b"na\xc3\xafve \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x8e\x89"


def test_bytes_prompt_is_sent_unchanged(harness: Harness) -> None:
    with harness.client() as client:
        client.generate(b"\xff\xfe not UTF-8")
    assert harness.last_request().prompt_text == b"\xff\xfe not UTF-8"


def test_token_prompt_is_sent_as_ids(harness: Harness) -> None:
    with harness.client() as client:
        client.generate([1, 15, 27])
    request = harness.last_request()
    assert request.WhichOneof("prompt") == "prompt_token_ids"
    assert list(request.prompt_token_ids.ids) == [1, 15, 27]


def test_defaults_send_greedy_and_leave_everything_else_unset(harness: Harness) -> None:
    with harness.client() as client:
        client.generate("x")
    request = harness.last_request()
    assert set_fields(request.sampling) == {"temperature": 0.0}
    assert not request.HasField("stop")
    assert not request.HasField("text")
    assert request.request_id == ""


def test_temperature_none_leaves_sampling_unset(harness: Harness) -> None:
    with harness.client() as client:
        client.generate("x", temperature=None)
    assert not harness.last_request().HasField("sampling")


def test_every_parameter_arrives_zero_values_included(harness: Harness) -> None:
    with harness.client() as client:
        client.generate("x", max_new_tokens=9, min_new_tokens=2, temperature=0.5, top_p=0.25,
                        top_k=0, min_p=0.0, repetition_penalty=1.5, presence_penalty=0.0,
                        frequency_penalty=-0.5, seed=0, stop=["a"], stop_token_ids=[7, 8],
                        ignore_eos=True, add_special_tokens=False, skip_special_tokens=False,
                        request_id="mine")
    request = harness.last_request()
    assert set_fields(request.sampling) == {
        "temperature": 0.5, "top_p": 0.25, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.5,
        "presence_penalty": 0.0, "frequency_penalty": -0.5, "seed": 0}
    assert set_fields(request.stop) == {
        "max_new_tokens": 9, "min_new_tokens": 2, "stop_token_ids": [7, 8], "ignore_eos": True,
        "stop_strings": [b"a"]}
    assert request.text.HasField("add_special_tokens") and not request.text.add_special_tokens
    assert request.text.HasField("skip_special_tokens") and not request.text.skip_special_tokens
    assert request.request_id == "mine"


def test_one_text_param_leaves_the_other_unset(harness: Harness) -> None:
    with harness.client() as client:
        client.generate("x", skip_special_tokens=True)
    assert set_fields(harness.last_request().text) == {"skip_special_tokens": True}


def test_stop_strings_are_sent_as_utf8_bytes(harness: Harness) -> None:
    with harness.client() as client:
        client.generate("x", stop=["\n\n", "über"])
        assert list(harness.last_request().stop.stop_strings) == [b"\n\n", b"\xc3\xbcber"]
        client.generate("x", stop="END")  # one string is one stop string
        assert list(harness.last_request().stop.stop_strings) == [b"END"]


def test_bad_prompt_raises_when_called_not_when_iterated(harness: Harness) -> None:
    with harness.client() as client, pytest.raises(TypeError):
        client.stream(3.5)  # type: ignore[arg-type]
    assert harness.fake.requests == []


def test_client_timeout_is_the_deadline(harness: Harness) -> None:
    with harness.client(timeout=30) as client:
        client.generate("x")
        client.tokenize("x")
    with harness.client() as client:
        client.generate("x")
    *bounded, unbounded = harness.fake.time_remaining
    # gRPC rounds a deadline up as it encodes it; "none" arrives as about 2**63 ns.
    assert len(bounded) == 2 and all(t is not None and 20 < t < 31 for t in bounded)
    assert unbounded is not None and unbounded > 1e9


# --- how the client assembles answers ---

def test_stream_yields_one_chunk_per_response(harness: Harness) -> None:
    harness.fake.responses = [
        response("In", (10, 11), seed=42),
        response(" the", (12,)),
        response(" end", (), finish_reason=pb.FINISH_REASON_STOP_STRING, matched_stop="!",
                 usage=pb.Usage(prompt_tokens=4, completion_tokens=3),
                 timing=pb.Timing(preprocess_us=5, queue_us=0, prefill_wait_us=30, prefill_us=900,
                                  decode_us=2000)),
    ]
    with harness.client() as client:
        chunks = list(client.stream("x", stop="!"))
    assert [c.text for c in chunks] == ["In", " the", " end"]
    assert [c.token_ids for c in chunks] == [[10, 11], [12], []]
    assert [c.seed for c in chunks] == [42, None, None]
    assert [c.finish_reason for c in chunks] == [None, None, "stop_string"]
    assert [c.matched_stop for c in chunks] == [None, None, "!"]
    assert [c.usage for c in chunks] == [None, None, tailserve.Usage(4, 3)]
    # A zero queue_us is a time, not "unset".
    assert [c.timing for c in chunks] == [None, None, tailserve.Timing(5, 0, 30, 900, 2000)]


def test_generate_puts_the_stream_together(harness: Harness) -> None:
    harness.fake.responses = [
        response("Hel", (1,), seed=0),  # seed 0 is a seed, not "unset"
        response("lo", (2, 3), finish_reason=pb.FINISH_REASON_STOP_TOKEN, matched_stop="3",
                 usage=pb.Usage(prompt_tokens=5, completion_tokens=3)),
    ]
    with harness.client() as client:
        result = client.generate("x", stop_token_ids=[3])
    assert result == tailserve.Completion(
        text="Hello", token_ids=[1, 2, 3], finish_reason="stop_token", matched_stop="3",
        usage=tailserve.Usage(5, 3), seed=0, request_id="r1", timing=None)


@pytest.mark.parametrize("value,name", [
    (pb.FINISH_REASON_EOS, "eos"), (pb.FINISH_REASON_STOP_TOKEN, "stop_token"),
    (pb.FINISH_REASON_LENGTH, "length"), (pb.FINISH_REASON_CANCELLED, "cancelled"),
    (pb.FINISH_REASON_STOP_STRING, "stop_string"), (99, "99")])
def test_finish_reason_names(harness: Harness, value: int, name: str) -> None:
    harness.fake.responses = [response("a", (1,), finish_reason=value)]
    with harness.client() as client:
        assert client.generate("x").finish_reason == name


def test_error_carries_code_and_the_servers_message(harness: Harness) -> None:
    harness.fake.responses = []
    harness.fake.error = (grpc.StatusCode.INVALID_ARGUMENT, "stop.stop_strings[0]: empty")
    with harness.client() as client, pytest.raises(tailserve.TailserveError) as caught:
        client.generate("x", stop=[""])
    assert caught.value.code == "INVALID_ARGUMENT"
    assert caught.value.message == "stop.stop_strings[0]: empty"
    assert str(caught.value) == "INVALID_ARGUMENT: stop.stop_strings[0]: empty"


def test_error_mid_stream_comes_after_the_chunks_sent(harness: Harness) -> None:
    harness.fake.responses = [response("partial", (1,), seed=1)]
    harness.fake.error = (grpc.StatusCode.UNAVAILABLE, "server draining")
    seen: list[str] = []
    with harness.client() as client, pytest.raises(tailserve.TailserveError) as caught:
        for chunk in client.stream("x"):
            seen.append(chunk.text)
    assert seen == ["partial"]
    assert caught.value.code == "UNAVAILABLE"


def test_stream_that_ends_without_finish_reason_is_an_error(harness: Harness) -> None:
    harness.fake.responses = [response("a", (1,))]
    with harness.client() as client, pytest.raises(tailserve.TailserveError, match="finish_reason"):
        client.generate("x")


def test_leaving_a_stream_early_cancels_the_call(harness: Harness) -> None:
    harness.fake.responses = [response("a", (1,), seed=1)]
    harness.fake.hold_open = True
    with harness.client() as client:  # inside: closing the channel would end the call too
        for _ in client.stream("x"):
            break
        assert harness.fake.ended.wait(timeout=30), "the call stayed open after the loop ended"


def test_tokenize_and_detokenize(harness: Harness) -> None:
    with harness.client() as client:
        assert client.tokenize("café") == [1, 2, 3]
        assert client.detokenize([4, 5], skip_special_tokens=False) == "déjà vu"
        client.tokenize("x", add_special_tokens=False)
    encode, decode, encode_plain = harness.fake.requests
    assert isinstance(encode, pb.TokenizeRequest) and isinstance(decode, pb.TokenizeRequest)
    assert encode.text == b"caf\xc3\xa9" and not encode.HasField("params")
    assert list(decode.token_ids.ids) == [4, 5]
    assert set_fields(decode.params) == {"skip_special_tokens": False}
    assert isinstance(encode_plain, pb.TokenizeRequest)
    assert set_fields(encode_plain.params) == {"add_special_tokens": False}


def test_unary_error_is_a_tailserve_error(harness: Harness) -> None:
    harness.fake.error = (grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer")
    with harness.client() as client, pytest.raises(tailserve.TailserveError) as caught:
        client.tokenize("x")
    assert (caught.value.code, caught.value.message) == (
        "FAILED_PRECONDITION", "this model has no tokenizer")


def test_model_info_and_stats_are_plain_dicts(harness: Harness) -> None:
    with harness.client() as client:
        info, stats = client.model_info(), client.stats()
    assert info["model"] == "tiny" and info["vocab_size"] == 311 and info["has_tokenizer"] is True
    assert info["eos_token_ids"] == [2, 9] and info["bos_token_ids"] == []
    assert stats["steps"] == 2**40 and stats["draining"] is True and stats["queued"] == 0
