// Whether this test process runs under compute-sanitizer: tests/gpu/run-bundle.sh sets
// TS_UNDER_SANITIZER to the tool's name for every run it starts under one. Racecheck runs a kernel
// hundreds of times slower, so a test that repeats launches for statistics or for the odds of a
// rare interleaving, not to reach another code path, may repeat less there; each such test says
// why where it asks. Nothing else may depend on this.
#pragma once

#include <cstdlib>

namespace ts::testing {

inline bool UnderComputeSanitizer() {
  const char* tool = std::getenv("TS_UNDER_SANITIZER");
  return tool != nullptr && *tool != '\0';
}

}  // namespace ts::testing
