"""The tailserve.v1 gRPC stubs (generation_pb2, generation_pb2_grpc), generated at build time from
proto/tailserve/v1/generation.proto by setup.py; they are not in the source tree."""
