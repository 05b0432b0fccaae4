#include "bench/load/text_source.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "bench/load/prompt_file.h"
#include "bench/load/text_prompts.h"
#include "grpcpp/grpcpp.h"

namespace ts::load {
namespace {

namespace v1 = ::tailserve::v1;

// Tokenize calls in flight while counting: enough to hide the round trip on a local server
// without competing with it for more than a few cores.
constexpr size_t kCountThreads = 8;

// Texts listed once each, in first-seen order; index[k] is the k-th input's position.
struct Distinct {
  std::vector<std::string> texts;
  std::vector<std::string> labels;
  std::vector<size_t> index;
  std::unordered_map<std::string, size_t> seen;

  void Add(const std::string& text, const std::string& label) {
    const auto [it, inserted] = seen.emplace(text, texts.size());
    if (inserted) {
      texts.push_back(text);
      labels.push_back(label);
    }
    index.push_back(it->second);
  }
};

absl::StatusOr<PromptFile> ReadPrompts(const LoadOptions& o) {
  if (o.prompts_file.empty()) {
    PromptFile one;
    one.prompts.push_back({.text = o.prompt_text, .entry = 0, .line = 1});
    one.entries = 1;
    return one;
  }
  auto file = ReadPromptFile(o.prompts_file);
  if (!file.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--prompts_file: ", file.status().message()));
  }
  return file;
}

// "path:line" of a file entry, or the flag for --prompt_text.
std::string Where(const LoadOptions& o, const PromptFile& file, int64_t entry) {
  if (o.prompts_file.empty()) return "--prompt_text";
  // prompts are in entry order.
  const auto it = std::lower_bound(file.prompts.begin(), file.prompts.end(), entry,
                                   [](const FilePrompt& p, int64_t e) { return p.entry < e; });
  return absl::StrCat(o.prompts_file, ":", it == file.prompts.end() ? 0 : it->line);
}

nlohmann::json FitFacts(const TextFitReport& r) {
  return {{"candidates", r.candidates},
          {"skipped_too_long", r.too_long},
          {"first_too_long_entry", r.first_too_long_entry},
          {"skipped_no_tokens", r.no_tokens},
          {"replies_used", r.replies_used},
          {"replies_capped", r.replies_capped}};
}

}  // namespace

absl::StatusOr<std::vector<int32_t>> CountTokens(LoadClient& client,
                                                 const std::vector<std::string>& texts,
                                                 const std::vector<std::string>& labels,
                                                 bool add_special_tokens) {
  std::vector<int32_t> counts(texts.size(), -1);
  std::atomic<size_t> next{0};
  std::mutex mu;
  absl::Status error;
  const double timeout_s = client.options().connect_timeout_s;
  auto work = [&](size_t worker) {
    for (size_t i; (i = next.fetch_add(1)) < texts.size();) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() +
                           std::chrono::duration_cast<std::chrono::system_clock::duration>(
                               std::chrono::duration<double>(timeout_s)));
      v1::TokenizeRequest request;
      request.set_text(texts[i]);
      request.mutable_params()->set_add_special_tokens(add_special_tokens);
      v1::TokenizeResponse response;
      const grpc::Status s = client.stub(worker)->Tokenize(&context, request, &response);
      if (s.ok()) {
        counts[i] = response.count();
        continue;
      }
      const std::string message =
          absl::StrCat("Tokenize of ", labels[i], " failed: ", StatusCodeName(s.error_code()), ": ",
                       s.error_message());
      std::lock_guard<std::mutex> lock(mu);
      if (error.ok()) {
        // The server judged the text itself: a problem with the input, not with the server.
        error = s.error_code() == grpc::StatusCode::INVALID_ARGUMENT
                    ? absl::InvalidArgumentError(message)
                    : absl::UnavailableError(message);
      }
      next.store(texts.size());
      return;
    }
  };
  std::vector<std::thread> threads;
  for (size_t w = 0; w < std::min(kCountThreads, texts.size()); ++w) threads.emplace_back(work, w);
  for (std::thread& t : threads) t.join();
  if (!error.ok()) return error;
  return counts;
}

absl::StatusOr<TextSource> LoadTextSource(LoadClient& client, const LoadOptions& o,
                                          const v1::ModelInfo& info) {
  const char* flag = o.prompts_file.empty() ? "--prompt_text" : "--prompts_file";
  if (!info.has_tokenizer()) {
    return absl::FailedPreconditionError(absl::StrCat(
        flag, ": the server's model (", info.model(),
        ") has no tokenizer (ModelInfo.has_tokenizer is false); serve a model directory with "
        "tokenizer.json or tokenizer.model, or drop ",
        flag, " to send random token ids"));
  }
  auto file = ReadPrompts(o);
  if (!file.ok()) return file.status();

  const bool output_from_reply = !o.output_len_set;
  Distinct prompts, replies;
  std::vector<std::optional<size_t>> reply_of(file->prompts.size());
  for (size_t k = 0; k < file->prompts.size(); ++k) {
    const FilePrompt& p = file->prompts[k];
    const std::string label = o.prompts_file.empty() ? std::string(flag)
                                                     : absl::StrCat(o.prompts_file, ":", p.line,
                                                                    " (entry ", p.entry, ")");
    prompts.Add(p.text, label);
    if (output_from_reply && p.reply) {
      replies.Add(*p.reply, absl::StrCat("the reply of ", label));
      reply_of[k] = replies.index.back();
    }
  }
  auto prompt_counts = CountTokens(client, prompts.texts, prompts.labels, o.add_special_tokens);
  if (!prompt_counts.ok()) return prompt_counts.status();
  // A reply is generated text: it carries no BOS, so it is counted without special tokens.
  auto reply_counts = CountTokens(client, replies.texts, replies.labels, false);
  if (!reply_counts.ok()) return reply_counts.status();

  std::vector<TextPrompt> candidates;
  candidates.reserve(file->prompts.size());
  for (size_t k = 0; k < file->prompts.size(); ++k) {
    FilePrompt& p = file->prompts[k];
    candidates.push_back({.text = std::move(p.text),
                          .input_tokens = (*prompt_counts)[prompts.index[k]],
                          .reply_tokens = reply_of[k] ? (*reply_counts)[*reply_of[k]] : -1,
                          .entry = p.entry});
  }
  TextFitReport fit;
  auto set = FitTextPrompts(std::move(candidates),
                            {.seed = o.seed,
                             .shuffle = o.shuffle_prompts,
                             .output = o.output,
                             .output_from_reply = output_from_reply,
                             .max_context = info.max_context(),
                             .max_new_tokens = info.max_new_tokens()},
                            &fit);
  if (!set.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(flag, ": ", set.status().message()));
  }

  TextSource out;
  nlohmann::json skipped = nlohmann::json::object();
  const std::string source = o.prompts_file.empty() ? "--prompt_text" : o.prompts_file;
  out.notes.push_back(absl::StrCat("prompts: ", set->prompts.size(), " of ", file->entries,
                                   " entries of ", source, " (", prompts.texts.size(),
                                   " distinct texts, counted with the server's Tokenize)"));
  for (const SkippedEntries& s : file->skipped) {
    skipped[s.reason] = s.count;
    out.notes.push_back(absl::StrCat("prompts: skipped ", s.count, " with no prompt: ", s.reason,
                                     " (first at ", s.first, ")"));
  }
  if (fit.too_long > 0) {
    out.notes.push_back(absl::StrCat(
        "prompts: skipped ", fit.too_long, " that do not fit max_context ", info.max_context(),
        " with their output length (first at ", Where(o, *file, fit.first_too_long_entry), ", ",
        fit.first_too_long_tokens, " prompt tokens)"));
  }
  if (fit.no_tokens > 0) {
    out.notes.push_back(absl::StrCat("prompts: skipped ", fit.no_tokens, " with no tokens"));
  }
  if (fit.replies_used > 0) {
    out.notes.push_back(absl::StrCat(
        "prompts: ", fit.replies_used, " take their output length from the file's reply",
        fit.replies_capped > 0
            ? absl::StrCat(" (", fit.replies_capped, " capped to max_new_tokens ",
                           info.max_new_tokens(), ")")
            : "",
        fit.replies_used < static_cast<int64_t>(set->prompts.size())
            ? "; the others use --output_len/--output_dist"
            : ""));
  }
  out.facts = {{"source", PromptSource(o)},   {"entries", file->entries},
               {"skipped_entries", skipped},  {"distinct_prompts", prompts.texts.size()},
               {"used", set->prompts.size()}, {"output_from_reply", output_from_reply},
               {"fit", FitFacts(fit)}};
  out.prompts = std::make_shared<const TextPromptSet>(std::move(*set));
  return out;
}

}  // namespace ts::load
