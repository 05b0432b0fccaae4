// tailserve-client: calls a running tailserve over gRPC and prints the streamed continuation.
//   tailserve-client --target 127.0.0.1:50051 --prompt 1,15,27 --max_new_tokens 32
//   tailserve-client --target 127.0.0.1:50051 --info
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/flags.h"
#include "tailserve/v1/generation.grpc.pb.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "server address host:port");
ABSL_FLAG(std::string, prompt, "1,15,27,100,7", "prompt token ids, comma separated");
ABSL_FLAG(int32_t, max_new_tokens, 32, "tokens to generate");
ABSL_FLAG(float, temperature, 0.0f, "0 = greedy");
ABSL_FLAG(float, top_p, 1.0f, "nucleus sampling mass");
ABSL_FLAG(int32_t, top_k, 0, "0 = off");
ABSL_FLAG(int64_t, seed, -1, "sampling seed; -1 lets the server draw one");
ABSL_FLAG(bool, ignore_eos, false, "keep generating past EOS");
ABSL_FLAG(bool, info, false, "print GetModelInfo and exit");
ABSL_FLAG(int32_t, timeout_s, 60, "deadline for the call");

namespace v1 = tailserve::v1;

namespace {

int PrintInfo(v1::Generation::Stub& stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s)));
  v1::ModelInfo info;
  const grpc::Status s = stub.GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
  if (!s.ok()) {
    std::fprintf(stderr, "GetModelInfo failed: %d %s\n", s.error_code(), s.error_message().c_str());
    return 1;
  }
  std::printf("%s", info.DebugString().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ts::ParseFlags(argc, argv,
                 "calls a running tailserve and prints the streamed continuation.\n"
                 "  tailserve-client --target HOST:PORT --prompt 1,15,27 --max_new_tokens 32",
                 "bench/client/");
  auto channel =
      grpc::CreateChannel(absl::GetFlag(FLAGS_target), grpc::InsecureChannelCredentials());
  auto stub = v1::Generation::NewStub(channel);
  if (absl::GetFlag(FLAGS_info)) return PrintInfo(*stub);

  v1::GenerateRequest req;
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_prompt), ',', absl::SkipEmpty())) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(part, &id)) {
      std::fprintf(stderr, "--prompt: '%.*s' is not a token id\n", static_cast<int>(part.size()),
                   part.data());
      return 2;
    }
    req.mutable_prompt_token_ids()->add_ids(id);
  }
  req.mutable_sampling()->set_temperature(absl::GetFlag(FLAGS_temperature));
  req.mutable_sampling()->set_top_p(absl::GetFlag(FLAGS_top_p));
  req.mutable_sampling()->set_top_k(absl::GetFlag(FLAGS_top_k));
  if (absl::GetFlag(FLAGS_seed) >= 0) req.mutable_sampling()->set_seed(absl::GetFlag(FLAGS_seed));
  req.mutable_stop()->set_max_new_tokens(absl::GetFlag(FLAGS_max_new_tokens));
  req.mutable_stop()->set_ignore_eos(absl::GetFlag(FLAGS_ignore_eos));

  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s)));
  const auto start = std::chrono::steady_clock::now();
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse msg;
  std::vector<int32_t> tokens;
  std::printf("prompt: %s\ncontinuation:",
              absl::StrJoin(req.prompt_token_ids().ids(), " ").c_str());
  std::fflush(stdout);
  v1::GenerateResponse last;
  double ttft_ms = -1;
  while (reader->Read(&msg)) {
    if (ttft_ms < 0 && msg.token_ids_size() > 0) {
      ttft_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                    .count();
    }
    for (int32_t t : msg.token_ids()) {
      tokens.push_back(t);
      std::printf(" %d", t);
    }
    std::fflush(stdout);
    last = msg;
  }
  std::printf("\n");
  const grpc::Status s = reader->Finish();
  if (!s.ok()) {
    std::fprintf(stderr, "Generate failed: %d %s\n", s.error_code(), s.error_message().c_str());
    return 1;
  }
  const double total_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "finish_reason: %s, prompt_tokens: %d, completion_tokens: %d, ttft: %.1f ms, "
      "total: %.1f ms\n",
      v1::FinishReason_Name(last.finish_reason()).c_str(), last.usage().prompt_tokens(),
      last.usage().completion_tokens(), ttft_ms, total_ms);
  return 0;
}
