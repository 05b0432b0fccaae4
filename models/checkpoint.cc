#include "models/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace ts {
namespace {

using json = nlohmann::json;

// The format is little-endian on disk and we read it in place.
static_assert(std::endian::native == std::endian::little, "safetensors mmap needs little-endian");

// The reference implementation caps headers at 100 MB; a larger length means a corrupt file.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

// A read-only private mapping of a whole file, unmapped on destruction.
class MappedFile {
 public:
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::filesystem::path& path) {
    const std::string name = path.string();
    int fd = ::open(name.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      int err = errno;
      std::string msg = absl::StrCat(name, ": cannot open: ", std::strerror(err));
      return err == ENOENT ? absl::NotFoundError(msg) : absl::PermissionDeniedError(msg);
    }
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat(name, ": not a regular file"));
    }
    auto file = std::unique_ptr<MappedFile>(new MappedFile());
    file->size_ = static_cast<size_t>(st.st_size);
    if (file->size_ < 8) {
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": file is ", file->size_, " bytes, shorter than the 8-byte header length"));
    }
    void* p = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    int err = errno;
    ::close(fd);  // the mapping keeps the file alive
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat(name, ": mmap: ", std::strerror(err)));
    }
    file->data_ = p;
    return file;
  }
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(data_, size_);
  }
  const std::byte* data() const { return static_cast<const std::byte*>(data_); }
  size_t size() const { return size_; }

 private:
  MappedFile() = default;
  void* data_ = nullptr;
  size_t size_ = 0;
};

absl::Status TensorError(absl::string_view file, absl::string_view tensor, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": tensor '", tensor, "': ", what));
}

// Reads a JSON non-negative integer that fits in int64.
bool GetNonNegative(const json& v, int64_t* out) {
  if (!v.is_number_unsigned()) return false;  // nlohmann stores every non-negative int unsigned
  uint64_t u = v.get<uint64_t>();
  if (u > static_cast<uint64_t>(INT64_MAX)) return false;
  *out = static_cast<int64_t>(u);
  return true;
}

// Fills everything but `data` (needs the data section's base) and `file`.
// begin is returned separately: it is an offset into the data section.
absl::Status ParseEntry(absl::string_view file, const std::string& name, const json& e,
                        uint64_t data_size, TensorView* t, uint64_t* begin) {
  t->name = name;
  if (!e.is_object()) return TensorError(file, name, "header entry must be an object");
  auto dt = e.find("dtype");
  if (dt == e.end() || !dt->is_string()) return TensorError(file, name, "missing string 'dtype'");
  const std::string dtype = dt->get<std::string>();
  if (dtype == "F32") {
    t->dtype = DType::kF32;
  } else if (dtype == "F16") {
    t->dtype = DType::kF16;
  } else if (dtype == "BF16") {
    t->dtype = DType::kBF16;
  } else {
    return TensorError(file, name, absl::StrCat("unsupported dtype ", dtype, " (F32, F16, BF16)"));
  }

  auto sh = e.find("shape");
  if (sh == e.end() || !sh->is_array()) return TensorError(file, name, "missing array 'shape'");
  uint64_t numel = 1;
  for (const json& d : *sh) {
    int64_t dim;
    if (!GetNonNegative(d, &dim)) {
      return TensorError(
          file, name,
          absl::StrCat("shape dimensions must be non-negative integers, got ", sh->dump()));
    }
    t->shape.push_back(dim);
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dim), &numel)) {
      return TensorError(file, name, absl::StrCat("shape ", sh->dump(), " overflows"));
    }
  }
  uint64_t expected_bytes;
  if (__builtin_mul_overflow(numel, DTypeSize(t->dtype), &expected_bytes)) {
    return TensorError(file, name, absl::StrCat("shape ", sh->dump(), " overflows"));
  }

  auto off = e.find("data_offsets");
  int64_t b = 0, end = 0;
  if (off == e.end() || !off->is_array() || off->size() != 2 || !GetNonNegative((*off)[0], &b) ||
      !GetNonNegative((*off)[1], &end)) {
    return TensorError(file, name, "'data_offsets' must be [begin, end] of non-negative integers");
  }
  if (b > end) {
    return TensorError(file, name, absl::StrCat("data_offsets begin ", b, " > end ", end));
  }
  if (static_cast<uint64_t>(end) > data_size) {
    return TensorError(file, name,
                       absl::StrCat("data_offsets [", b, ", ", end, "] run past the data section (",
                                    data_size, " bytes)"));
  }
  if (static_cast<uint64_t>(end - b) != expected_bytes) {
    return TensorError(file, name,
                       absl::StrCat("data_offsets span ", end - b, " bytes but ", dtype, " shape ",
                                    sh->dump(), " needs ", expected_bytes));
  }
  t->nbytes = static_cast<size_t>(expected_bytes);
  *begin = static_cast<uint64_t>(b);
  return absl::OkStatus();
}

// Validates the header of one mapped file and returns its tensors, pointing into the mapping.
absl::StatusOr<std::vector<TensorView>> ParseSafetensors(const MappedFile& mf,
                                                         const std::filesystem::path& path) {
  const std::string file = path.string();
  uint64_t n;
  std::memcpy(&n, mf.data(), 8);
  if (n > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": header length ", n, " is absurd (limit ", kMaxHeaderBytes, ")"));
  }
  if (n > mf.size() - 8) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": header length ", n,
                                                   " runs past the end of the file (", mf.size(),
                                                   " bytes): truncated?"));
  }
  const char* text = reinterpret_cast<const char*>(mf.data() + 8);
  json header;
  // nlohmann reports syntax errors only through exceptions; they stop here.
  try {
    header = json::parse(text, text + n);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": invalid JSON header: ", e.what()));
  }
  if (!header.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": header must be a JSON object"));
  }

  const uint64_t data_start = 8 + n;
  const uint64_t data_size = mf.size() - data_start;
  std::vector<TensorView> tensors;
  std::vector<uint64_t> begins;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(file, ": __metadata__ must be an object"));
      }
      continue;
    }
    TensorView t;
    uint64_t begin = 0;
    TS_RETURN_IF_ERROR(ParseEntry(file, name, entry, data_size, &t, &begin));
    t.data = mf.data() + data_start + begin;
    t.file = path.filename().string();
    tensors.push_back(std::move(t));
    begins.push_back(begin);
  }

  // Overlap check: sort byte ranges; each non-empty range must start at or after the previous end.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return begins[a] < begins[b]; });
  const TensorView* prev = nullptr;
  uint64_t prev_end = 0;
  for (size_t i : order) {
    if (tensors[i].nbytes == 0) continue;
    if (prev != nullptr && begins[i] < prev_end) {
      return TensorError(file, tensors[i].name,
                         absl::StrCat("data overlaps tensor '", prev->name, "'"));
    }
    prev = &tensors[i];
    prev_end = begins[i] + tensors[i].nbytes;
  }
  return tensors;
}

absl::StatusOr<std::string> ReadText(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot open"));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Shard names come from a file the user downloaded: plain names only, so they stay inside the
// checkpoint directory (Hugging Face never nests shards).
bool IsPlainShardName(const std::string& s) {
  return !s.empty() && s != "." && s != ".." && s.find('/') == std::string::npos;
}

}  // namespace

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

struct Checkpoint::Impl {
  std::vector<std::unique_ptr<MappedFile>> files;
  // std::map: stable addresses for the TensorView pointers callers keep, and sorted Names().
  std::map<std::string, TensorView, std::less<>> tensors;
  size_t total_bytes = 0;

  // Maps and validates one file, then adds its tensors. Duplicates across files are an error.
  absl::Status AddFile(const std::filesystem::path& path) {
    TS_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> mf, MappedFile::Open(path));
    TS_ASSIGN_OR_RETURN(std::vector<TensorView> views, ParseSafetensors(*mf, path));
    for (TensorView& t : views) {
      auto it = tensors.find(t.name);
      if (it != tensors.end()) {
        return TensorError(path.string(), t.name,
                           absl::StrCat("also present in shard '", it->second.file, "'"));
      }
      total_bytes += t.nbytes;
      std::string name = t.name;
      tensors.emplace(std::move(name), std::move(t));
    }
    files.push_back(std::move(mf));
    return absl::OkStatus();
  }

  absl::Status AddIndex(const std::filesystem::path& index_path) {
    const std::string index = index_path.string();
    TS_ASSIGN_OR_RETURN(std::string text, ReadText(index_path));
    json j;
    try {
      j = json::parse(text);
    } catch (const json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(index, ": invalid JSON: ", e.what()));
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(index, ": missing object 'weight_map'"));
    }
    std::map<std::string, std::string> shard_of;      // tensor -> shard
    std::map<std::string, std::string> first_tensor;  // shard -> a tensor it holds, for messages
    for (const auto& [tensor, shard] : j["weight_map"].items()) {
      if (!shard.is_string() || !IsPlainShardName(shard.get<std::string>())) {
        return absl::InvalidArgumentError(absl::StrCat(
            index, ": weight_map['", tensor,
            "'] must be a plain file name in the checkpoint directory, got ", shard.dump()));
      }
      shard_of[tensor] = shard.get<std::string>();
      first_tensor.emplace(shard.get<std::string>(), tensor);
    }
    if (shard_of.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(index, ": weight_map lists no tensors"));
    }
    const std::filesystem::path dir = index_path.parent_path();
    for (const auto& [shard, tensor] : first_tensor) {
      absl::Status s = AddFile(dir / shard);
      if (absl::IsNotFound(s)) {
        return absl::NotFoundError(absl::StrCat(index, ": shard '", shard, "' (holding tensor '",
                                                tensor, "') is missing: ", s.message()));
      }
      TS_RETURN_IF_ERROR(s);
    }
    for (const auto& [tensor, shard] : shard_of) {
      auto it = tensors.find(tensor);
      if (it == tensors.end() || it->second.file != shard) {
        return absl::InvalidArgumentError(absl::StrCat(index, ": tensor '", tensor,
                                                       "' is mapped to shard '", shard,
                                                       "' but that shard does not hold it"));
      }
    }
    return absl::OkStatus();
  }
};

Checkpoint::Checkpoint() : impl_(std::make_unique<Impl>()) {}
Checkpoint::~Checkpoint() = default;

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::OpenFile(
    const std::filesystem::path& file) {
  auto ckpt = std::unique_ptr<Checkpoint>(new Checkpoint());
  TS_RETURN_IF_ERROR(ckpt->impl_->AddFile(file));
  return ckpt;
}

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::filesystem::path& dir) {
  std::error_code ec;
  const std::filesystem::path index = dir / "model.safetensors.index.json";
  if (std::filesystem::exists(index, ec)) {
    auto ckpt = std::unique_ptr<Checkpoint>(new Checkpoint());
    TS_RETURN_IF_ERROR(ckpt->impl_->AddIndex(index));
    return ckpt;
  }
  const std::filesystem::path single = dir / "model.safetensors";
  if (std::filesystem::exists(single, ec)) return OpenFile(single);
  return absl::NotFoundError(absl::StrCat(
      dir.string(), ": no model.safetensors.index.json or model.safetensors in this directory"));
}

const TensorView* Checkpoint::Find(std::string_view name) const {
  auto it = impl_->tensors.find(name);  // transparent comparator: no string copy
  return it == impl_->tensors.end() ? nullptr : &it->second;
}

std::vector<std::string> Checkpoint::Names() const {
  std::vector<std::string> names;
  names.reserve(impl_->tensors.size());
  for (const auto& [name, t] : impl_->tensors) names.push_back(name);
  return names;
}

size_t Checkpoint::total_bytes() const {
  return impl_->total_bytes;
}

float Bf16ToF32(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24 is exact in fp32.
    float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) {  // inf, or NaN with its payload kept
    return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  }
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t F32ToBf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if (std::isnan(f)) {
    // Truncation could clear every payload bit left (making inf); force the quiet bit instead.
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);  // ties go to the even neighbour
  return static_cast<uint16_t>((u + rounding) >> 16);
}

void ConvertToF32(const TensorView& t, float* out) {
  const int64_t n = t.numel();
  // memcpy per element: data sits wherever the header put it and need not be aligned.
  switch (t.dtype) {
    case DType::kF32:
      std::memcpy(out, t.data, static_cast<size_t>(n) * 4);
      return;
    case DType::kBF16:
    case DType::kF16: {
      const bool bf16 = t.dtype == DType::kBF16;
      for (int64_t i = 0; i < n; ++i) {
        uint16_t bits;
        std::memcpy(&bits, t.data + 2 * i, 2);
        out[i] = bf16 ? Bf16ToF32(bits) : F16ToF32(bits);
      }
      return;
    }
  }
}

}  // namespace ts
