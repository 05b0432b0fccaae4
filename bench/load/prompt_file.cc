#include "bench/load/prompt_file.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace ts::load {
namespace {

using nlohmann::json;

constexpr const char* kKeys = "\"prompt\", \"text\", \"conversations\" or \"messages\"";

template <typename... Parts>
absl::Status Bad(const Parts&... parts) {
  return absl::InvalidArgumentError(absl::StrCat(parts...));
}

// A well-formed entry: its prompt, or why it has none.
struct Entry {
  std::optional<FilePrompt> prompt;
  std::string skip_reason;
};

Entry Text(std::string text, std::optional<std::string> reply = std::nullopt) {
  if (text.empty()) return {std::nullopt, "empty prompt"};
  return {FilePrompt{.text = std::move(text), .reply = std::move(reply)}, ""};
}

bool OneOf(std::string_view s, const std::vector<std::string_view>& options) {
  for (std::string_view o : options) {
    if (s == o) return true;
  }
  return false;
}

// The two turn-list shapes: ShareGPT's conversations and OpenAI's messages.
struct TurnShape {
  const char* list;      // key of the turn array
  const char* role_key;  // key naming who speaks
  const char* text_key;  // key of the turn's text
  std::vector<std::string_view> prompt_roles;
  std::vector<std::string_view> ignored_roles;  // neither prompt nor reply
  bool text_parts;  // the text may be [{"type": "text", "text": ...}, ...] (OpenAI content parts)
  const char* no_prompt_reason;
};

const TurnShape kConversations = {.list = "conversations",
                                  .role_key = "from",
                                  .text_key = "value",
                                  .prompt_roles = {"human", "user"},
                                  .ignored_roles = {"system"},
                                  .text_parts = false,
                                  .no_prompt_reason = "conversation with no human turn"};
const TurnShape kMessages = {.list = "messages",
                             .role_key = "role",
                             .text_key = "content",
                             .prompt_roles = {"user"},
                             .ignored_roles = {"system", "developer"},
                             .text_parts = true,
                             .no_prompt_reason = "messages with no user message"};

absl::StatusOr<std::string> TurnText(const json& turn, const TurnShape& shape,
                                     const std::string& where) {
  const auto it = turn.find(shape.text_key);
  if (it == turn.end()) return Bad(where, " has no \"", shape.text_key, "\"");
  if (it->is_string()) return it->get<std::string>();
  if (!shape.text_parts || !it->is_array()) {
    return Bad(where, ".", shape.text_key, " is ", it->type_name(), ", want a string",
               shape.text_parts ? " or an array of content parts" : "");
  }
  std::vector<std::string> texts;  // non-text parts (images, audio) carry no prompt text
  for (size_t k = 0; k < it->size(); ++k) {
    const json& part = (*it)[k];
    const std::string part_where = absl::StrCat(where, ".", shape.text_key, "[", k, "]");
    if (!part.is_object()) return Bad(part_where, " is ", part.type_name(), ", want an object");
    if (part.value("type", "") != "text") continue;
    const auto text = part.find("text");
    if (text == part.end() || !text->is_string()) {
      return Bad(part_where, " is a text part without a string \"text\"");
    }
    texts.push_back(text->get<std::string>());
  }
  return absl::StrJoin(texts, "\n");
}

// The first prompt-role turn is the prompt; the first later turn from anyone else (system aside)
// is its reply. Every turn is checked, so a file in some other shape fails loudly.
absl::StatusOr<Entry> FromTurns(const json& turns, const TurnShape& shape) {
  if (!turns.is_array())
    return Bad("\"", shape.list, "\" is ", turns.type_name(), ", want an array");
  std::optional<std::string> prompt, reply;
  for (size_t k = 0; k < turns.size(); ++k) {
    const json& turn = turns[k];
    const std::string where = absl::StrCat(shape.list, "[", k, "]");
    if (!turn.is_object()) return Bad(where, " is ", turn.type_name(), ", want an object");
    const auto role = turn.find(shape.role_key);
    if (role == turn.end() || !role->is_string()) {
      return Bad(where, " needs a string \"", shape.role_key, "\"");
    }
    auto text = TurnText(turn, shape, where);
    if (!text.ok()) return text.status();
    const std::string who = role->get<std::string>();
    if (!prompt) {
      if (OneOf(who, shape.prompt_roles)) prompt = std::move(*text);
    } else if (!reply && !OneOf(who, shape.prompt_roles) && !OneOf(who, shape.ignored_roles)) {
      reply = std::move(*text);
    }
  }
  if (!prompt) return Entry{std::nullopt, shape.no_prompt_reason};
  return Text(std::move(*prompt), std::move(reply));
}

absl::StatusOr<Entry> ParseEntry(const json& v) {
  if (v.is_string()) return Text(v.get<std::string>());
  if (!v.is_object())
    return Bad("entry is ", v.type_name(), "; want a string or an object with ", kKeys);
  std::vector<std::string> present;
  for (const char* key : {"prompt", "text", "conversations", "messages"}) {
    if (v.contains(key)) present.push_back(absl::StrCat("\"", key, "\""));
  }
  if (present.empty()) {
    std::vector<std::string> keys;
    for (const auto& [key, unused] : v.items()) keys.push_back(absl::StrCat("\"", key, "\""));
    return Bad("object has no ", kKeys,
               " (its keys: ", keys.empty() ? "none" : absl::StrJoin(keys, ", "), ")");
  }
  if (present.size() > 1) {
    return Bad("object has ", absl::StrJoin(present, " and "), "; give one");
  }
  if (v.contains("conversations")) return FromTurns(v["conversations"], kConversations);
  if (v.contains("messages")) return FromTurns(v["messages"], kMessages);
  const char* key = v.contains("prompt") ? "prompt" : "text";
  if (!v[key].is_string()) return Bad("\"", key, "\" is ", v[key].type_name(), ", want a string");
  return Text(v[key].get<std::string>());
}

// nlohmann's message without its "[json.exception...] parse error at line L, column C: " prefix;
// the caller names the place itself.
std::string ParseErrorDetail(const json::parse_error& e) {
  const std::string_view what = e.what();
  const size_t column = what.find("column ");
  const size_t colon = what.find(": ", column == std::string_view::npos ? 0 : column);
  return std::string(colon == std::string_view::npos ? what : what.substr(colon + 2));
}

// Byte offsets where the elements of the top-level array in `text` start (`text` parses), so
// that errors about an element can name its line.
std::vector<size_t> ArrayElementStarts(std::string_view text) {
  std::vector<size_t> starts;
  int depth = 0;
  bool in_string = false, escaped = false, want_element = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') continue;
    if (want_element) {
      want_element = false;
      if (c != ']') starts.push_back(i);
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth == 1) want_element = true;
    } else if (c == ']' || c == '}') {
      --depth;
    } else if (c == ',' && depth == 1) {
      want_element = true;
    }
  }
  return starts;
}

// Counts newlines incrementally: offsets must come in ascending order.
class LineCounter {
 public:
  explicit LineCounter(std::string_view text) : text_(text) {}
  int64_t LineAt(size_t offset) {
    for (; at_ < offset && at_ < text_.size(); ++at_) line_ += text_[at_] == '\n';
    return line_;
  }

 private:
  std::string_view text_;
  size_t at_ = 0;
  int64_t line_ = 1;
};

class Collector {
 public:
  explicit Collector(const std::string& path) : path_(path) {}

  absl::Status Add(const json& value, int64_t line) {
    auto entry = ParseEntry(value);
    if (!entry.ok()) return Bad(path_, ":", line, ": ", entry.status().message());
    const int64_t index = file_.entries++;
    if (entry->prompt) {
      entry->prompt->entry = index;
      entry->prompt->line = line;
      file_.prompts.push_back(std::move(*entry->prompt));
      return absl::OkStatus();
    }
    for (SkippedEntries& s : file_.skipped) {
      if (s.reason == entry->skip_reason) {
        ++s.count;
        return absl::OkStatus();
      }
    }
    file_.skipped.push_back({entry->skip_reason, 1, absl::StrCat(path_, ":", line)});
    return absl::OkStatus();
  }

  absl::StatusOr<PromptFile> Finish() && {
    if (file_.entries == 0) return Bad(path_, ": no prompts (the file holds no entries)");
    if (file_.prompts.empty()) {
      std::vector<std::string> why;
      for (const SkippedEntries& s : file_.skipped) {
        why.push_back(absl::StrCat(s.count, " ", s.reason, " (first at ", s.first, ")"));
      }
      return Bad(path_, ": no usable prompt among ", file_.entries,
                 " entries: ", absl::StrJoin(why, ", "));
    }
    return std::move(file_);
  }

 private:
  std::string path_;
  PromptFile file_;
};

absl::StatusOr<PromptFile> ParseJsonArray(std::string_view text, const std::string& path) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::parse_error& e) {
    LineCounter lines(text);
    return Bad(path, ":", lines.LineAt(e.byte == 0 ? 0 : e.byte - 1),
               ": invalid JSON: ", ParseErrorDetail(e));
  }
  if (!doc.is_array()) return Bad(path, ":1: a JSON file must be one array of entries");
  const std::vector<size_t> starts = ArrayElementStarts(text);
  LineCounter lines(text);
  Collector out(path);
  for (size_t k = 0; k < doc.size(); ++k) {
    const int64_t line = lines.LineAt(k < starts.size() ? starts[k] : 0);
    if (auto s = out.Add(doc[k], line); !s.ok()) return s;
  }
  return std::move(out).Finish();
}

absl::StatusOr<PromptFile> ParseJsonLines(std::string_view text, const std::string& path) {
  Collector out(path);
  int64_t line_no = 0;
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find('\n', at);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(at, end - at);
    at = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    json value;
    try {
      value = json::parse(line);
    } catch (const json::parse_error& e) {
      return Bad(path, ":", line_no, ": invalid JSON: ", ParseErrorDetail(e),
                 " (a JSONL file holds one complete JSON value per line; a JSON file must be one "
                 "array)");
    }
    if (auto s = out.Add(value, line_no); !s.ok()) return s;
  }
  return std::move(out).Finish();
}

}  // namespace

absl::StatusOr<PromptFile> ParsePromptFile(absl::string_view content_view,
                                           absl::string_view path_view) {
  std::string_view content(content_view.data(), content_view.size());
  const std::string path(path_view);
  // Editors on some systems start UTF-8 files with a byte order mark; it is not JSON.
  if (content.substr(0, 3) == "\xEF\xBB\xBF") content.remove_prefix(3);
  const size_t first = content.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos) return Bad(path, ": no prompts (the file is empty)");
  if (content[first] == '[') return ParseJsonArray(content, path);
  return ParseJsonLines(content, path);
}

absl::StatusOr<PromptFile> ReadPromptFile(const std::string& path) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) return Bad("cannot open ", path, ": ", std::strerror(errno));
  std::string content;
  char buf[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), f.get())) > 0) content.append(buf, n);
  if (std::ferror(f.get())) return Bad("cannot read ", path, ": ", std::strerror(errno));
  return ParsePromptFile(content, path);
}

}  // namespace ts::load
