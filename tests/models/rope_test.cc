// RopeInvFreq (models/rope.h) against values transformers 5.24 computed
// (LlamaRotaryEmbedding(config).inv_freq), for the default rope and llama3 scaling in Llama 3.2 1B
// (head_dim 64, factor 32) and Llama 3.1 8B (head_dim 128, factor 8) shapes. Host-only: runs
// without a GPU. Regenerate: for each config below, print([float.hex(x) for x in
//   transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(LlamaConfig(...)).inv_freq]).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "models/rope.h"

namespace ts {
namespace {

// LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_theta=10000.0)
const std::vector<float> kDefaultD64 = {
    0x1p+0f,         0x1.7ff222p-1f,  0x1.1feb34p-1f,  0x1.afd136p-2f,  0x1.43d136p-2f,
    0x1.e5a846p-3f,  0x1.6c310ep-3f,  0x1.111aeep-3f,  0x1.99999ap-4f,  0x1.33281ap-4f,
    0x1.ccab84p-5f,  0x1.59742ap-5f,  0x1.030dc6p-5f,  0x1.84869ep-6f,  0x1.235a72p-6f,
    0x1.b4f7e4p-7f,  0x1.47ae14p-7f,  0x1.eb736p-8f,   0x1.708938p-8f,  0x1.145ceep-8f,
    0x1.9e7c7p-9f,   0x1.36d21ap-9f,  0x1.d22a5p-10f,  0x1.5d931cp-10f, 0x1.0624dep-10f,
    0x1.892918p-11f, 0x1.26d42cp-11f, 0x1.ba2e4ap-12f, 0x1.4b96cp-12f,  0x1.f1502ap-13f,
    0x1.74eea6p-13f, 0x1.17a8e4p-13f};
// ... head_dim=64, rope_theta=500000.0, rope_scaling={rope_type: llama3, factor: 32.0,
//     low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192}
const std::vector<float> kLlama3D64 = {
    0x1p+0f,         0x1.53c38cp-1f,  0x1.c2ef78p-2f,  0x1.2b3dc6p-2f,  0x1.8d276p-3f,
    0x1.078d4p-3f,   0x1.5dc95ap-4f,  0x1.d03ccep-5f,  0x1.34119p-5f,   0x1.98de92p-6f,
    0x1.0f5386p-6f,  0x1.681adap-7f,  0x1.ddee9ep-8f,  0x1.3d2804p-8f,  0x1.a4ee4p-9f,
    0x1.524f36p-10f, 0x1.c26c4p-12f,  0x1.9731eep-14f, 0x1.46831ap-16f, 0x1.b15902p-17f,
    0x1.1f91fp-17f,  0x1.7da9e8p-18f, 0x1.fa8b86p-19f, 0x1.5024d6p-19f, 0x1.be2188p-20f,
    0x1.280d96p-20f, 0x1.88ec2p-21f,  0x1.04be68p-21f, 0x1.5a0f4ep-22f, 0x1.cb4a9ap-23f,
    0x1.30c94ep-23f, 0x1.94836p-24f};
// ... head_dim=128, rope_theta=500000.0, the same llama3 scaling with factor 8.0
const std::vector<float> kLlama3D128 = {
    0x1p+0f,         0x1.a11582p-1f,  0x1.53c38cp-1f,  0x1.14c708p-1f,  0x1.c2ef78p-2f,
    0x1.6f56fap-2f,  0x1.2b3dc6p-2f,  0x1.e788c2p-3f,  0x1.8d276p-3f,   0x1.43874p-3f,
    0x1.078d4p-3f,   0x1.ad6338p-4f,  0x1.5dc95ap-4f,  0x1.1cf13p-4f,   0x1.d03ccep-5f,
    0x1.7a2d08p-5f,  0x1.34119p-5f,   0x1.f5ea7ep-6f,  0x1.98de92p-6f,  0x1.4d1272p-6f,
    0x1.0f5386p-6f,  0x1.ba0dd8p-7f,  0x1.681adap-7f,  0x1.2558fep-7f,  0x1.ddee9ep-8f,
    0x1.8554ecp-8f,  0x1.3d2804p-8f,  0x1.025c6ap-8f,  0x1.a4ee4p-9f,   0x1.1bfa0cp-9f,
    0x1.67a23ap-10f, 0x1.c12f3cp-11f, 0x1.132ba4p-11f, 0x1.47e21p-12f,  0x1.765ba4p-13f,
    0x1.90d10cp-14f, 0x1.46831ap-14f, 0x1.09fb7ep-14f, 0x1.b15902p-15f, 0x1.610332p-15f,
    0x1.1f91fp-15f,  0x1.d484dep-16f, 0x1.7da9e8p-16f, 0x1.36e8eap-16f, 0x1.fa8b86p-17f,
    0x1.9ca3eap-17f, 0x1.5024d6p-17f, 0x1.11d41ep-17f, 0x1.be2188p-18f, 0x1.6b6d0ep-18f,
    0x1.280d96p-18f, 0x1.e257p-19f,   0x1.88ec2p-19f,  0x1.4014d2p-19f, 0x1.04be68p-19f,
    0x1.a8d01p-20f,  0x1.5a0f4ep-20f, 0x1.19e8p-20f,   0x1.cb4a9ap-21f, 0x1.76258ep-21f,
    0x1.30c94ep-21f, 0x1.f09184p-22f, 0x1.94836p-22f,  0x1.4985fep-22f};

ModelConfig Config(int head_dim, float theta, float factor) {
  ModelConfig c;
  c.head_dim = head_dim;
  c.rope_theta = theta;
  if (factor > 0) {
    c.rope_scaling.type = RopeType::kLlama3;
    c.rope_scaling.factor = factor;
    c.rope_scaling.low_freq_factor = 1.0f;
    c.rope_scaling.high_freq_factor = 4.0f;
    c.rope_scaling.original_max_position_embeddings = 8192;
  }
  return c;
}

// Same fp32 operations as transformers; only pow() may differ by an ulp between libms.
void ExpectMatches(const ModelConfig& c, const std::vector<float>& want) {
  const auto got = RopeInvFreq(c);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), want.size());
  int exact = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR((*got)[i], want[i], 1e-6 * want[i]) << "inv_freq[" << i << "]";
    exact += (*got)[i] == want[i];
  }
  ::testing::Test::RecordProperty("exact_matches", exact);
}

TEST(RopeInvFreqTest, DefaultMatchesTransformers) {
  ExpectMatches(Config(64, 10000.0f, 0), kDefaultD64);
}

TEST(RopeInvFreqTest, Llama3MatchesTransformers) {
  ExpectMatches(Config(64, 500000.0f, 32.0f), kLlama3D64);
  ExpectMatches(Config(128, 500000.0f, 8.0f), kLlama3D128);
}

TEST(RopeInvFreqTest, Llama3ScalingChangesOnlyLowFrequencies) {
  const auto plain = RopeInvFreq(Config(128, 500000.0f, 0));
  const auto scaled = RopeInvFreq(Config(128, 500000.0f, 8.0f));
  ASSERT_TRUE(plain.ok() && scaled.ok());
  EXPECT_EQ((*plain)[0], (*scaled)[0]);                 // short wavelengths are kept
  EXPECT_FLOAT_EQ((*plain)[63] / 8.0f, (*scaled)[63]);  // long ones divided by factor
}

TEST(RopeInvFreqTest, RejectsBadConfigs) {
  ModelConfig c = Config(63, 10000.0f, 0);
  EXPECT_EQ(RopeInvFreq(c).status().code(), absl::StatusCode::kInvalidArgument);
  c = Config(64, 0.0f, 0);
  EXPECT_EQ(RopeInvFreq(c).status().code(), absl::StatusCode::kInvalidArgument);
  c = Config(64, 500000.0f, 8.0f);
  c.rope_scaling.high_freq_factor = c.rope_scaling.low_freq_factor;
  EXPECT_EQ(RopeInvFreq(c).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ts
