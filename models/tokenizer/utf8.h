// UTF-8 helpers shared by the tokenizer's encoders and decoders.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ts::utf8 {

// Length of the valid UTF-8 sequence at s[i], or 0 when it is invalid or truncated.
size_t SequenceLength(std::string_view s, size_t i);
bool IsValid(std::string_view s);
// Offset of the first byte where `s` stops being valid UTF-8, or s.size() when it is valid.
size_t ValidPrefix(std::string_view s);
// Replaces each maximal invalid subpart with U+FFFD, as Rust's String::from_utf8_lossy does.
std::string Lossy(std::string_view s);
// Number of trailing bytes that are a valid but incomplete start of a character (0..3).
size_t IncompleteTail(std::string_view s);
void AppendCodepoint(uint32_t cp, std::string* out);

inline constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

}  // namespace ts::utf8
