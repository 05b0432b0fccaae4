#include "models/tokenizer/sp_processor.h"

#include <sentencepiece_processor.h>

namespace tailserve {

struct SpProcessor::Impl {
  sentencepiece::SentencePieceProcessor sp;
};

SpProcessor::SpProcessor() : impl_(std::make_unique<Impl>()) {}
SpProcessor::~SpProcessor() = default;

std::string SpProcessor::Load(const std::string& path) {
  const auto s = impl_->sp.Load(path);
  return s.ok() ? "" : s.ToString();
}
std::string SpProcessor::Encode(std::string_view text, std::vector<int>* ids) const {
  const auto s = impl_->sp.Encode(text, ids);
  return s.ok() ? "" : s.ToString();
}
std::string SpProcessor::Decode(const std::vector<int>& ids, std::string* text) const {
  const auto s = impl_->sp.Decode(ids, text);
  return s.ok() ? "" : s.ToString();
}
int SpProcessor::PieceSize() const {
  return impl_->sp.GetPieceSize();
}
const std::string& SpProcessor::IdToPiece(int id) const {
  return impl_->sp.IdToPiece(id);
}
int SpProcessor::PieceToId(std::string_view piece) const {
  return impl_->sp.PieceToId(piece);
}
bool SpProcessor::IsControl(int id) const {
  return impl_->sp.IsControl(id);
}
bool SpProcessor::IsByte(int id) const {
  return impl_->sp.IsByte(id);
}
bool SpProcessor::IsUnknown(int id) const {
  return impl_->sp.IsUnknown(id);
}
int SpProcessor::bos_id() const {
  return impl_->sp.bos_id();
}
int SpProcessor::eos_id() const {
  return impl_->sp.eos_id();
}
int SpProcessor::unk_id() const {
  return impl_->sp.unk_id();
}

}  // namespace tailserve
