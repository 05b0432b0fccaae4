// Generated ids to the text a client is sent: UTF-8-safe deltas, with stop strings matched on the
// text (a match may span tokens). Text that could still begin a stop string is held back until it
// cannot, so a stop string and what follows it are never sent. Rules: docs/text.md, Stop strings.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "models/tokenizer/tokenizer.h"

namespace ts {

class TextStream {
 public:
  struct Delta {
    std::string text;                  // to send now
    std::optional<size_t> stop_index;  // the stop string that matched; the stream ends here
  };

  // `stop_strings`: non-empty UTF-8 strings. The tokenizer outlives the stream.
  TextStream(const Tokenizer& tokenizer, std::vector<std::string> stop_strings,
             DecodeOptions options = {});

  // The text this token completes. `match_stops` false (fewer than min_new_tokens so far) sends
  // the text as it comes and matches nothing. After a match every call returns nothing.
  Delta Next(int32_t id, bool match_stops);
  // End of the stream without a stop match: whatever was held back, an incomplete trailing
  // character as U+FFFD.
  std::string Finish();

  bool stopped() const { return stopped_; }
  const std::vector<std::string>& stop_strings() const { return stops_; }

 private:
  // Length of the longest suffix of held_ that is a proper prefix of some stop string.
  size_t HoldBack() const;

  StreamDecoder decoder_;
  std::vector<std::string> stops_;
  size_t max_stop_bytes_ = 0;
  std::string held_;  // decoded, not yet sent: a possible start of a stop string
  bool stopped_ = false;
};

}  // namespace ts
