// sentencepiece::SentencePieceProcessor, reached through libts_sentencepiece.so (sp_backend.h
// says why it is loaded apart). Debian's sentencepiece header also declares absl::string_view
// itself, which clashes with abseil's, so only sp_backend.cc includes it.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace ts {

class SpBackend;

class SpProcessor {
 public:
  SpProcessor();
  ~SpProcessor();
  // Empty on success, else SentencePiece's message (or why the library could not be loaded).
  // The other methods need a successful Load.
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
  std::unique_ptr<SpBackend> impl_;
};

}  // namespace ts
