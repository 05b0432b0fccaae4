// One place that sets up a binary's command line: the usage message, and --help / --helpshort
// listing the flags the binary defines. absl lists only the flags of files named like the program
// (tailserve.cc for `tailserve`) by default, so binaries whose flags live in main.cc or
// decode_bench.cc printed "No flags matched".
#pragma once

#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace ts {

// Parses argv after making --help list the flags defined in files whose path contains
// `flags_path` (e.g. "server/main.cc", "bench/load/"). Returns the positional arguments, argv[0]
// first, as absl::ParseCommandLine does.
inline std::vector<char*> ParseFlags(int argc, char** argv, absl::string_view usage_message,
                                     absl::string_view flags_path) {
  absl::SetProgramUsageMessage(usage_message);
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [path = std::string(flags_path)](absl::string_view file) {
    return absl::StrContains(file, path);
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  return absl::ParseCommandLine(argc, argv);
}

}  // namespace ts
