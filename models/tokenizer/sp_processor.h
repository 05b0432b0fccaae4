// A thin wrapper over sentencepiece::SentencePieceProcessor. Debian's sentencepiece header
// declares absl::string_view itself, which clashes with abseil's; so only sp_processor.cc, which
// includes no abseil header, sees it.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace tailserve {

class SpProcessor {
 public:
  SpProcessor();
  ~SpProcessor();
  // Empty on success, else SentencePiece's message.
  std::string Load(const std::string& path);
  std::string Encode(std::string_view text, std::vector<int>* ids) const;
  std::string Decode(const std::vector<int>& ids, std::string* text) const;
  int PieceSize() const;
  const std::string& IdToPiece(int id) const;
  int PieceToId(std::string_view piece) const;
  bool IsControl(int id) const;
  bool IsByte(int id) const;
  bool IsUnknown(int id) const;
  int bos_id() const;
  int eos_id() const;
  int unk_id() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tailserve
