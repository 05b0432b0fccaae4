#include "models/config.h"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <optional>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace ts {
namespace {

using json = nlohmann::json;

// Every error carries "<file>: <key>: ..." so a user can fix the file without reading our code.
absl::Status Invalid(absl::string_view source, absl::string_view key, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": ", key, ": ", what));
}

absl::StatusOr<json> ParseJsonObject(std::string_view text, absl::string_view source) {
  json j;
  // nlohmann reports syntax errors only through exceptions; they stop here.
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": invalid JSON: ", e.what()));
  }
  if (!j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": top level must be a JSON object"));
  }
  return j;
}

// Null and absent are the same to transformers: both mean "use the default".
const json* Lookup(const json& obj, absl::string_view key) {
  auto it = obj.find(std::string(key));
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

// `path` is the key as the user sees it (e.g. "rope_scaling.factor").
absl::StatusOr<std::optional<int64_t>> OptInt(const json& obj, absl::string_view key,
                                              absl::string_view path, absl::string_view source) {
  const json* v = Lookup(obj, key);
  if (v == nullptr) return std::nullopt;
  if (v->is_number_integer()) return v->get<int64_t>();
  // Some exporters write integral floats ("8192.0"); accept those, refuse anything fractional.
  if (v->is_number_float()) {
    double d = v->get<double>();
    if (d == static_cast<double>(static_cast<int64_t>(d))) return static_cast<int64_t>(d);
  }
  return Invalid(source, path, absl::StrCat("must be an integer, got ", v->dump()));
}

absl::StatusOr<int> RequiredPositiveInt(const json& obj, absl::string_view key,
                                        absl::string_view path, absl::string_view source) {
  TS_ASSIGN_OR_RETURN(std::optional<int64_t> v, OptInt(obj, key, path, source));
  if (!v.has_value()) return Invalid(source, path, "required key is missing");
  if (*v <= 0 || *v > INT32_MAX) {
    return Invalid(source, path, absl::StrCat("must be a positive int32, got ", *v));
  }
  return static_cast<int>(*v);
}

absl::StatusOr<std::optional<double>> OptNumber(const json& obj, absl::string_view key,
                                                absl::string_view path, absl::string_view source) {
  const json* v = Lookup(obj, key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_number())
    return Invalid(source, path, absl::StrCat("must be a number, got ", v->dump()));
  return v->get<double>();
}

absl::StatusOr<std::optional<bool>> OptBool(const json& obj, absl::string_view key,
                                            absl::string_view source) {
  const json* v = Lookup(obj, key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_boolean())
    return Invalid(source, key, absl::StrCat("must be a boolean, got ", v->dump()));
  return v->get<bool>();
}

absl::StatusOr<std::optional<std::string>> OptString(const json& obj, absl::string_view key,
                                                     absl::string_view path,
                                                     absl::string_view source) {
  const json* v = Lookup(obj, key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_string())
    return Invalid(source, path, absl::StrCat("must be a string, got ", v->dump()));
  return v->get<std::string>();
}

// Token ids come as an int, a list of ints, or null. Appends to `ids` without duplicates.
absl::Status AppendTokenIds(const json& obj, absl::string_view key, absl::string_view source,
                            std::vector<int32_t>* ids) {
  const json* v = Lookup(obj, key);
  if (v == nullptr) return absl::OkStatus();
  auto add = [&](const json& e) -> absl::Status {
    if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() > INT32_MAX) {
      return Invalid(source, key,
                     absl::StrCat("token ids must be non-negative integers, got ", e.dump()));
    }
    int32_t id = static_cast<int32_t>(e.get<int64_t>());
    if (std::find(ids->begin(), ids->end(), id) == ids->end()) ids->push_back(id);
    return absl::OkStatus();
  };
  if (v->is_array()) {
    for (const json& e : *v) TS_RETURN_IF_ERROR(add(e));
    return absl::OkStatus();
  }
  return add(*v);
}

absl::StatusOr<DType> ParseDeclaredDType(const json& obj, absl::string_view source) {
  // transformers 5.x writes `dtype`; earlier versions `torch_dtype`. Either may be present.
  for (absl::string_view key : {"dtype", "torch_dtype"}) {
    TS_ASSIGN_OR_RETURN(std::optional<std::string> s, OptString(obj, key, key, source));
    if (!s.has_value()) continue;
    if (*s == "bfloat16") return DType::kBF16;
    if (*s == "float16") return DType::kF16;
    if (*s == "float32") return DType::kF32;
    return Invalid(source, key,
                   absl::StrCat("unsupported dtype \"", *s, "\" (bfloat16, float16, float32)"));
  }
  return DType::kF32;
}

// `rope` is the rope_parameters / rope_scaling object; `prefix` is its key for messages.
absl::Status ParseRopeScaling(const json& rope, absl::string_view prefix, absl::string_view source,
                              RopeScaling* out) {
  if (!rope.is_object()) {
    return Invalid(source, prefix, absl::StrCat("must be an object or null, got ", rope.dump()));
  }
  // Llama 3.0-era configs spell the key `type`; later ones `rope_type`.
  std::string type_key = absl::StrCat(prefix, ".rope_type");
  TS_ASSIGN_OR_RETURN(std::optional<std::string> type,
                      OptString(rope, "rope_type", type_key, source));
  if (!type.has_value()) {
    type_key = absl::StrCat(prefix, ".type");
    TS_ASSIGN_OR_RETURN(type, OptString(rope, "type", type_key, source));
  }
  if (!type.has_value() || *type == "default") {
    out->type = RopeType::kDefault;
    return absl::OkStatus();
  }
  if (*type != "llama3") {
    return Invalid(source, type_key,
                   absl::StrCat("unsupported rope type \"", *type, "\" (default, llama3)"));
  }
  out->type = RopeType::kLlama3;
  auto number = [&](absl::string_view key, float* dst) -> absl::Status {
    std::string path = absl::StrCat(prefix, ".", key);
    TS_ASSIGN_OR_RETURN(std::optional<double> v, OptNumber(rope, key, path, source));
    if (!v.has_value()) return Invalid(source, path, "required for rope type llama3");
    if (!(*v > 0)) return Invalid(source, path, absl::StrCat("must be positive, got ", *v));
    *dst = static_cast<float>(*v);
    return absl::OkStatus();
  };
  TS_RETURN_IF_ERROR(number("factor", &out->factor));
  TS_RETURN_IF_ERROR(number("low_freq_factor", &out->low_freq_factor));
  TS_RETURN_IF_ERROR(number("high_freq_factor", &out->high_freq_factor));
  std::string orig_path = absl::StrCat(prefix, ".original_max_position_embeddings");
  TS_ASSIGN_OR_RETURN(
      out->original_max_position_embeddings,
      RequiredPositiveInt(rope, "original_max_position_embeddings", orig_path, source));
  // The llama3 ramp divides by (high - low): equal factors would make NaN frequencies.
  if (out->high_freq_factor <= out->low_freq_factor) {
    return Invalid(source, absl::StrCat(prefix, ".high_freq_factor"),
                   absl::StrCat("must exceed low_freq_factor (", out->low_freq_factor, "), got ",
                                out->high_freq_factor));
  }
  return absl::OkStatus();
}

absl::Status ParseRope(const json& j, absl::string_view source, ModelConfig* c) {
  TS_ASSIGN_OR_RETURN(std::optional<double> top_theta,
                      OptNumber(j, "rope_theta", "rope_theta", source));
  const json* params = Lookup(j, "rope_parameters");  // transformers 5.x
  const json* scaling = Lookup(j, "rope_scaling");    // Llama 3.x published checkpoints
  std::optional<double> theta = top_theta;
  if (params != nullptr) {
    TS_RETURN_IF_ERROR(ParseRopeScaling(*params, "rope_parameters", source, &c->rope_scaling));
    // A config carried across transformers versions may hold both; only a disagreement is fatal.
    if (scaling != nullptr) {
      RopeScaling old;
      TS_RETURN_IF_ERROR(ParseRopeScaling(*scaling, "rope_scaling", source, &old));
      const RopeScaling& now = c->rope_scaling;
      if (old.type != now.type || old.factor != now.factor ||
          old.low_freq_factor != now.low_freq_factor ||
          old.high_freq_factor != now.high_freq_factor ||
          old.original_max_position_embeddings != now.original_max_position_embeddings) {
        return Invalid(source, "rope_scaling", "disagrees with rope_parameters");
      }
    }
    TS_ASSIGN_OR_RETURN(std::optional<double> inner,
                        OptNumber(*params, "rope_theta", "rope_parameters.rope_theta", source));
    if (inner.has_value() && top_theta.has_value() && *inner != *top_theta) {
      return Invalid(source, "rope_parameters.rope_theta",
                     absl::StrCat(*inner, " disagrees with top-level rope_theta ", *top_theta));
    }
    if (inner.has_value()) theta = inner;
  } else if (scaling != nullptr) {
    TS_RETURN_IF_ERROR(ParseRopeScaling(*scaling, "rope_scaling", source, &c->rope_scaling));
  }
  if (theta.has_value()) {
    if (!(*theta > 0))
      return Invalid(source, "rope_theta", absl::StrCat("must be positive, got ", *theta));
    c->rope_theta = static_cast<float>(*theta);
  }
  return absl::OkStatus();
}

// Options that change the math of a Llama layer. We refuse them rather than compute wrongly.
absl::Status RefuseUnsupported(const json& j, absl::string_view source) {
  TS_ASSIGN_OR_RETURN(std::optional<std::string> model_type,
                      OptString(j, "model_type", "model_type", source));
  if (model_type.has_value() && *model_type != "llama") {
    return Invalid(source, "model_type", absl::StrCat("unsupported \"", *model_type, "\" (llama)"));
  }
  if (const json* sw = Lookup(j, "sliding_window"); sw != nullptr) {
    return Invalid(source, "sliding_window",
                   absl::StrCat("sliding-window attention is not supported, got ", sw->dump()));
  }
  for (absl::string_view key : {"attention_bias", "mlp_bias"}) {
    TS_ASSIGN_OR_RETURN(std::optional<bool> bias, OptBool(j, key, source));
    if (bias.value_or(false)) return Invalid(source, key, "bias terms are not supported");
  }
  TS_ASSIGN_OR_RETURN(std::optional<std::string> act,
                      OptString(j, "hidden_act", "hidden_act", source));
  if (act.has_value() && *act != "silu") {
    return Invalid(source, "hidden_act", absl::StrCat("unsupported \"", *act, "\" (silu)"));
  }
  return absl::OkStatus();
}

absl::Status ParseShapes(const json& j, absl::string_view source, ModelConfig* c) {
  auto req = [&](absl::string_view key, int* dst) -> absl::Status {
    TS_ASSIGN_OR_RETURN(*dst, RequiredPositiveInt(j, key, key, source));
    return absl::OkStatus();
  };
  TS_RETURN_IF_ERROR(req("hidden_size", &c->hidden_size));
  TS_RETURN_IF_ERROR(req("intermediate_size", &c->intermediate_size));
  TS_RETURN_IF_ERROR(req("num_hidden_layers", &c->num_layers));
  TS_RETURN_IF_ERROR(req("num_attention_heads", &c->num_heads));
  TS_RETURN_IF_ERROR(req("vocab_size", &c->vocab_size));
  TS_RETURN_IF_ERROR(req("max_position_embeddings", &c->max_position_embeddings));

  c->num_kv_heads = c->num_heads;
  if (Lookup(j, "num_key_value_heads") != nullptr) {
    TS_RETURN_IF_ERROR(req("num_key_value_heads", &c->num_kv_heads));
  }
  if (c->num_heads % c->num_kv_heads != 0) {
    return Invalid(
        source, "num_key_value_heads",
        absl::StrCat(c->num_kv_heads, " does not divide num_attention_heads ", c->num_heads));
  }
  if (Lookup(j, "head_dim") != nullptr) {
    TS_RETURN_IF_ERROR(req("head_dim", &c->head_dim));
  } else {
    if (c->hidden_size % c->num_heads != 0) {
      return Invalid(source, "head_dim",
                     absl::StrCat("absent, and hidden_size ", c->hidden_size,
                                  " is not divisible by num_attention_heads ", c->num_heads));
    }
    c->head_dim = c->hidden_size / c->num_heads;
  }
  // RoPE rotates pairs of dimensions.
  if (c->head_dim % 2 != 0) {
    return Invalid(source, "head_dim", absl::StrCat("must be even for RoPE, got ", c->head_dim));
  }
  if (static_cast<int64_t>(c->head_dim) * c->num_heads > INT32_MAX) {
    return Invalid(source, "head_dim", "head_dim * num_attention_heads overflows int32");
  }
  TS_ASSIGN_OR_RETURN(std::optional<double> eps,
                      OptNumber(j, "rms_norm_eps", "rms_norm_eps", source));
  if (eps.has_value()) {
    if (!(*eps > 0))
      return Invalid(source, "rms_norm_eps", absl::StrCat("must be positive, got ", *eps));
    c->rms_norm_eps = static_cast<float>(*eps);
  }
  TS_ASSIGN_OR_RETURN(std::optional<bool> tie, OptBool(j, "tie_word_embeddings", source));
  c->tie_word_embeddings = tie.value_or(false);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot open"));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path.string(), ": read failed"));
  return ss.str();
}

}  // namespace

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
  }
  return "?";
}

size_t DTypeSize(DType t) {
  return t == DType::kF32 ? 4 : 2;
}

absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text,
                                             std::string_view source_name) {
  const absl::string_view source(source_name.data(), source_name.size());
  TS_ASSIGN_OR_RETURN(json j, ParseJsonObject(json_text, source));
  ModelConfig c;
  TS_RETURN_IF_ERROR(RefuseUnsupported(j, source));
  TS_RETURN_IF_ERROR(ParseShapes(j, source, &c));
  TS_RETURN_IF_ERROR(ParseRope(j, source, &c));
  TS_ASSIGN_OR_RETURN(c.dtype, ParseDeclaredDType(j, source));
  TS_RETURN_IF_ERROR(AppendTokenIds(j, "bos_token_id", source, &c.bos_token_ids));
  TS_RETURN_IF_ERROR(AppendTokenIds(j, "eos_token_id", source, &c.eos_token_ids));
  return c;
}

absl::Status MergeGenerationConfig(std::string_view json_text, ModelConfig* config,
                                   std::string_view source_name) {
  const absl::string_view source(source_name.data(), source_name.size());
  TS_ASSIGN_OR_RETURN(json j, ParseJsonObject(json_text, source));
  // Parse into copies so a bad file leaves *config untouched.
  std::vector<int32_t> bos = config->bos_token_ids, eos = config->eos_token_ids;
  TS_RETURN_IF_ERROR(AppendTokenIds(j, "bos_token_id", source, &bos));
  TS_RETURN_IF_ERROR(AppendTokenIds(j, "eos_token_id", source, &eos));
  config->bos_token_ids = std::move(bos);
  config->eos_token_ids = std::move(eos);
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::filesystem::path& dir) {
  const std::filesystem::path config_path = dir / "config.json";
  TS_ASSIGN_OR_RETURN(std::string text, ReadFile(config_path));
  TS_ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(text, config_path.string()));
  const std::filesystem::path gen_path = dir / "generation_config.json";
  std::error_code ec;
  if (std::filesystem::exists(gen_path, ec)) {
    TS_ASSIGN_OR_RETURN(std::string gen, ReadFile(gen_path));
    TS_RETURN_IF_ERROR(MergeGenerationConfig(gen, &config, gen_path.string()));
  }
  return config;
}

}  // namespace ts
