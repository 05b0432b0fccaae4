// tokenizer.model through the distribution's SentencePiece library.
#include "absl/strings/str_cat.h"
#include "models/tokenizer/sp_processor.h"
#include "models/tokenizer/tokenizer_impl.h"
#include "models/tokenizer/utf8.h"

namespace ts {
namespace {

class SpTokenizer final : public TokenizerImpl {
 public:
  absl::Status Load(const std::string& path) {
    const std::string err = sp_.Load(path);
    if (!err.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", err));
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text, bool) const override {
    std::vector<int> ids;
    const std::string err = sp_.Encode(text, &ids);
    if (!err.empty()) return absl::InvalidArgumentError(absl::StrCat("sentencepiece: ", err));
    return std::vector<int32_t>(ids.begin(), ids.end());
  }

  std::string Decode(std::span<const int32_t> ids, bool) const override {
    // SentencePiece drops control tokens (BOS, EOS) itself; out-of-range ids would make it fail.
    std::vector<int> in;
    for (const int32_t id : ids) {
      if (id >= 0 && id < sp_.PieceSize()) in.push_back(id);
    }
    std::string out;
    if (!sp_.Decode(in, &out).empty()) return "";
    return out;
  }

  std::string TokenBytes(int32_t id, bool) const override {
    if (id < 0 || id >= sp_.PieceSize() || sp_.IsControl(id)) return "";
    const std::string& piece = sp_.IdToPiece(id);
    if (sp_.IsByte(id) && piece.size() == 6) {
      return std::string(1, static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16)));
    }
    if (sp_.IsUnknown(id)) return " \xE2\x81\x87 ";  // SentencePiece's surface for unk: " ⁇ "
    std::string out;
    for (size_t i = 0; i < piece.size();) {
      if (piece.compare(i, 3, "\xE2\x96\x81") == 0) {  // U+2581, SentencePiece's space
        out.push_back(' ');
        i += 3;
      } else {
        out.push_back(piece[i++]);
      }
    }
    return out;
  }

  bool StripsLeadingSpace() const override { return true; }  // the dummy prefix
  std::optional<int32_t> TokenToId(std::string_view token) const override {
    const int id = sp_.PieceToId(token);
    if (id == sp_.unk_id() && token != sp_.IdToPiece(id)) return std::nullopt;
    return id;
  }
  int32_t VocabSize() const override { return sp_.PieceSize(); }
  std::optional<int32_t> DefaultBos() const override {
    return sp_.bos_id() >= 0 ? std::optional<int32_t>(sp_.bos_id()) : std::nullopt;
  }
  std::optional<int32_t> DefaultEos() const override {
    return sp_.eos_id() >= 0 ? std::optional<int32_t>(sp_.eos_id()) : std::nullopt;
  }

 private:
  SpProcessor sp_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<TokenizerImpl>> LoadSentencePieceModel(const std::string& path) {
  auto tok = std::make_unique<SpTokenizer>();
  if (auto s = tok->Load(path); !s.ok()) return s;
  return tok;
}

}  // namespace ts
