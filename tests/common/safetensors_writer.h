// Writes small .safetensors files (and shard indexes) for tests, with knobs to corrupt them.
// Values are generated independently of models/checkpoint.cc (bit patterns built by hand), so a
// round trip through the reader really checks its decoding.
#pragma once

#include <stdlib.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "nlohmann/json.hpp"

namespace ts::testing {

struct StTensor {
  std::string name;
  std::string dtype;  // "F32", "F16", "BF16", or anything else to test refusals
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes = {};  // raw little-endian payload, written in tensor order
  std::vector<float> values = {};   // exactly what `bytes` decodes to, for round-trip checks
  // Corruption knob: written into the header instead of the real [begin, end].
  std::optional<std::array<int64_t, 2>> data_offsets = std::nullopt;
};

struct StWriteOptions {
  std::optional<uint64_t> header_length = std::nullopt;  // written instead of the real length
  std::optional<std::string> raw_header = std::nullopt;  // replaces the generated JSON header
  std::optional<size_t> truncate_to = std::nullopt;      // the file is cut to this many bytes
  std::map<std::string, std::string> metadata = {};      // "__metadata__"
  // The reference writer pads the header with spaces so the data starts 8-byte aligned; 1 = none.
  size_t header_align = 8;
};

// Non-zero values exactly representable in `dtype` (F32, F16 or BF16), built from sign, exponent
// and mantissa fields: value = +-(1 + m / 2^mbits) * 2^e, e in [-6, 6].
inline StTensor RandomTensor(std::string name, std::string dtype, std::vector<int64_t> shape,
                             uint32_t seed) {
  StTensor t{std::move(name), std::move(dtype), std::move(shape), {}, {}, std::nullopt};
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  std::mt19937 rng(seed);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t sign = rng() & 1u;
    const int e = static_cast<int>(rng() % 13) - 6;
    if (t.dtype == "F32") {
      const uint32_t m = rng() & 0x7fffffu;
      const uint32_t bits = (sign << 31) | static_cast<uint32_t>(e + 127) << 23 | m;
      float f;
      std::memcpy(&f, &bits, 4);
      t.values.push_back(f);
      for (int b = 0; b < 4; ++b) t.bytes.push_back(static_cast<uint8_t>(bits >> (8 * b)));
    } else {
      const bool bf16 = t.dtype == "BF16";
      const int mbits = bf16 ? 7 : 10;
      const uint32_t m = rng() & ((1u << mbits) - 1);
      const uint32_t bias = bf16 ? 127 : 15;
      const uint32_t bits =
          (sign << 15) | static_cast<uint32_t>(e + static_cast<int>(bias)) << mbits | m;
      const float mag = std::ldexp(static_cast<float>((1u << mbits) + m), e - mbits);
      t.values.push_back(sign ? -mag : mag);
      t.bytes.push_back(static_cast<uint8_t>(bits));
      t.bytes.push_back(static_cast<uint8_t>(bits >> 8));
    }
  }
  return t;
}

// The JSON header the writer would produce, before padding. Offsets follow tensor order.
inline std::string SafetensorsHeader(const std::vector<StTensor>& tensors,
                                     const StWriteOptions& options = {}) {
  nlohmann::json header = nlohmann::json::object();
  if (!options.metadata.empty()) header["__metadata__"] = options.metadata;
  int64_t offset = 0;
  for (const StTensor& t : tensors) {
    const int64_t end = offset + static_cast<int64_t>(t.bytes.size());
    std::array<int64_t, 2> offs = t.data_offsets.value_or(std::array<int64_t, 2>{offset, end});
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", offs}};
    offset = end;
  }
  return header.dump();
}

inline bool WriteBytes(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return static_cast<bool>(out);
}

// Returns false when the file could not be written.
inline bool WriteSafetensors(const std::filesystem::path& path,
                             const std::vector<StTensor>& tensors,
                             const StWriteOptions& options = {}) {
  std::string header = options.raw_header.value_or(SafetensorsHeader(tensors, options));
  if (!options.raw_header.has_value() && options.header_align > 1) {
    while ((8 + header.size()) % options.header_align != 0) header.push_back(' ');
  }
  const uint64_t n = options.header_length.value_or(header.size());
  std::string file;
  for (int b = 0; b < 8; ++b) file.push_back(static_cast<char>(n >> (8 * b)));
  file += header;
  for (const StTensor& t : tensors) file.append(t.bytes.begin(), t.bytes.end());
  if (options.truncate_to.has_value() && *options.truncate_to < file.size()) {
    file.resize(*options.truncate_to);
  }
  return WriteBytes(path, file);
}

// model.safetensors.index.json: {"metadata": {...}, "weight_map": {tensor: shard file}}.
inline bool WriteShardIndex(const std::filesystem::path& path,
                            const std::map<std::string, std::string>& weight_map) {
  nlohmann::json j = {{"metadata", nlohmann::json::object()}, {"weight_map", weight_map}};
  return WriteBytes(path, j.dump(2));
}

// A fresh directory under the system temp dir, removed with everything in it on destruction.
class TempDir {
 public:
  explicit TempDir(std::string_view tag = "ts_test") {
    std::string tmpl =
        (std::filesystem::temp_directory_path() / (std::string(tag) + ".XXXXXX")).string();
    if (::mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }  // empty when creation failed
  std::filesystem::path operator/(std::string_view name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

}  // namespace ts::testing
