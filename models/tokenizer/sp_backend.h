// (docs/text.md, "libsentencepiece is loaded apart") The interface between SpProcessor and the
// SentencePiece library, which lives in a shared object of its own (libts_sentencepiece.so,
// sp_backend.cc) that SpProcessor loads on first use.
//
// Why: Debian's libsentencepiece.so carries its own copy of protobuf-lite and exports its
// symbols. Linked into a process that also uses libprotobuf (the gRPC server), the dynamic linker
// binds libprotobuf's own calls to sentencepiece's older copy, and the process crashes while its
// static initialisers run, before main. Loaded with RTLD_LOCAL | RTLD_DEEPBIND, sentencepiece
// resolves its protobuf symbols to its own copy and the rest of the process never sees them.
// Only virtual calls and standard-library types cross this boundary; both sides share one
// libstdc++.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace ts {

class SpBackend {
 public:
  virtual ~SpBackend() = default;
  // Each returns "" on success, else SentencePiece's message.
  virtual std::string Load(const std::string& path) = 0;
  virtual std::string Encode(std::string_view text, std::vector<int>* ids) const = 0;
  virtual std::string Decode(const std::vector<int>& ids, std::string* text) const = 0;
  virtual int PieceSize() const = 0;
  virtual const std::string& IdToPiece(int id) const = 0;
  virtual int PieceToId(std::string_view piece) const = 0;
  virtual bool IsControl(int id) const = 0;
  virtual bool IsByte(int id) const = 0;
  virtual bool IsUnknown(int id) const = 0;
  virtual int bos_id() const = 0;
  virtual int eos_id() const = 0;
  virtual int unk_id() const = 0;
};

}  // namespace ts

// Exported by libts_sentencepiece.so; the caller deletes the result.
extern "C" ts::SpBackend* ts_sentencepiece_new();
