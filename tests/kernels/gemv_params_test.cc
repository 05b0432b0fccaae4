// Host-only checks of the GEMV launcher's choices: split-K, whole tiles per warp, where the norm
// prologue pays and fits, and the workspace size. None touches the GPU, so this binary runs
// everywhere, CI included; the kernels themselves are tested in gemv_test.cc and gemv_norm_test.cc.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>

#include "kernels/gemv.cuh"
#include "tests/kernels/gemv_test_util.h"  // kShapes, the shapes the kernels are tested at

namespace ts::kernels {
namespace {

TEST(GemvParamsTest, SplitHeuristicAndWorkspaceSize) {
  // Every Llama-1B/8B projection fills a 132-SM H200 without splitting.
  for (const auto& [n, k] : gemv_test::kShapes) {
    if (n >= 2048) {
      EXPECT_EQ(ChooseGemvSplitK(1, n, k, 132), 1) << n << "x" << k;
    }
  }
  EXPECT_EQ(ChooseGemvSplitK(1, 24, 40, 132), 1);      // tiny: the second kernel never pays
  EXPECT_EQ(ChooseGemvSplitK(8, 512, 8192, 132), 4);   // 32 CTAs, k allows 4 splits of 2048
  EXPECT_EQ(ChooseGemvSplitK(1, 256, 65536, 132), 9);  // 16 CTAs: one wave of 144
  EXPECT_EQ(ChooseGemvSplitK(0, 512, 8192, 132), 1);
  // Whole tiles per warp only where they fill >= 3/4 of the 264 x 8 resident warps.
  EXPECT_TRUE(ChooseGemvWarpTiles(14336 / 8, 264));    // 8B gate_up: 1792 tiles
  EXPECT_FALSE(ChooseGemvWarpTiles(8192 / 8, 264));    // 1B gate_up: 1024
  EXPECT_FALSE(ChooseGemvWarpTiles(6144 / 16, 264));   // 8B qkv
  EXPECT_TRUE(ChooseGemvWarpTiles(128256 / 16, 264));  // an lm_head
  EXPECT_FALSE(ChooseGemvWarpTiles(100, 0));
  EXPECT_EQ(GemvWorkspaceBytes(3, 100, 1), 0u);
  EXPECT_EQ(GemvWorkspaceBytes(3, 100, 4), size_t{4} * 3 * 100 * sizeof(float));

  // m > 8: whole waves of the 2 x 132 resident CTAs, >= 2 stages of 64 k per split, and at most
  // the 8 CTAs of a cluster.
  EXPECT_EQ(ChooseGemvSplitK(16, 4096, 4096, 132), 8);                           // 8B o: 32 tiles
  EXPECT_EQ(ChooseGemvSplitK(16, 6144, 4096, 132), 5);                           // 8B qkv: 48 tiles
  EXPECT_EQ(ChooseGemvSplitK(16, 2048, 2048, 132), 8);                           // 1B o: 16 tiles
  EXPECT_EQ(ChooseGemvSplitK(16, 2048, 256, 132), 2);                            // 4 stages of k
  EXPECT_EQ(ChooseGemvSplitK(16, 28672, 4096, 132), 1);                          // 224 tiles
  EXPECT_EQ(ChooseGemvSplitK(16, 14336, 4096, 132, GemvEpilogue::kSiluMul), 1);  // 224 tiles
  EXPECT_EQ(ChooseGemvSplitK(16, 8192, 2048, 132, GemvEpilogue::kSiluMul), 2);   // 128 tiles
  EXPECT_EQ(ChooseGemvSplitK(16, 24, 40, 132), 1);                               // one stage of k
  EXPECT_EQ(GemvWorkspaceBytes(16, 100, 4), 0u);  // reduced in the cluster's shared memory
}

TEST(GemvParamsTest, NormProloguePaysOnlyForASmallA) {
  EXPECT_TRUE(GemvNormProloguePays(1, 2048));  // 1B decode at batch 1 and 2
  EXPECT_TRUE(GemvNormProloguePays(2, 2048));
  EXPECT_TRUE(GemvNormProloguePays(1, 4096));  // 8B at batch 1
  EXPECT_FALSE(GemvNormProloguePays(2, 4096));
  EXPECT_FALSE(GemvNormProloguePays(4, 2048));
  EXPECT_FALSE(GemvNormProloguePays(8, 4096));
  EXPECT_FALSE(GemvNormProloguePays(1, 8256 * 8));  // past what the prologue can take
}

TEST(GemvParamsTest, NormPrologueFitsUpToItsSharedMemory) {
  EXPECT_TRUE(GemvCanFuseNorm(8, 8192));  // the largest k gemv_norm_test.cc runs at m = 8
  EXPECT_FALSE(GemvCanFuseNorm(8, 8256));
  EXPECT_TRUE(GemvCanFuseNorm(1, 65536));
}

}  // namespace
}  // namespace ts::kernels
