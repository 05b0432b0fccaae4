// Command-line pieces of tailserve-client that absl flags do not cover: a flag given several times
// (absl keeps only the last value) and comma-separated token ids.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ts::client {

// Removes every `--NAME=VALUE`, `--NAME VALUE` (or one dash) from args, before absl parses the
// rest, and returns the values in order. Arguments after a bare "--" are left alone. args[0] is
// the program. InvalidArgument naming the flag when the last argument is NAME without a value.
absl::StatusOr<std::vector<std::string>> TakeRepeatedFlag(std::vector<char*>* args,
                                                          absl::string_view name);

// A --stop value: C escapes (\n, \t, \\, \x41, ...) are decoded so that a newline can be given on
// a command line; the result must not be empty. Errors name `flag`.
absl::StatusOr<std::string> StopString(absl::string_view value, absl::string_view flag);

// "1,15,27" -> {1, 15, 27}; empty parts are skipped. Errors name `flag`.
absl::StatusOr<std::vector<int32_t>> ParseIdList(absl::string_view text, absl::string_view flag);

}  // namespace ts::client
