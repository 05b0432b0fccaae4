#include "models/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "nlohmann/json.hpp"
#include "tests/common/safetensors_writer.h"

namespace ts {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using json = nlohmann::json;

// As published with meta-llama/Llama-3.2-1B (transformers 4.45 era): top-level rope_theta,
// rope_scaling with rope_type llama3, torch_dtype, a list of eos ids.
constexpr char kLlama32OldConfig[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

// What transformers 5.x's LlamaConfig.to_json_string() writes: rope_parameters and dtype.
constexpr char kTransformers5Config[] = R"({
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "dtype": "float16",
  "eos_token_id": 2,
  "head_dim": 16,
  "hidden_act": "silu",
  "hidden_size": 64,
  "initializer_range": 0.02,
  "intermediate_size": 160,
  "max_position_embeddings": 512,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 4,
  "num_hidden_layers": 3,
  "num_key_value_heads": 2,
  "pad_token_id": null,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-06,
  "rope_parameters": {
    "rope_theta": 10000.0,
    "rope_type": "default"
  },
  "tie_word_embeddings": false,
  "transformers_version": "5.24.0",
  "use_cache": true,
  "vocab_size": 100
})";

TEST(ConfigTest, ParsesLlama32PublishedConfig) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kLlama32OldConfig);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->hidden_size, 2048);
  EXPECT_EQ(c->intermediate_size, 8192);
  EXPECT_EQ(c->num_layers, 16);
  EXPECT_EQ(c->num_heads, 32);
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->vocab_size, 128256);
  EXPECT_EQ(c->max_position_embeddings, 131072);
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-5f);
  EXPECT_FLOAT_EQ(c->rope_theta, 500000.0f);
  EXPECT_EQ(c->rope_scaling.type, RopeType::kLlama3);
  EXPECT_FLOAT_EQ(c->rope_scaling.factor, 32.0f);
  EXPECT_FLOAT_EQ(c->rope_scaling.low_freq_factor, 1.0f);
  EXPECT_FLOAT_EQ(c->rope_scaling.high_freq_factor, 4.0f);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->dtype, DType::kBF16);
  EXPECT_THAT(c->bos_token_ids, ElementsAre(128000));
  EXPECT_THAT(c->eos_token_ids, ElementsAre(128001, 128008, 128009));
}

TEST(ConfigTest, ParsesTransformers5Config) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kTransformers5Config);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->hidden_size, 64);
  EXPECT_EQ(c->intermediate_size, 160);
  EXPECT_EQ(c->num_layers, 3);
  EXPECT_EQ(c->num_heads, 4);
  EXPECT_EQ(c->num_kv_heads, 2);
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_EQ(c->vocab_size, 100);
  EXPECT_EQ(c->max_position_embeddings, 512);
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-6f);
  EXPECT_FLOAT_EQ(c->rope_theta, 10000.0f);
  EXPECT_EQ(c->rope_scaling.type, RopeType::kDefault);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->dtype, DType::kF16);
  EXPECT_THAT(c->bos_token_ids, ElementsAre(1));
  EXPECT_THAT(c->eos_token_ids, ElementsAre(2));
}

TEST(ConfigTest, Transformers5Llama3RopeParameters) {
  json j = json::parse(kTransformers5Config);
  j["rope_parameters"] = {{"rope_theta", 500000.0},  {"rope_type", "llama3"},
                          {"factor", 8.0},           {"low_freq_factor", 1.0},
                          {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 256}};
  j["dtype"] = "bfloat16";
  absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FLOAT_EQ(c->rope_theta, 500000.0f);
  EXPECT_EQ(c->rope_scaling.type, RopeType::kLlama3);
  EXPECT_FLOAT_EQ(c->rope_scaling.factor, 8.0f);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 256);
  EXPECT_EQ(c->dtype, DType::kBF16);
}

TEST(ConfigTest, OldStyleTypeKeyAndNullScaling) {
  json j = json::parse(kLlama32OldConfig);
  j["rope_scaling"] = {{"type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 2.0},
                       {"high_freq_factor", 5.0},
                       {"original_max_position_embeddings", 4096}};
  absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeType::kLlama3);
  EXPECT_FLOAT_EQ(c->rope_scaling.low_freq_factor, 2.0f);
  EXPECT_FLOAT_EQ(c->rope_scaling.high_freq_factor, 5.0f);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 4096);

  j["rope_scaling"] = nullptr;
  c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeType::kDefault);
  EXPECT_FLOAT_EQ(c->rope_theta, 500000.0f);
}

TEST(ConfigTest, DefaultsWhenOptionalKeysAbsent) {
  const json j = {{"hidden_size", 48},       {"intermediate_size", 96},
                  {"num_hidden_layers", 2},  {"num_attention_heads", 6},
                  {"vocab_size", 50},        {"max_position_embeddings", 64},
                  {"bos_token_id", nullptr}, {"num_key_value_heads", nullptr}};
  absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_kv_heads, 6);
  EXPECT_EQ(c->head_dim, 8);
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-6f);
  EXPECT_FLOAT_EQ(c->rope_theta, 10000.0f);
  EXPECT_EQ(c->rope_scaling.type, RopeType::kDefault);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->dtype, DType::kF32);
  EXPECT_TRUE(c->bos_token_ids.empty());
  EXPECT_TRUE(c->eos_token_ids.empty());
}

TEST(ConfigTest, ExplicitHeadDimMayDifferFromHiddenOverHeads) {
  json j = json::parse(kTransformers5Config);
  j["head_dim"] = 24;  // 4 heads x 24 = 96 != hidden 64, legal in transformers' Llama
  absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 24);
}

struct Refusal {
  std::string label;
  json patch;             // merged into the transformers-5 config; a null value erases the key
  std::string key;        // must appear in the message
  std::string also = "";  // e.g. the offending value
};

void PrintTo(const Refusal& r, std::ostream* os) {
  *os << r.label;
}

class ConfigRefusalTest : public ::testing::TestWithParam<Refusal> {};

TEST_P(ConfigRefusalTest, NamesTheKey) {
  const Refusal& r = GetParam();
  json j = json::parse(kTransformers5Config);
  j.merge_patch(r.patch);
  absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump(), "ckpt/config.json");
  ASSERT_FALSE(c.ok()) << r.label << " was accepted";
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("ckpt/config.json"));
  EXPECT_THAT(c.status().message(), HasSubstr(r.key));
  EXPECT_THAT(c.status().message(), HasSubstr(r.also));
}

json Llama3Rope(json overrides) {
  json rope = {{"rope_theta", 500000.0},  {"rope_type", "llama3"},
               {"factor", 32.0},          {"low_freq_factor", 1.0},
               {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  if (!overrides.is_null()) rope.merge_patch(overrides);  // json({}) is null, not {}
  return rope;
}

INSTANTIATE_TEST_SUITE_P(
    All, ConfigRefusalTest,
    ::testing::Values(
        Refusal{"model_type", {{"model_type", "mistral"}}, "model_type", "mistral"},
        Refusal{"sliding_window", {{"sliding_window", 4096}}, "sliding_window"},
        Refusal{"attention_bias", {{"attention_bias", true}}, "attention_bias"},
        Refusal{"mlp_bias", {{"mlp_bias", true}}, "mlp_bias"},
        Refusal{"hidden_act", {{"hidden_act", "gelu"}}, "hidden_act", "gelu"},
        Refusal{"head_dim_indivisible",
                {{"head_dim", nullptr}, {"hidden_size", 66}},
                "head_dim",
                "not divisible"},
        Refusal{"head_dim_odd", {{"head_dim", 15}}, "head_dim"},
        Refusal{"head_dim_zero", {{"head_dim", 0}}, "head_dim"},
        Refusal{"kv_heads_indivisible", {{"num_key_value_heads", 3}}, "num_key_value_heads"},
        Refusal{"hidden_zero", {{"hidden_size", 0}}, "hidden_size"},
        Refusal{"intermediate_negative", {{"intermediate_size", -160}}, "intermediate_size"},
        Refusal{"layers_zero", {{"num_hidden_layers", 0}}, "num_hidden_layers"},
        Refusal{"heads_negative", {{"num_attention_heads", -4}}, "num_attention_heads"},
        Refusal{"vocab_zero", {{"vocab_size", 0}}, "vocab_size"},
        Refusal{"max_pos_negative", {{"max_position_embeddings", -1}}, "max_position_embeddings"},
        Refusal{"missing_hidden", {{"hidden_size", nullptr}}, "hidden_size", "missing"},
        Refusal{"missing_intermediate", {{"intermediate_size", nullptr}}, "intermediate_size"},
        Refusal{"missing_layers", {{"num_hidden_layers", nullptr}}, "num_hidden_layers"},
        Refusal{"missing_heads", {{"num_attention_heads", nullptr}}, "num_attention_heads"},
        Refusal{"missing_vocab", {{"vocab_size", nullptr}}, "vocab_size"},
        Refusal{
            "missing_max_pos", {{"max_position_embeddings", nullptr}}, "max_position_embeddings"},
        Refusal{"hidden_string", {{"hidden_size", "64"}}, "hidden_size", "integer"},
        Refusal{"hidden_fraction", {{"hidden_size", 64.5}}, "hidden_size"},
        Refusal{"eps_negative", {{"rms_norm_eps", -1.0}}, "rms_norm_eps"},
        Refusal{"tie_string", {{"tie_word_embeddings", "yes"}}, "tie_word_embeddings"},
        Refusal{"dtype", {{"dtype", "float8_e4m3fn"}}, "dtype", "float8_e4m3fn"},
        Refusal{"bos_string", {{"bos_token_id", "<s>"}}, "bos_token_id"},
        Refusal{"eos_negative", {{"eos_token_id", json::array({2, -1})}}, "eos_token_id"},
        Refusal{"rope_linear",
                {{"rope_parameters", {{"rope_type", "linear"}, {"factor", 2.0}}}},
                "rope_parameters.rope_type",
                "linear"},
        Refusal{"rope_yarn",
                {{"rope_parameters", {{"rope_type", "yarn"}}}},
                "rope_parameters.rope_type",
                "yarn"},
        Refusal{"rope_dynamic",
                {{"rope_parameters", {{"rope_type", "dynamic"}}}},
                "rope_parameters.rope_type",
                "dynamic"},
        Refusal{"rope_llama3_no_factor",
                {{"rope_parameters", Llama3Rope({{"factor", nullptr}})}},
                "rope_parameters.factor"},
        Refusal{"rope_llama3_no_original",
                {{"rope_parameters", Llama3Rope({{"original_max_position_embeddings", nullptr}})}},
                "rope_parameters.original_max_position_embeddings"},
        Refusal{"rope_llama3_equal_freq_factors",
                {{"rope_parameters", Llama3Rope({{"high_freq_factor", 1.0}})}},
                "rope_parameters.high_freq_factor"},
        Refusal{"rope_theta_disagrees",
                {{"rope_theta", 20000.0}},
                "rope_parameters.rope_theta",
                "20000"},
        Refusal{"old_rope_type_key",
                {{"rope_parameters", nullptr},
                 {"rope_scaling", {{"type", "dynamic"}, {"factor", 2.0}}}},
                "rope_scaling.type",
                "dynamic"},
        Refusal{"old_rope_type_yarn",
                {{"rope_parameters", nullptr}, {"rope_scaling", {{"rope_type", "yarn"}}}},
                "rope_scaling.rope_type",
                "yarn"},
        Refusal{"old_rope_scaling_not_object",
                {{"rope_parameters", nullptr}, {"rope_scaling", 4.0}},
                "rope_scaling"},
        Refusal{"both_dialects_disagree",
                {{"rope_scaling", Llama3Rope({})}},
                "rope_scaling",
                "disagrees"}),
    [](const ::testing::TestParamInfo<Refusal>& info) { return info.param.label; });

TEST(ConfigTest, SyntaxErrorNamesTheFile) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(R"({"hidden_size": 64,)", "m/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("m/config.json"));
  EXPECT_THAT(c.status().message(), HasSubstr("invalid JSON"));
  c = ParseModelConfig("[1, 2]", "m/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("m/config.json"));
}

TEST(ConfigTest, GenerationConfigUnionsIds) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kLlama32OldConfig);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(MergeGenerationConfig(R"({"bos_token_id": 128000,
      "eos_token_id": [128009, 128001, 128256], "do_sample": true, "temperature": 0.6})",
                                    &*c)
                  .ok());
  EXPECT_THAT(c->bos_token_ids, ElementsAre(128000));
  EXPECT_THAT(c->eos_token_ids, ElementsAre(128001, 128008, 128009, 128256));
  ASSERT_TRUE(MergeGenerationConfig(R"({"eos_token_id": 7, "bos_token_id": null})", &*c).ok());
  EXPECT_THAT(c->eos_token_ids, ElementsAre(128001, 128008, 128009, 128256, 7));
}

TEST(ConfigTest, BadGenerationConfigLeavesConfigUntouched) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kTransformers5Config);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::Status s = MergeGenerationConfig(R"({"eos_token_id": [3, "x"]})", &*c, "d/gen.json");
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("d/gen.json"));
  EXPECT_THAT(s.message(), HasSubstr("eos_token_id"));
  EXPECT_THAT(c->eos_token_ids, ElementsAre(2));
  s = MergeGenerationConfig("{oops", &*c, "d/gen.json");
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("d/gen.json"));
}

TEST(ConfigTest, LoadModelConfigReadsBothFiles) {
  testing::TempDir dir("ts_config");
  ASSERT_FALSE(dir.path().empty());
  ASSERT_TRUE(testing::WriteBytes(dir / "config.json", kLlama32OldConfig));
  absl::StatusOr<ModelConfig> c = LoadModelConfig(dir.path());
  ASSERT_TRUE(c.ok()) << c.status();  // generation_config.json is optional
  EXPECT_THAT(c->eos_token_ids, ElementsAre(128001, 128008, 128009));

  ASSERT_TRUE(testing::WriteBytes(dir / "generation_config.json", R"({"eos_token_id": 5})"));
  c = LoadModelConfig(dir.path());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->eos_token_ids, ElementsAre(128001, 128008, 128009, 5));

  ASSERT_TRUE(testing::WriteBytes(dir / "generation_config.json", "{"));
  c = LoadModelConfig(dir.path());
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("generation_config.json"));

  ASSERT_TRUE(testing::WriteBytes(dir / "config.json", R"({"hidden_size": })"));
  c = LoadModelConfig(dir.path());
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr((dir / "config.json").string()));
}

TEST(ConfigTest, LoadModelConfigMissingFile) {
  testing::TempDir dir("ts_config");
  absl::StatusOr<ModelConfig> c = LoadModelConfig(dir.path());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr("config.json"));
}

}  // namespace
}  // namespace ts
