#include "bench/load/workload.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/load/random.h"

namespace ts::load {
namespace {

constexpr int32_t kNoCap = std::numeric_limits<int32_t>::max();

absl::StatusOr<double> ParseNumber(absl::string_view text, absl::string_view field,
                                   absl::string_view spec) {
  double v = 0;
  if (!absl::SimpleAtod(text, &v) || !std::isfinite(v)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": '", text, "' in '", spec, "' is not a finite number"));
  }
  return v;
}

bool IsWholeNumber(double v) {
  return std::floor(v) == v;
}

}  // namespace

std::string LengthDist::ToString() const {
  switch (kind) {
    case Kind::kFixed:
      return absl::StrCat("fixed:", a);
    case Kind::kUniform:
      return absl::StrCat("uniform:", a, ":", b);
    case Kind::kNormal:
      return absl::StrCat("normal:", a, ":", b);
  }
  return "?";
}

int64_t LengthDist::MaxOrUnbounded() const {
  switch (kind) {
    case Kind::kFixed:
      return static_cast<int64_t>(a);
    case Kind::kUniform:
      return static_cast<int64_t>(b);
    case Kind::kNormal:
      return -1;
  }
  return -1;
}

absl::StatusOr<LengthDist> ParseLengthDist(absl::string_view spec, absl::string_view field) {
  const std::vector<absl::string_view> parts = absl::StrSplit(spec, ':');
  LengthDist dist;
  std::vector<double> args;
  absl::string_view kind = parts[0];
  size_t first_arg = 1;
  if (parts.size() == 1) {  // a bare number means fixed
    kind = "fixed";
    first_arg = 0;
  }
  for (size_t i = first_arg; i < parts.size(); ++i) {
    auto v = ParseNumber(parts[i], field, spec);
    if (!v.ok()) return v.status();
    args.push_back(*v);
  }
  auto want_args = [&](size_t n) -> absl::Status {
    if (args.size() == n) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": '", spec, "' needs ", n, " number(s) after '", kind, ":'"));
  };
  if (kind == "fixed") {
    if (auto s = want_args(1); !s.ok()) return s;
    dist.kind = LengthDist::Kind::kFixed;
    dist.a = args[0];
    if (dist.a < 1 || !IsWholeNumber(dist.a)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": fixed length must be a whole number >= 1, got '", spec, "'"));
    }
  } else if (kind == "uniform") {
    if (auto s = want_args(2); !s.ok()) return s;
    dist.kind = LengthDist::Kind::kUniform;
    dist.a = args[0];
    dist.b = args[1];
    if (dist.a < 1 || dist.b < dist.a || !IsWholeNumber(dist.a) || !IsWholeNumber(dist.b)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": uniform needs whole numbers 1 <= MIN <= MAX, got '", spec, "'"));
    }
  } else if (kind == "normal") {
    if (auto s = want_args(2); !s.ok()) return s;
    dist.kind = LengthDist::Kind::kNormal;
    dist.a = args[0];
    dist.b = args[1];
    if (dist.a < 1 || dist.b < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": normal needs MEAN >= 1 and STD >= 0, got '", spec, "'"));
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": unknown distribution '", kind,
                     "' (want fixed:N, uniform:MIN:MAX, normal:MEAN:STD)"));
  }
  if (dist.MaxOrUnbounded() > kNoCap) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": '", spec, "' is too large"));
  }
  return dist;
}

int32_t SampleLength(const LengthDist& dist, double u0, double u1, int32_t cap) {
  double v = dist.a;
  switch (dist.kind) {
    case LengthDist::Kind::kFixed:
      break;
    case LengthDist::Kind::kUniform:
      v = static_cast<double>(
          UniformInt(static_cast<int64_t>(dist.a), static_cast<int64_t>(dist.b), u0));
      break;
    case LengthDist::Kind::kNormal: {
      // Box-Muller; 1 - u0 is in (0, 1] so the log is finite.
      const double z = std::sqrt(-2.0 * std::log1p(-u0)) * std::cos(2.0 * std::numbers::pi * u1);
      v = std::round(dist.a + dist.b * z);
      break;
    }
  }
  v = std::clamp(v, 1.0, static_cast<double>(std::max(cap, 1)));
  return static_cast<int32_t>(v);
}

absl::Status CheckWorkloadFits(const WorkloadOptions& o) {
  if (!o.text && o.vocab_size <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("server ModelInfo.vocab_size is ", o.vocab_size, "; cannot draw prompt ids"));
  }
  const int64_t max_in = o.input.MaxOrUnbounded();
  const int64_t max_out = o.output.MaxOrUnbounded();
  if (o.max_new_tokens > 0 && max_out > o.max_new_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("output length ", o.output.ToString(),
                                                   " can exceed the server's max_new_tokens ",
                                                   o.max_new_tokens));
  }
  if (!o.text && o.max_context > 0 && max_in > 0 && max_out > 0 &&
      max_in + max_out > o.max_context) {
    return absl::InvalidArgumentError(absl::StrCat(
        "input length ", o.input.ToString(), " + output length ", o.output.ToString(),
        " can reach ", max_in + max_out, " tokens, over the server's max_context ", o.max_context));
  }
  if (o.max_context > 0 && o.max_context < 2) {
    return absl::FailedPreconditionError(
        absl::StrCat("server max_context ", o.max_context, " leaves no room for prompt + output"));
  }
  return absl::OkStatus();
}

namespace {

RequestSpec MakeTextRequestSpec(const WorkloadOptions& o, uint64_t index) {
  const TextPromptSet& set = *o.text;
  const TextPrompt& prompt = set.prompts[set.order[index % set.order.size()]];
  RequestSpec spec;
  spec.prompt_text = prompt.text;
  spec.input_len = prompt.input_tokens;
  spec.prompt_entry = prompt.entry;
  int32_t out_cap = o.max_new_tokens > 0 ? o.max_new_tokens : kNoCap;
  if (o.max_context > 0) out_cap = std::min(out_cap, o.max_context - prompt.input_tokens);
  if (set.output_from_reply && prompt.reply_tokens >= 0) {
    spec.output_len = std::clamp(prompt.reply_tokens, 1, std::max(out_cap, 1));
  } else {
    spec.output_len = SampleLength(o.output, Uniform01(o.seed, index, Stream::kOutputLen, 0),
                                   Uniform01(o.seed, index, Stream::kOutputLen, 1), out_cap);
  }
  spec.sampling_seed = Bits64(o.seed, index, Stream::kSamplingSeed);
  return spec;
}

}  // namespace

RequestSpec MakeRequestSpec(const WorkloadOptions& o, uint64_t index) {
  if (o.text) return MakeTextRequestSpec(o, index);
  RequestSpec spec;
  int32_t out_cap = o.max_new_tokens > 0 ? o.max_new_tokens : kNoCap;
  if (o.max_context > 0) out_cap = std::min(out_cap, o.max_context - 1);
  spec.output_len = SampleLength(o.output, Uniform01(o.seed, index, Stream::kOutputLen, 0),
                                 Uniform01(o.seed, index, Stream::kOutputLen, 1), out_cap);
  const int32_t in_cap = o.max_context > 0 ? o.max_context - spec.output_len : kNoCap;
  const int32_t input_len = SampleLength(o.input, Uniform01(o.seed, index, Stream::kInputLen, 0),
                                         Uniform01(o.seed, index, Stream::kInputLen, 1), in_cap);
  spec.input_len = input_len;
  spec.prompt_ids.resize(static_cast<size_t>(input_len));
  for (int32_t p = 0; p < input_len; ++p) {
    spec.prompt_ids[static_cast<size_t>(p)] = static_cast<int32_t>(
        UniformInt(0, o.vocab_size - 1,
                   Uniform01(o.seed, index, Stream::kPromptIds, static_cast<uint32_t>(p))));
  }
  spec.sampling_seed = Bits64(o.seed, index, Stream::kSamplingSeed);
  return spec;
}

}  // namespace ts::load
