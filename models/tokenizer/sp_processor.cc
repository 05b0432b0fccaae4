#include "models/tokenizer/sp_processor.h"

#include <dlfcn.h>

#include <filesystem>
#include <mutex>

#include "models/tokenizer/sp_backend.h"

namespace ts {
namespace {

using NewFn = SpBackend* (*)();

// Loads libts_sentencepiece.so once per process (see sp_backend.h for why it is separate): from
// the build tree when this binary runs there, else wherever the dynamic linker finds it
// (LD_LIBRARY_PATH, the binary's RUNPATH, the system's library directories).
NewFn LoadBackend(std::string* error) {
  static std::once_flag once;
  static NewFn fn = nullptr;
  static std::string load_error;
  std::call_once(once, [] {
    void* handle = nullptr;
    std::string tried;
    for (const char* path : {TS_SENTENCEPIECE_BUILD_PATH, "libts_sentencepiece.so"}) {
      if (path[0] == '/' && !std::filesystem::exists(path)) continue;
      handle = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
      if (handle != nullptr) break;
      tried += std::string(tried.empty() ? "" : "; ") + dlerror();
    }
    if (handle == nullptr) {
      load_error = "cannot load libts_sentencepiece.so (" + tried + ")";
      return;
    }
    fn = reinterpret_cast<NewFn>(dlsym(handle, "ts_sentencepiece_new"));
    if (fn == nullptr) load_error = "libts_sentencepiece.so lacks ts_sentencepiece_new";
  });
  *error = load_error;
  return fn;
}

}  // namespace

SpProcessor::SpProcessor() = default;
SpProcessor::~SpProcessor() = default;

std::string SpProcessor::Load(const std::string& path) {
  std::string error;
  NewFn make = LoadBackend(&error);
  if (make == nullptr) return error;
  impl_.reset(make());
  return impl_->Load(path);
}
std::string SpProcessor::Encode(std::string_view text, std::vector<int>* ids) const {
  return impl_->Encode(text, ids);
}
std::string SpProcessor::Decode(const std::vector<int>& ids, std::string* text) const {
  return impl_->Decode(ids, text);
}
int SpProcessor::PieceSize() const {
  return impl_->PieceSize();
}
const std::string& SpProcessor::IdToPiece(int id) const {
  return impl_->IdToPiece(id);
}
int SpProcessor::PieceToId(std::string_view piece) const {
  return impl_->PieceToId(piece);
}
bool SpProcessor::IsControl(int id) const {
  return impl_->IsControl(id);
}
bool SpProcessor::IsByte(int id) const {
  return impl_->IsByte(id);
}
bool SpProcessor::IsUnknown(int id) const {
  return impl_->IsUnknown(id);
}
int SpProcessor::bos_id() const {
  return impl_->bos_id();
}
int SpProcessor::eos_id() const {
  return impl_->eos_id();
}
int SpProcessor::unk_id() const {
  return impl_->unk_id();
}

}  // namespace ts
