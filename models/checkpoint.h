// Safetensors checkpoints read by mmap: a single model.safetensors or shards listed in
// model.safetensors.index.json. Every header is validated before any tensor is exposed: header
// length against file size, JSON syntax, dtype, shape x dtype == byte length, offsets inside the
// data section and not overlapping. Errors name the file and the tensor; nothing crashes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "models/config.h"

namespace ts {

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  // [nbytes], little-endian, points into the mmap; valid while the Checkpoint lives. Not
  // necessarily aligned to the dtype (the format does not promise it): read via memcpy.
  const std::byte* data = nullptr;
  size_t nbytes = 0;
  std::string file;  // shard file name, for error messages
  int64_t numel() const;
};

class Checkpoint {
 public:
  // Opens <dir>/model.safetensors.index.json if present, else <dir>/model.safetensors.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::filesystem::path& dir);
  // Opens one .safetensors file.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> OpenFile(const std::filesystem::path& file);
  ~Checkpoint();
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  const TensorView* Find(std::string_view name) const;  // nullptr when absent
  std::vector<std::string> Names() const;               // sorted
  size_t total_bytes() const;                           // sum of tensor bytes

 private:
  Checkpoint();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Upcasts any supported dtype to fp32. out: [t.numel()].
void ConvertToF32(const TensorView& t, float* out);
float Bf16ToF32(uint16_t bits);
float F16ToF32(uint16_t bits);
uint16_t F32ToBf16(float f);  // round-to-nearest-even

}  // namespace ts
