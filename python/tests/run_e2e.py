#!/usr/bin/env python3
"""End-to-end test of the tailserve Python client against a real `tailserve` server.

  TS_TAILSERVE_BIN=build/server/tailserve TS_MODEL_DIR=models/default python3 run_e2e.py

Starts `$TS_TAILSERVE_BIN --model_dir $TS_MODEL_DIR --backend cpu --port 0` (the model must have a
tokenizer), reads the bound address from its line `tailserve listening on HOST:PORT`, checks text
in and out through the client (and through the raw stub what the client would not send), runs the
first ```python block of python/README.md and of the top README.md, then stops the server with
SIGTERM and expects it to drain and exit 0. Without TS_TAILSERVE_BIN it skips (exit 77); with it, every failure fails.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

import tailserve
from tailserve.v1 import generation_pb2 as pb
from tailserve.v1 import generation_pb2_grpc as pb_grpc

SKIP = 77  # CTest's SKIP_RETURN_CODE
# The package's README and the repository's: each carries the example, and each must work as written.
READMES = [Path(__file__).resolve().parent.parent / "README.md",
           Path(__file__).resolve().parent.parent.parent / "README.md"]
PROMPT = "In the beginning"
NEW_TOKENS = 24
STARTUP_S = 300  # loading a model on the CPU; a bound, not a measurement
CALL_S = 120


class Server:
    """A tailserve child process whose output is collected, so a failure can show its log."""

    def __init__(self, binary: str, model_dir: str) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._closed = False
        # main.cc prints the address on stdout and its log on stderr: read both, in order.
        self.proc = subprocess.Popen(
            [binary, "--model_dir", model_dir, "--backend", "cpu", "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def address(self) -> str:
        """HOST:PORT from the listening line; fails when the server exits or stays silent."""
        pattern = re.compile(r"tailserve listening on (\S+)")
        with self._changed:
            def found() -> str | None:
                matches = (pattern.search(line) for line in self.lines)
                return next((m.group(1) for m in matches if m), None)
            if not self._changed.wait_for(lambda: found() is not None or self._closed, STARTUP_S):
                raise AssertionError(f"no 'tailserve listening on' line within {STARTUP_S} s")
            address = found()
        if address is None:
            raise AssertionError(f"the server exited ({self.proc.wait()}) before listening")
        return address

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=CALL_S)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def check_stream_text_is_the_text_of_its_ids(client: tailserve.Client) -> str:
    chunks = list(client.stream(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True))
    text = "".join(c.text for c in chunks)
    ids = [t for c in chunks for t in c.token_ids]
    last = chunks[-1]
    check(last.finish_reason == "length", f"finish_reason {last.finish_reason!r}, want 'length'")
    check(last.usage is not None and last.usage.completion_tokens == NEW_TOKENS == len(ids),
          f"{len(ids)} ids and usage {last.usage}, want {NEW_TOKENS}")
    check(last.usage is not None and last.usage.prompt_tokens == len(client.tokenize(PROMPT)),
          f"usage.prompt_tokens {last.usage} is not the length of tokenize({PROMPT!r})")
    check(last.timing is not None and last.timing.decode_us > 0
          and all(c.timing is None for c in chunks[:-1]),
          f"the server's Timing {last.timing} is not on the last chunk alone")
    check(text != "", f"{NEW_TOKENS} generated tokens {ids} gave no text")
    whole = client.detokenize(ids)
    check(text == whole, f"streamed deltas {text!r} != detokenize(all ids) {whole!r}")
    print(f"ok: {len(chunks)} chunks of {PROMPT!r} join to detokenize(ids): {text!r}")
    return text


def check_round_trip(client: tailserve.Client) -> None:
    for text in ["Hello, world!", "The quick brown fox\njumps over the lazy dog.", "naïve café"]:
        ids = client.tokenize(text)
        plain = client.tokenize(text, add_special_tokens=False)
        check(0 < len(plain) <= len(ids), f"tokenize({text!r}): {ids}, without specials {plain}")
        for which in (ids, plain):
            back = client.detokenize(which)
            check(back == text, f"detokenize(tokenize({text!r}) = {which}) = {back!r}")
    print("ok: detokenize(tokenize(text)) == text, with and without special tokens")


def check_stop_string(client: tailserve.Client, info: dict[str, Any], text: str) -> None:
    """Greedy decoding repeats itself, so a piece of the earlier continuation must stop this one
    where that piece first appears, and leave it out."""
    start = len(text) // 3
    stop = next((text[i:i + 3] for i in range(start, len(text) - 2)
                 if "\ufffd" not in text[i:i + 3]), None)
    if stop is None:
        raise AssertionError(f"no 3-character stop string in {text!r}")
    check(len(stop.encode()) <= info["max_stop_string_bytes"], f"{stop!r} is too long a stop")
    result = client.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, stop=[stop])
    check(result.finish_reason == "stop_string",
          f"stop={stop!r}: finish_reason {result.finish_reason!r}, text {result.text!r}")
    check(result.matched_stop == stop, f"matched_stop {result.matched_stop!r}, want {stop!r}")
    check(stop not in result.text, f"the stop string {stop!r} was sent: {result.text!r}")
    want = text[:text.find(stop)]
    check(result.text == want, f"stop={stop!r}: text {result.text!r}, want {want!r}")
    print(f"ok: stop={stop!r} ends the stream: {result.text!r}")


def check_invalid_utf8(client: tailserve.Client, target: str) -> None:
    """The client passes bytes through; the raw stub shows what any gRPC caller gets."""
    bad = b"caf\xc3 \xff"
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        cases = [
            ("prompt_text", lambda: list(stub.Generate(
                pb.GenerateRequest(prompt_text=bad), timeout=CALL_S))),
            ("stop_strings", lambda: list(stub.Generate(pb.GenerateRequest(
                prompt_text=b"ok", stop=pb.StopParams(stop_strings=[bad])), timeout=CALL_S))),
            ("text", lambda: stub.Tokenize(pb.TokenizeRequest(text=bad), timeout=CALL_S)),
        ]
        for field, call in cases:
            try:
                call()
            except grpc.RpcError as err:
                check(err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.details(),
                      f"invalid UTF-8 in {field}: {err.code()} {err.details()!r}")
            else:
                raise AssertionError(f"invalid UTF-8 in {field} was accepted")
    try:
        client.generate(bad)
    except tailserve.TailserveError as err:
        check(err.code == "INVALID_ARGUMENT" and "prompt_text" in err.message, str(err))
    else:
        raise AssertionError("client.generate(invalid UTF-8) succeeded")
    print("ok: invalid UTF-8 in prompt_text, stop_strings and Tokenize.text is INVALID_ARGUMENT")


def check_readme_example(target: str) -> None:
    for readme in READMES:
        match = re.search(r"```python\n(.*?)```", readme.read_text(), re.DOTALL)
        if match is None:
            raise AssertionError(f"no ```python block in {readme}")
        with tempfile.TemporaryDirectory() as cwd:  # away from the source tree
            run = subprocess.run([sys.executable, "-c", match.group(1)], cwd=cwd, text=True,
                                 capture_output=True, timeout=CALL_S,
                                 env={**os.environ, "TAILSERVE_TARGET": target})
        check(run.returncode == 0 and run.stdout.strip() != "",
              f"{readme} example: exit {run.returncode}\nstdout:\n{run.stdout}\n"
              f"stderr:\n{run.stderr}")
        print(f"ok: the example in {readme} printed:\n{run.stdout}")


def main() -> int:
    binary = os.environ.get("TS_TAILSERVE_BIN")
    if not binary:
        print("run_e2e: SKIPPED: TS_TAILSERVE_BIN is not set (the tailserve binary to test)")
        return SKIP
    model_dir = os.environ.get("TS_MODEL_DIR", "")
    with Server(binary, model_dir) as server:
        try:
            target = server.address()
            print(f"server up at {target} (model {model_dir})")
            with tailserve.Client(target, timeout=CALL_S) as client:
                info = client.model_info()
                check(info["has_tokenizer"] is True, f"{model_dir} has no tokenizer: {info}")
                text = check_stream_text_is_the_text_of_its_ids(client)
                check_round_trip(client)
                check_stop_string(client, info, text)
                check_invalid_utf8(client, target)
            check_readme_example(target)
            rc = server.terminate()
            check(rc == 0, f"after SIGTERM the server exited {rc}, want 0 (drained)")
            print("ok: SIGTERM drains the server, exit 0")
        except Exception as err:  # any failure: show the server's side of it
            print("server output:\n  " + "\n  ".join(server.lines), file=sys.stderr)
            print(f"run_e2e: FAILED: {type(err).__name__}: {err}", file=sys.stderr)
            return 1
    print("run_e2e: PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
