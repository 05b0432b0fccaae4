// The tokenizer of tests/fixtures/tiny-gqa-untied (a byte-level BPE covering its 311 ids, see
// tests/fixtures/README.md), loaded once per test binary.
#pragma once

#include <gtest/gtest.h>

#include "models/tokenizer/tokenizer.h"
#include "tests/common/test_paths.h"

namespace ts::testing {

// nullptr (with a test failure recorded) when it does not load.
inline const Tokenizer* FixtureTokenizer() {
  static const Tokenizer* const tok = []() -> const Tokenizer* {
    absl::StatusOr<Tokenizer> t = Tokenizer::Load(FixtureDir() / "tiny-gqa-untied");
    if (!t.ok()) {
      ADD_FAILURE() << t.status();
      return nullptr;
    }
    return new Tokenizer(*std::move(t));  // lives as long as the test binary
  }();
  return tok;
}

}  // namespace ts::testing
