// The one place where absl::Status codes become grpc::Status codes.
#pragma once

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace ts::server {

grpc::StatusCode ToGrpcCode(absl::StatusCode code);
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace ts::server
