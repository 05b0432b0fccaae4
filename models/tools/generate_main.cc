// tailserve-generate: runs the CPU reference model on token ids, prefill then one token at a time
// through the paged KV cache, and reports the continuation and its speed. It is the smallest
// end-to-end check of a checkpoint directory, with no engine or server in the way.
//
//   tailserve-generate --model_dir DIR --prompt 1,2,3 --max_new_tokens 32 --greedy
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "models/cpu_model.h"
#include "models/sampling.h"

namespace ts {
namespace {

constexpr int32_t kBlockSize = 16;

struct Options {
  std::string model_dir = TAILSERVE_SOURCE_DIR "/tests/fixtures/tiny-gqa-untied";
  std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8};
  int max_new_tokens = 32;
  SamplingParams sampling;
  bool ignore_eos = false;
  int threads = 0;
};

constexpr char kUsage[] =
    "usage: tailserve-generate [--model_dir DIR] [--prompt 1,2,3] [--max_new_tokens N]\n"
    "         [--temperature T] [--top_k K] [--top_p P] [--min_p M] [--repetition_penalty R]\n"
    "         [--seed S] [--greedy] [--ignore_eos] [--threads N]\n"
    "  --model_dir  Hugging Face Llama checkpoint directory (config.json + safetensors)\n"
    "               default: the tiny-gqa-untied test fixture\n"
    "  --prompt     comma-separated token ids (no tokenizer here)\n"
    "  --greedy     same as --temperature 0\n"
    "  --ignore_eos keep generating past the checkpoint's EOS ids\n"
    "  --threads    CPU threads for the model, 0 = all cores\n";

// Debian's abseil has its own absl::string_view (not std's), so flags travel as std::string.
absl::Status BadValue(const std::string& flag, const std::string& value) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot parse '", value, "'"));
}

absl::Status ParsePrompt(const std::string& text, std::vector<int32_t>* out) {
  out->clear();
  for (absl::string_view piece : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int32_t id;
    if (!absl::SimpleAtoi(piece, &id)) return BadValue("prompt", std::string(piece));
    out->push_back(id);
  }
  if (out->empty()) return absl::InvalidArgumentError("--prompt: needs at least one token id");
  return absl::OkStatus();
}

// Accepts --flag=value and --flag value; boolean flags take no value.
absl::Status ParseArgs(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (arg.substr(0, 2) != "--")
      return absl::InvalidArgumentError(absl::StrCat("unexpected '", arg, "'"));
    arg.erase(0, 2);
    std::string name = arg, value;
    bool has_value = false;
    if (const size_t eq = arg.find('='); eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      has_value = true;
    }
    if (name == "greedy") {
      o->sampling.temperature = 0.0f;
      continue;
    }
    if (name == "ignore_eos") {
      o->ignore_eos = true;
      continue;
    }
    if (!has_value) {
      if (i + 1 >= argc)
        return absl::InvalidArgumentError(absl::StrCat("--", name, ": missing value"));
      value = argv[++i];
    }
    bool ok = true;
    if (name == "model_dir") {
      o->model_dir = value;
    } else if (name == "prompt") {
      if (absl::Status s = ParsePrompt(value, &o->prompt); !s.ok()) return s;
    } else if (name == "max_new_tokens") {
      ok = absl::SimpleAtoi(value, &o->max_new_tokens) && o->max_new_tokens >= 1;
    } else if (name == "temperature") {
      ok = absl::SimpleAtof(value, &o->sampling.temperature);
    } else if (name == "top_k") {
      ok = absl::SimpleAtoi(value, &o->sampling.top_k);
    } else if (name == "top_p") {
      ok = absl::SimpleAtof(value, &o->sampling.top_p);
    } else if (name == "min_p") {
      ok = absl::SimpleAtof(value, &o->sampling.min_p);
    } else if (name == "repetition_penalty") {
      ok = absl::SimpleAtof(value, &o->sampling.repetition_penalty);
    } else if (name == "seed") {
      ok = absl::SimpleAtoi(value, &o->sampling.seed);
    } else if (name == "threads") {
      ok = absl::SimpleAtoi(value, &o->threads) && o->threads >= 0;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
    if (!ok) return BadValue(name, value);
  }
  return absl::OkStatus();
}

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

absl::Status Generate(const Options& o) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  CpuModelOptions model_options;
  model_options.num_threads = o.threads;
  absl::StatusOr<std::unique_ptr<CpuModel>> loaded = CpuModel::Load(o.model_dir, model_options);
  if (!loaded.ok()) return loaded.status();
  CpuModel& model = **loaded;
  const ModelConfig& c = model.config();
  std::printf(
      "model: %s\n  layers %d, hidden %d, heads %d/%d kv, head_dim %d, vocab %d, %s weights "
      "upcast to %.1f MiB fp32, %d threads, loaded in %.2f s\n",
      o.model_dir.c_str(), c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
      c.vocab_size, std::string(DTypeName(c.dtype)).c_str(), model.weight_bytes() / 1048576.0,
      model.num_threads(), Seconds(Clock::now() - t0));

  if (absl::Status s = ValidateSamplingParams(o.sampling, c.vocab_size); !s.ok()) return s;
  const int64_t total = static_cast<int64_t>(o.prompt.size()) + o.max_new_tokens;
  if (total > c.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("prompt + max_new_tokens = ", total,
                                                   " exceeds max_position_embeddings ",
                                                   c.max_position_embeddings));
  }
  const int32_t blocks = static_cast<int32_t>((total + kBlockSize - 1) / kBlockSize);
  CpuKvPool kv(c, blocks, kBlockSize);
  std::vector<int32_t> table(blocks);
  for (int32_t b = 0; b < blocks; ++b) table[b] = b;

  std::vector<int32_t> output;
  std::vector<float> logits;
  auto is_eos = [&](int32_t id) {
    for (int32_t e : c.eos_token_ids) {
      if (e == id) return true;
    }
    return false;
  };

  const auto t_prefill = Clock::now();
  const SeqChunk prefill{.tokens = o.prompt, .start_pos = 0, .block_table = table};
  if (absl::Status s = model.Forward({&prefill, 1}, kv, LogitsMode::kLastPerChunk, &logits);
      !s.ok()) {
    return s;
  }
  output.push_back(SampleToken(logits, o.sampling, o.prompt, output));
  const double prefill_s = Seconds(Clock::now() - t_prefill);

  const auto t_decode = Clock::now();
  int decode_steps = 0;
  while (static_cast<int>(output.size()) < o.max_new_tokens &&
         (o.ignore_eos || !is_eos(output.back()))) {
    const SeqChunk step{.tokens = {&output.back(), 1},
                        .start_pos = static_cast<int32_t>(o.prompt.size() + output.size() - 1),
                        .block_table = table};
    if (absl::Status s = model.Forward({&step, 1}, kv, LogitsMode::kLastPerChunk, &logits);
        !s.ok()) {
      return s;
    }
    output.push_back(SampleToken(logits, o.sampling, o.prompt, output));
    ++decode_steps;
  }
  const double decode_s = Seconds(Clock::now() - t_decode);

  std::printf("prompt (%zu): %s\n", o.prompt.size(), absl::StrJoin(o.prompt, " ").c_str());
  std::printf("output (%zu%s): %s\n", output.size(),
              !o.ignore_eos && is_eos(output.back()) ? ", stopped at EOS" : "",
              absl::StrJoin(output, " ").c_str());
  std::printf("prefill: %zu tokens in %.2f ms (%.1f tokens/s)\n", o.prompt.size(), prefill_s * 1e3,
              o.prompt.size() / prefill_s);
  if (decode_steps > 0) {
    std::printf("decode: %d steps in %.2f ms (%.1f tokens/s, %.3f ms/token)\n", decode_steps,
                decode_s * 1e3, decode_steps / decode_s, decode_s * 1e3 / decode_steps);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace ts

int main(int argc, char** argv) {
  ts::Options options;
  if (absl::Status s = ts::ParseArgs(argc, argv, &options); !s.ok()) {
    std::fprintf(stderr, "tailserve-generate: %s\n%s", std::string(s.message()).c_str(),
                 ts::kUsage);
    return 2;
  }
  if (absl::Status s = ts::Generate(options); !s.ok()) {
    std::fprintf(stderr, "tailserve-generate: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
