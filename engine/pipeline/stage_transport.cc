#include "engine/pipeline/stage_transport.h"

#include "absl/strings/str_cat.h"

namespace ts::pipeline {

void PackChunks(std::span<const SeqChunk> chunks, StageMessage* m) {
  m->starts.clear();
  m->lengths.clear();
  m->block_counts.clear();
  m->tokens.clear();
  m->blocks.clear();
  for (const SeqChunk& c : chunks) {
    m->starts.push_back(c.start_pos);
    m->lengths.push_back(static_cast<int32_t>(c.tokens.size()));
    m->block_counts.push_back(static_cast<int32_t>(c.block_table.size()));
    m->tokens.insert(m->tokens.end(), c.tokens.begin(), c.tokens.end());
    m->blocks.insert(m->blocks.end(), c.block_table.begin(), c.block_table.end());
  }
}

absl::Status UnpackChunks(const StageMessage& m, std::vector<SeqChunk>* chunks) {
  chunks->clear();
  if (m.lengths.size() != m.starts.size() || m.block_counts.size() != m.starts.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("stage message ", m.id, ": ", m.starts.size(), " chunks with ",
                     m.lengths.size(), " lengths and ", m.block_counts.size(), " block counts"));
  }
  size_t token = 0, block = 0;
  for (size_t i = 0; i < m.starts.size(); ++i) {
    const int32_t n = m.lengths[i], b = m.block_counts[i];
    if (n < 0 || b < 0 || token + n > m.tokens.size() || block + b > m.blocks.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("stage message ", m.id, ": chunk ", i, " runs past its tokens or blocks"));
    }
    chunks->push_back(
        SeqChunk{.tokens = std::span<const int32_t>(m.tokens).subspan(token, n),
                 .start_pos = m.starts[i],
                 .block_table = std::span<const int32_t>(m.blocks).subspan(block, b)});
    token += n;
    block += b;
  }
  if (token != m.tokens.size() || block != m.blocks.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("stage message ", m.id, ": tokens or blocks left over"));
  }
  return absl::OkStatus();
}

}  // namespace ts::pipeline
