// The GEMV's host-side policies that need no GPU: the persistent 17-32-row kernel's split choice
// (kernels/gemv.cuh, ChooseGemvPersistentSplitK). Runs in CI.
#include <algorithm>
#include <cstdint>
#include <iterator>

#include "gtest/gtest.h"
#include "kernels/gemv.cuh"

namespace ts::kernels {
namespace {

// 17-32 rows (the persistent wgmma kernel): rounds x (stages / split + 2 stages a CTA for each
// tile's cluster reduction), cheapest wins. The table of clusters that fit is an assumption in
// the range the H100 showed (fewer clusters of 4 and 8 than 132 / split: not every GPC seats two
// clusters of 8 at one CTA an SM); with it the policy picks what forced splits measured fastest
// there at 24 and 32 rows (bench/results/2026-12-05b-h100.md).
TEST(GemvTest, PersistentSplitPricesRoundsAndReductions) {
  const int32_t fit[] = {0, 132, 66, 44, 28, 24, 20, 16, 14};
  // Tiles of 128 W rows (64 output columns of a fused gate_up), stages of 64 k.
  EXPECT_EQ(ChooseGemvPersistentSplitK(6144 / 128, 4096 / 64, fit, 132), 2);   // 8B qkv
  EXPECT_EQ(ChooseGemvPersistentSplitK(4096 / 128, 4096 / 64, fit, 132), 3);   // 8B o
  EXPECT_EQ(ChooseGemvPersistentSplitK(14336 / 64, 4096 / 64, fit, 132), 1);   // 8B gate_up
  EXPECT_EQ(ChooseGemvPersistentSplitK(4096 / 128, 14336 / 64, fit, 132), 3);  // 8B down
  EXPECT_EQ(ChooseGemvPersistentSplitK(3072 / 128, 2048 / 64, fit, 132), 4);   // 1B qkv
  EXPECT_EQ(ChooseGemvPersistentSplitK(2048 / 128, 2048 / 64, fit, 132), 4);   // 1B o
  EXPECT_EQ(ChooseGemvPersistentSplitK(8192 / 64, 2048 / 64, fit, 132), 1);    // 1B gate_up
  // A split of 4 whose 32 tiles fit in one round wins where the H100's 28 clusters took two.
  int32_t roomy[9];
  std::copy(std::begin(fit), std::end(fit), roomy);
  roomy[4] = 33;
  EXPECT_EQ(ChooseGemvPersistentSplitK(4096 / 128, 14336 / 64, roomy, 132), 4);
  // No cluster that fits means split 1; degenerate shapes give 1.
  const int32_t none[] = {0, 132, 0, 0, 0, 0, 0, 0, 0};
  EXPECT_EQ(ChooseGemvPersistentSplitK(8, 64, none, 132), 1);
  EXPECT_EQ(ChooseGemvPersistentSplitK(0, 64, fit, 132), 1);
  EXPECT_EQ(ChooseGemvPersistentSplitK(8, 64, fit, 0), 1);
}

}  // namespace
}  // namespace ts::kernels
