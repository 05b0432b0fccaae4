"""Python client for tailserve, an LLM decode serving engine (gRPC API tailserve.v1.Generation).

    with tailserve.Client("127.0.0.1:50051") as client:
        for chunk in client.stream("In the beginning"):
            print(chunk.text, end="", flush=True)

The raw stubs, for what the client does not cover, are tailserve.v1.generation_pb2 and
tailserve.v1.generation_pb2_grpc.
"""
from tailserve.client import (DEFAULT_TARGET, Chunk, Client, Completion, TailserveError, Timing,
                              Usage)

__all__ = ["DEFAULT_TARGET", "Chunk", "Client", "Completion", "TailserveError", "Timing", "Usage"]
