#include "models/tokenizer/text_stream.h"

#include <algorithm>
#include <string_view>
#include <utility>

namespace ts {

TextStream::TextStream(const Tokenizer& tokenizer, std::vector<std::string> stop_strings,
                       DecodeOptions options)
    : decoder_(tokenizer, options), stops_(std::move(stop_strings)) {
  for (const std::string& s : stops_) max_stop_bytes_ = std::max(max_stop_bytes_, s.size());
}

TextStream::Delta TextStream::Next(int32_t id, bool match_stops) {
  Delta delta;
  if (stopped_) return delta;
  held_ += decoder_.Next(id);
  if (!match_stops || stops_.empty()) {
    delta.text = std::move(held_);
    held_.clear();
    return delta;
  }
  // The earliest match wins; at one position, the first stop string listed. Everything before
  // held_ was sent because no stop string could start there, so no match can begin earlier.
  size_t best = std::string::npos;
  for (size_t i = 0; i < stops_.size(); ++i) {
    const size_t at = held_.find(stops_[i]);
    if (at < best) {
      best = at;
      delta.stop_index = i;
    }
  }
  if (delta.stop_index) {
    delta.text = held_.substr(0, best);
    held_.clear();
    stopped_ = true;
    return delta;
  }
  const size_t keep = HoldBack();
  delta.text = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return delta;
}

size_t TextStream::HoldBack() const {
  const std::string_view held(held_);
  // A match starts on a stop string's first byte, which is never a UTF-8 continuation byte, so
  // the text sent before it always ends on a character boundary.
  for (size_t keep = std::min(held.size(), max_stop_bytes_ - 1); keep > 0; --keep) {
    const std::string_view tail = held.substr(held.size() - keep);
    for (const std::string& s : stops_) {
      if (s.size() > keep && std::string_view(s).substr(0, keep) == tail) return keep;
    }
  }
  return 0;
}

std::string TextStream::Finish() {
  if (stopped_) return {};
  std::string out = std::move(held_);
  held_.clear();
  out += decoder_.Flush();
  return out;
}

}  // namespace ts
