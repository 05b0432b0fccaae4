#include "bench/load/options.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace ts::load {

std::string ModeName(LoopMode mode) {
  return mode == LoopMode::kOpen ? "open" : "closed";
}

std::string PromptSource(const LoadOptions& o) {
  if (!o.prompts_file.empty()) return "file";
  return o.prompt_text.empty() ? "random" : "text";
}

absl::Status ValidateOptions(const LoadOptions& o) {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (o.target.empty()) return bad("--target: must be host:port");
  if (o.mode == LoopMode::kOpen && !(o.rate_per_s > 0)) {
    return bad("--rate: must be > 0 requests/s (or inf) for an open-loop run, got ", o.rate_per_s);
  }
  if (o.mode == LoopMode::kClosed && o.concurrency < 1) {
    return bad("--concurrency: must be >= 1, got ", o.concurrency);
  }
  if (o.num_requests < 0) return bad("--num_requests: must be >= 0, got ", o.num_requests);
  if (!(o.duration_s >= 0) || std::isinf(o.duration_s)) {
    return bad("--duration_s: must be finite and >= 0, got ", o.duration_s);
  }
  if (o.num_requests == 0 && o.duration_s == 0) {
    return bad("--num_requests / --duration_s: set at least one so the run ends by itself");
  }
  if (o.mode == LoopMode::kOpen && std::isinf(o.rate_per_s) && o.num_requests == 0) {
    return bad("--rate=inf sends everything at once and needs --num_requests");
  }
  if (o.warmup_requests < 0) return bad("--warmup_requests: must be >= 0");
  if (!(o.connect_timeout_s > 0)) return bad("--connect_timeout_s: must be > 0");
  if (!(o.request_timeout_s >= 0)) return bad("--request_timeout_s: must be >= 0");
  if (!(o.drain_timeout_s >= 0)) return bad("--drain_timeout_s: must be >= 0");
  if (o.channels < 1 || o.channels > 256) return bad("--channels: must be in [1, 256]");
  if (!(o.sampling.temperature >= 0) || std::isinf(o.sampling.temperature)) {
    return bad("--temperature: must be finite and >= 0");
  }
  if (!o.prompts_file.empty() && !o.prompt_text.empty()) {
    return bad("--prompts_file and --prompt_text: choose one");
  }
  if (PromptSource(o) != "random" && o.input_len_set) {
    return bad(
        "--input_len / --input_dist: with --prompts_file or --prompt_text the input lengths "
        "are the prompts' token counts; drop them");
  }
  return absl::OkStatus();
}

nlohmann::json OptionsToJson(const LoadOptions& o) {
  nlohmann::json sampling = {{"temperature", o.sampling.temperature},
                             {"send_seed", o.sampling.send_seed}};
  auto put = [&sampling](const char* key, const auto& opt) {
    if (opt.has_value()) sampling[key] = *opt;
  };
  put("top_k", o.sampling.top_k);
  put("top_p", o.sampling.top_p);
  put("min_p", o.sampling.min_p);
  put("repetition_penalty", o.sampling.repetition_penalty);
  put("presence_penalty", o.sampling.presence_penalty);
  put("frequency_penalty", o.sampling.frequency_penalty);
  nlohmann::json j = {
      {"target", o.target},
      {"mode", ModeName(o.mode)},
      {"num_requests", o.num_requests},
      {"duration_s", o.duration_s},
      {"warmup_requests", o.warmup_requests},
      {"seed", o.seed},
      {"prompt_source", PromptSource(o)},
      {"output_dist", o.output.ToString()},
      {"output_len_set", o.output_len_set},
      {"ignore_eos", true},
      {"sampling", sampling},
      {"connect_timeout_s", o.connect_timeout_s},
      {"request_timeout_s", o.request_timeout_s},
      {"drain_timeout_s", o.drain_timeout_s},
      {"channels", o.channels},
      {"out_dir", o.out_dir},
      {"allow_errors", o.allow_errors},
  };
  if (PromptSource(o) == "random") {
    j["input_dist"] = o.input.ToString();
  } else {
    j["prompts_file"] = o.prompts_file;
    j["prompt_text"] = o.prompt_text;
    j["shuffle_prompts"] = o.shuffle_prompts;
    j["add_special_tokens"] = o.add_special_tokens;
  }
  if (o.mode == LoopMode::kOpen) {
    // JSON has no infinity; keep the flag's spelling.
    j["rate_per_s"] =
        std::isinf(o.rate_per_s) ? nlohmann::json("inf") : nlohmann::json(o.rate_per_s);
  } else {
    j["concurrency"] = o.concurrency;
  }
  return j;
}

}  // namespace ts::load
