// Paths for tests: CTest sets TS_SOURCE_DIR / TS_BINARY_DIR (cmake/TailserveTest.cmake).
#pragma once

#include <cstdlib>
#include <filesystem>

namespace ts::testing {
inline std::filesystem::path SourceDir() {
  const char* d = std::getenv("TS_SOURCE_DIR");
  return d ? std::filesystem::path(d) : std::filesystem::current_path();
}
inline std::filesystem::path BinaryDir() {
  const char* d = std::getenv("TS_BINARY_DIR");
  return d ? std::filesystem::path(d) : std::filesystem::current_path();
}
inline std::filesystem::path FixtureDir() { return SourceDir() / "tests" / "fixtures"; }
}  // namespace ts::testing
