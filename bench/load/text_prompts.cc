#include "bench/load/text_prompts.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "bench/load/random.h"

namespace ts::load {

absl::StatusOr<TextPromptSet> FitTextPrompts(std::vector<TextPrompt> candidates,
                                             const TextFitOptions& o, TextFitReport* report) {
  *report = TextFitReport{.candidates = static_cast<int64_t>(candidates.size())};
  TextPromptSet set;
  set.output_from_reply = o.output_from_reply;
  const int64_t dist_max = o.output.MaxOrUnbounded();
  for (TextPrompt& p : candidates) {
    if (p.input_tokens <= 0) {
      ++report->no_tokens;
      continue;
    }
    const bool from_reply = o.output_from_reply && p.reply_tokens >= 0;
    int64_t output = from_reply ? std::max(p.reply_tokens, 1) : std::max<int64_t>(dist_max, 1);
    bool capped = false;
    if (from_reply && o.max_new_tokens > 0 && output > o.max_new_tokens) {
      output = o.max_new_tokens;
      capped = true;
    }
    if (o.max_context > 0 && p.input_tokens + output > o.max_context) {
      if (report->too_long++ == 0) {
        report->first_too_long_entry = p.entry;
        report->first_too_long_tokens = p.input_tokens;
      }
      continue;
    }
    if (from_reply) {
      p.reply_tokens = static_cast<int32_t>(output);
      ++report->replies_used;
      report->replies_capped += capped;
    }
    set.prompts.push_back(std::move(p));
  }
  if (set.prompts.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no prompt fits the server: of ", report->candidates, " prompts, ", report->too_long,
        " need more than max_context ", o.max_context, " with their output length and ",
        report->no_tokens, " tokenize to no tokens"));
  }
  set.order.resize(set.prompts.size());
  std::iota(set.order.begin(), set.order.end(), 0u);
  if (o.shuffle) {
    // Fisher-Yates from counter-based draws: the order is a pure function of (seed, prompts).
    for (size_t j = set.order.size() - 1; j > 0; --j) {
      const auto k = static_cast<size_t>(
          UniformInt(0, static_cast<int64_t>(j), Uniform01(o.seed, j, Stream::kPromptOrder)));
      std::swap(set.order[j], set.order[k]);
    }
  }
  return set;
}

}  // namespace ts::load
