#include "bench/client/args.h"

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace ts::client {

absl::StatusOr<std::vector<std::string>> TakeRepeatedFlag(std::vector<char*>* args,
                                                          absl::string_view name) {
  std::vector<std::string> values;
  std::vector<char*> kept;
  const std::string one = absl::StrCat("-", name), two = absl::StrCat("--", name);
  size_t i = 0;
  for (; i < args->size(); ++i) {
    const absl::string_view arg = (*args)[i];
    if (i > 0 && arg == "--") break;
    if (i > 0 && (arg == one || arg == two)) {
      if (i + 1 >= args->size()) {
        return absl::InvalidArgumentError(absl::StrCat(two, ": missing a value"));
      }
      values.emplace_back((*args)[++i]);
      continue;
    }
    absl::string_view rest = arg;  // ConsumePrefix changes it only on a match
    if (i > 0 && (absl::ConsumePrefix(&rest, two + "=") || absl::ConsumePrefix(&rest, one + "="))) {
      values.emplace_back(rest);
      continue;
    }
    kept.push_back((*args)[i]);
  }
  for (; i < args->size(); ++i) kept.push_back((*args)[i]);
  *args = std::move(kept);
  return values;
}

absl::StatusOr<std::string> StopString(absl::string_view value, absl::string_view flag) {
  std::string out, error;
  if (!absl::CUnescape(value, &out, &error)) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", value, "': ", error));
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": must not be empty"));
  return out;
}

absl::StatusOr<std::vector<int32_t>> ParseIdList(absl::string_view text, absl::string_view flag) {
  std::vector<int32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(part, &id)) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": '", part, "' is not a token id (want comma-separated integers)"));
    }
    ids.push_back(id);
  }
  return ids;
}

}  // namespace ts::client
