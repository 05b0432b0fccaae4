// "OK", "UNAVAILABLE", ... for a grpc::StatusCode value, without linking gRPC: the clients print
// codes by name, as the server's documentation and errors spell them.
#pragma once

#include <iterator>
#include <string>

namespace ts {

inline std::string GrpcCodeName(int code) {
  static constexpr const char* kNames[] = {"OK",
                                           "CANCELLED",
                                           "UNKNOWN",
                                           "INVALID_ARGUMENT",
                                           "DEADLINE_EXCEEDED",
                                           "NOT_FOUND",
                                           "ALREADY_EXISTS",
                                           "PERMISSION_DENIED",
                                           "RESOURCE_EXHAUSTED",
                                           "FAILED_PRECONDITION",
                                           "ABORTED",
                                           "OUT_OF_RANGE",
                                           "UNIMPLEMENTED",
                                           "INTERNAL",
                                           "UNAVAILABLE",
                                           "DATA_LOSS",
                                           "UNAUTHENTICATED"};
  if (code >= 0 && code < static_cast<int>(std::size(kNames))) return kNames[code];
  return "CODE_" + std::to_string(code);
}

}  // namespace ts
