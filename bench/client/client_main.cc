// tailserve-client: calls a running tailserve over gRPC and prints the streamed continuation: its
// text when the server has a tokenizer, else its token ids.
//   tailserve-client --target 127.0.0.1:50051 --prompt_text "In the beginning" --stop '\n\n'
//   tailserve-client --target 127.0.0.1:50051 --prompt 1,15,27 --max_new_tokens 32
//   tailserve-client --target 127.0.0.1:50051 --tokenize "In the beginning"
//   tailserve-client --target 127.0.0.1:50051 --info
// Exit codes: 0 done; 1 the server failed the call (the gRPC code and message are printed) or
// cannot serve it (no tokenizer for text); 2 bad flags.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/client/args.h"
#include "bench/common/grpc_code.h"
#include "common/flags.h"
#include "tailserve/v1/generation.grpc.pb.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "server address host:port");
ABSL_FLAG(std::optional<std::string>, prompt, std::nullopt,
          "prompt token ids, comma separated (default 1,15,27,100,7 unless --prompt_text is set)");
ABSL_FLAG(std::string, prompt_text, "", "prompt text (UTF-8), tokenized by the server");
ABSL_FLAG(int32_t, max_new_tokens, 32, "tokens to generate");
ABSL_FLAG(float, temperature, 0.0f, "0 = greedy");
ABSL_FLAG(float, top_p, 1.0f, "nucleus sampling mass");
ABSL_FLAG(int32_t, top_k, 0, "0 = off");
ABSL_FLAG(int64_t, seed, -1, "sampling seed; -1 lets the server draw one");
ABSL_FLAG(bool, ignore_eos, false, "keep generating past EOS");
// Listed for --help only: main takes every --stop out of argv before absl parses the rest,
// because absl keeps only the last value of a flag given twice.
ABSL_FLAG(std::string, stop, "",
          "stop string; give the flag once per string (--stop '\\n\\n' --stop 'User:'). C escapes "
          "(\\n, \\t, \\\\, \\x41) are decoded. The stream ends before the match; the match is "
          "not printed");
ABSL_FLAG(std::string, stop_token_ids, "", "token ids that end the stream, comma separated");
ABSL_FLAG(bool, add_special_tokens, true,
          "let the tokenizer add its special tokens (BOS) to --prompt_text and --tokenize");
ABSL_FLAG(bool, skip_special_tokens, true,
          "leave special tokens (BOS, EOS) out of the printed text and --detokenize");
ABSL_FLAG(bool, show_ids, false, "with text output, also print the token ids after the text");
ABSL_FLAG(bool, info, false, "print GetModelInfo and exit");
ABSL_FLAG(std::string, tokenize, "",
          "print this text's token ids (comma separated, ready for --prompt) and exit");
ABSL_FLAG(std::string, detokenize, "", "print the text of these comma-separated ids and exit");
ABSL_FLAG(int32_t, timeout_s, 60, "deadline for the call");

namespace v1 = tailserve::v1;

namespace {

constexpr const char* kDefaultPrompt = "1,15,27,100,7";

int BadFlag(const absl::Status& s) {
  std::fprintf(stderr, "tailserve-client: %s\n", std::string(s.message()).c_str());
  return 2;
}

int RpcFailed(const char* rpc, const grpc::Status& s) {
  std::fprintf(stderr, "tailserve-client: %s failed: %s (%d): %s\n", rpc,
               ts::GrpcCodeName(s.error_code()).c_str(), static_cast<int>(s.error_code()),
               s.error_message().c_str());
  return 1;
}

void SetDeadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s)));
}

v1::TextParams TextParamsFromFlags() {
  v1::TextParams p;
  p.set_add_special_tokens(absl::GetFlag(FLAGS_add_special_tokens));
  p.set_skip_special_tokens(absl::GetFlag(FLAGS_skip_special_tokens));
  return p;
}

int PrintInfo(v1::Generation::Stub& stub) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::ModelInfo info;
  const grpc::Status s = stub.GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
  if (!s.ok()) return RpcFailed("GetModelInfo", s);
  std::printf("%s", info.DebugString().c_str());
  return 0;
}

// --tokenize / --detokenize: one Tokenize call.
int Tokenize(v1::Generation::Stub& stub) {
  v1::TokenizeRequest req;
  *req.mutable_params() = TextParamsFromFlags();
  const std::string text = absl::GetFlag(FLAGS_tokenize);
  if (!text.empty()) {
    req.set_text(text);
  } else {
    auto ids = ts::client::ParseIdList(absl::GetFlag(FLAGS_detokenize), "--detokenize");
    if (!ids.ok()) return BadFlag(ids.status());
    req.mutable_token_ids()->mutable_ids()->Assign(ids->begin(), ids->end());
  }
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::TokenizeResponse resp;
  const grpc::Status s = stub.Tokenize(&ctx, req, &resp);
  if (!s.ok()) return RpcFailed("Tokenize", s);
  if (!text.empty()) {
    std::printf("%s\n", absl::StrJoin(resp.token_ids(), ",").c_str());
    std::fprintf(stderr, "%d tokens\n", resp.count());
  } else {
    std::printf("%s\n", resp.text().c_str());
  }
  return 0;
}

// The request from flags; exit code 2 (printed) when a flag is bad.
std::optional<v1::GenerateRequest> RequestFromFlags(const std::vector<std::string>& stops) {
  v1::GenerateRequest req;
  const std::string text = absl::GetFlag(FLAGS_prompt_text);
  const std::optional<std::string> ids_flag = absl::GetFlag(FLAGS_prompt);
  if (!text.empty() && ids_flag) {
    BadFlag(absl::InvalidArgumentError("--prompt and --prompt_text: choose one"));
    return std::nullopt;
  }
  if (!text.empty()) {
    req.set_prompt_text(text);
  } else {
    auto ids = ts::client::ParseIdList(ids_flag.value_or(kDefaultPrompt), "--prompt");
    if (!ids.ok()) {
      BadFlag(ids.status());
      return std::nullopt;
    }
    req.mutable_prompt_token_ids()->mutable_ids()->Assign(ids->begin(), ids->end());
  }
  auto stop_ids = ts::client::ParseIdList(absl::GetFlag(FLAGS_stop_token_ids), "--stop_token_ids");
  if (!stop_ids.ok()) {
    BadFlag(stop_ids.status());
    return std::nullopt;
  }
  v1::SamplingParams* sampling = req.mutable_sampling();
  sampling->set_temperature(absl::GetFlag(FLAGS_temperature));
  sampling->set_top_p(absl::GetFlag(FLAGS_top_p));
  sampling->set_top_k(absl::GetFlag(FLAGS_top_k));
  if (absl::GetFlag(FLAGS_seed) >= 0) sampling->set_seed(absl::GetFlag(FLAGS_seed));
  v1::StopParams* stop = req.mutable_stop();
  stop->set_max_new_tokens(absl::GetFlag(FLAGS_max_new_tokens));
  stop->set_ignore_eos(absl::GetFlag(FLAGS_ignore_eos));
  stop->mutable_stop_token_ids()->Assign(stop_ids->begin(), stop_ids->end());
  for (const std::string& s : stops) stop->add_stop_strings(s);
  *req.mutable_text() = TextParamsFromFlags();
  return req;
}

struct StreamFacts {
  std::vector<int32_t> ids;
  v1::GenerateResponse last;
  uint64_t seed = 0;
  double ttft_ms = -1;        // first message carrying tokens
  double last_token_ms = -1;  // last message carrying tokens
  size_t first_tokens = 0;    // tokens in the first message carrying any
};

double MsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// On stderr, so stdout holds the continuation only.
void PrintSummary(const StreamFacts& f, double total_ms) {
  const v1::GenerateResponse& last = f.last;
  std::string line = absl::StrCat("finish_reason: ", v1::FinishReason_Name(last.finish_reason()));
  if (!last.matched_stop().empty()) {
    absl::StrAppend(&line, ", matched_stop: \"", absl::CHexEscape(last.matched_stop()), "\"");
  }
  const int32_t completion =
      last.has_usage() ? last.usage().completion_tokens() : static_cast<int32_t>(f.ids.size());
  absl::StrAppend(&line, ", prompt_tokens: ", last.usage().prompt_tokens(),
                  ", completion_tokens: ", completion, ", seed: ", f.seed,
                  absl::StrFormat(", ttft: %.1f ms", f.ttft_ms));
  // Decode rate: the tokens after the first message's, over the time after it (the server
  // coalesces, so the first message may carry several).
  if (f.ids.size() > f.first_tokens && f.last_token_ms > f.ttft_ms) {
    absl::StrAppend(
        &line, absl::StrFormat(", decode: %.1f tok/s", (f.ids.size() - f.first_tokens) * 1000.0 /
                                                           (f.last_token_ms - f.ttft_ms)));
  }
  absl::StrAppend(&line, absl::StrFormat(", total: %.1f ms", total_ms));
  if (last.has_timing()) {
    const v1::Timing& t = last.timing();
    absl::StrAppend(&line, absl::StrFormat(" (server: queue %.1f ms, prefill wait %.1f ms, "
                                           "prefill %.1f ms)",
                                           t.queue_us() / 1000.0, t.prefill_wait_us() / 1000.0,
                                           t.prefill_us() / 1000.0));
  }
  std::fprintf(stderr, "%s\n", line.c_str());
}

int Generate(v1::Generation::Stub& stub, const v1::GenerateRequest& req, bool text_out) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  const auto start = std::chrono::steady_clock::now();
  auto reader = stub.Generate(&ctx, req);
  if (!text_out) {
    std::printf("prompt: %s\ncontinuation:",
                absl::StrJoin(req.prompt_token_ids().ids(), " ").c_str());
  }
  std::fflush(stdout);
  StreamFacts facts;
  v1::GenerateResponse msg;
  for (bool first = true; reader->Read(&msg); first = false) {
    if (first) facts.seed = msg.seed();
    if (msg.token_ids_size() > 0) {
      facts.last_token_ms = MsSince(start);
      if (facts.ttft_ms < 0) {
        facts.ttft_ms = facts.last_token_ms;
        facts.first_tokens = static_cast<size_t>(msg.token_ids_size());
      }
    }
    for (int32_t t : msg.token_ids()) {
      facts.ids.push_back(t);
      if (!text_out) std::printf(" %d", t);
    }
    if (text_out) std::fwrite(msg.text().data(), 1, msg.text().size(), stdout);
    std::fflush(stdout);
    facts.last = msg;
  }
  std::printf("\n");
  if (text_out && absl::GetFlag(FLAGS_show_ids)) {
    std::printf("token_ids: %s\n", absl::StrJoin(facts.ids, " ").c_str());
  }
  std::fflush(stdout);
  const grpc::Status s = reader->Finish();
  if (!s.ok()) return RpcFailed("Generate", s);
  PrintSummary(facts, MsSince(start));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args(argv, argv + argc);
  auto stop_values = ts::client::TakeRepeatedFlag(&args, "stop");
  if (!stop_values.ok()) return BadFlag(stop_values.status());
  std::vector<std::string> stops;
  for (const std::string& v : *stop_values) {
    auto s = ts::client::StopString(v, "--stop");
    if (!s.ok()) return BadFlag(s.status());
    stops.push_back(*s);
  }
  ts::ParseFlags(static_cast<int>(args.size()), args.data(),
                 "calls a running tailserve and prints the streamed continuation (its text when "
                 "the server has a tokenizer).\n"
                 "  tailserve-client --target HOST:PORT --prompt_text \"In the beginning\"\n"
                 "  tailserve-client --target HOST:PORT --prompt 1,15,27 --max_new_tokens 32",
                 "bench/client/");
  auto channel =
      grpc::CreateChannel(absl::GetFlag(FLAGS_target), grpc::InsecureChannelCredentials());
  auto stub = v1::Generation::NewStub(channel);
  if (absl::GetFlag(FLAGS_info)) return PrintInfo(*stub);
  if (!absl::GetFlag(FLAGS_tokenize).empty() || !absl::GetFlag(FLAGS_detokenize).empty()) {
    if (!absl::GetFlag(FLAGS_tokenize).empty() && !absl::GetFlag(FLAGS_detokenize).empty()) {
      return BadFlag(absl::InvalidArgumentError("--tokenize and --detokenize: choose one"));
    }
    return Tokenize(*stub);
  }
  const std::optional<v1::GenerateRequest> req = RequestFromFlags(stops);
  if (!req) return 2;

  // ModelInfo says whether the continuation can be printed as text.
  grpc::ClientContext info_ctx;
  SetDeadline(&info_ctx);
  v1::ModelInfo info;
  if (const grpc::Status s = stub->GetModelInfo(&info_ctx, v1::GetModelInfoRequest(), &info);
      !s.ok()) {
    return RpcFailed("GetModelInfo", s);
  }
  if (!info.has_tokenizer() && (req->has_prompt_text() || !stops.empty())) {
    std::fprintf(stderr,
                 "tailserve-client: %s needs a tokenizer, and the server's model (%s) has none "
                 "(ModelInfo.has_tokenizer is false); send token ids with --prompt\n",
                 req->has_prompt_text() ? "--prompt_text" : "--stop", info.model().c_str());
    return 1;
  }
  return Generate(*stub, *req, info.has_tokenizer());
}
