#include "models/tokenizer/utf8.h"

namespace ts::utf8 {
namespace {

struct Prefix {
  size_t matched;  // bytes at s[i] that can start a valid sequence (>= 1 unless at the end)
  size_t needed;   // the length the lead byte announces; 0 for a byte that cannot lead
};

// The Unicode "maximal subpart" scan (Unicode ch. 3, U+FFFD substitution): the second byte's
// range depends on the lead byte, which rules out overlongs, surrogates and > U+10FFFF.
Prefix Scan(std::string_view s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  if (b < 0x80) return {1, 1};
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    n = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    n = 3;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    n = 4;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    return {1, 0};
  }
  size_t k = 1;
  while (k < n && i + k < s.size()) {
    const auto c = static_cast<unsigned char>(s[i + k]);
    if (c < lo || c > hi) break;
    lo = 0x80;
    hi = 0xBF;
    ++k;
  }
  return {k, n};
}

}  // namespace

size_t SequenceLength(std::string_view s, size_t i) {
  const Prefix p = Scan(s, i);
  return p.matched == p.needed ? p.needed : 0;
}

size_t ValidPrefix(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const size_t n = SequenceLength(s, i);
    if (n == 0) break;
    i += n;
  }
  return i;
}

bool IsValid(std::string_view s) {
  return ValidPrefix(s) == s.size();
}

std::string Lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const Prefix p = Scan(s, i);
    if (p.matched == p.needed) {
      out.append(s.substr(i, p.needed));
    } else {
      out.append(kReplacement);
    }
    i += p.matched;
  }
  return out;
}

size_t IncompleteTail(std::string_view s) {
  // A character is at most 4 bytes, so only a lead byte among the last 3 can be incomplete.
  for (size_t back = 1; back <= 3 && back <= s.size(); ++back) {
    const size_t i = s.size() - back;
    const auto b = static_cast<unsigned char>(s[i]);
    if ((b & 0xC0) == 0x80) continue;  // continuation byte: keep looking for its lead
    const Prefix p = Scan(s, i);
    return (p.needed > back && p.matched == back) ? back : 0;
  }
  return 0;
}

void AppendCodepoint(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace ts::utf8
