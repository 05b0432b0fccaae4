// SpBackend over sentencepiece::SentencePieceProcessor: the only file that includes the
// distribution's sentencepiece header, built into libts_sentencepiece.so (see sp_backend.h).
#include "models/tokenizer/sp_backend.h"

#include <sentencepiece_processor.h>

namespace ts {
namespace {

class SentencePieceBackend final : public SpBackend {
 public:
  std::string Load(const std::string& path) override { return Message(sp_.Load(path)); }
  std::string Encode(std::string_view text, std::vector<int>* ids) const override {
    return Message(sp_.Encode(text, ids));
  }
  std::string Decode(const std::vector<int>& ids, std::string* text) const override {
    return Message(sp_.Decode(ids, text));
  }
  int PieceSize() const override { return sp_.GetPieceSize(); }
  const std::string& IdToPiece(int id) const override { return sp_.IdToPiece(id); }
  int PieceToId(std::string_view piece) const override { return sp_.PieceToId(piece); }
  bool IsControl(int id) const override { return sp_.IsControl(id); }
  bool IsByte(int id) const override { return sp_.IsByte(id); }
  bool IsUnknown(int id) const override { return sp_.IsUnknown(id); }
  int bos_id() const override { return sp_.bos_id(); }
  int eos_id() const override { return sp_.eos_id(); }
  int unk_id() const override { return sp_.unk_id(); }

 private:
  static std::string Message(const sentencepiece::util::Status& s) {
    return s.ok() ? "" : s.ToString();
  }
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace
}  // namespace ts

extern "C" __attribute__((visibility("default"))) ts::SpBackend* ts_sentencepiece_new() {
  return new ts::SentencePieceBackend();
}
