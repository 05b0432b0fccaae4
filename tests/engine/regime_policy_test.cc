// The attention regime's rules (engine/cuda/regime_policy.h). The device loop must change regime
// at exactly the steps where the host-driven mode does, to exactly the regime it picks, or the two
// modes' tokens differ (a split count changes the attention's summation order); these tests hold
// the window, the take range and the host's preparation to NextRegime, the host-driven rule.
#include "engine/cuda/regime_policy.h"

#include <gtest/gtest.h>

#include <vector>

namespace ts {
namespace {

std::vector<int32_t> Bounds(int32_t max_context) {
  std::vector<int32_t> out;
  for (int32_t c = 1; c <= max_context; ++c) {
    const int32_t b = RegimeBound(c, max_context);
    if (out.empty() || out.back() != b) out.push_back(b);
  }
  return out;
}

TEST(RegimePolicyTest, BoundsAreDoublingsFrom128CappedAtTheModelsContext) {
  EXPECT_EQ(Bounds(2048), (std::vector<int32_t>{128, 256, 512, 1024, 2048}));
  EXPECT_EQ(Bounds(2000), (std::vector<int32_t>{128, 256, 512, 1024, 2000}));
  EXPECT_EQ(Bounds(100), (std::vector<int32_t>{100}));
  EXPECT_EQ(RegimeBound(129, 4096), 256);
  EXPECT_EQ(RegimeBound(128, 4096), 128);
}

// For every regime held, every regime offered and every longest context: the loop runs the step
// in its window exactly when the host-driven mode keeps the regime, and takes the offer exactly
// when the host-driven mode changes to the offered regime, from above or below; the regime taken
// then holds the step (its window contains the context), and every offer is one DeviceLoop
// accepts (window bottom <= take bottom < bound).
TEST(RegimePolicyTest, TheLoopSwitchesExactlyWhereTheHostDrivenModeDoesToTheSameRegime) {
  for (int32_t max_context : {100, 2000, 2048, 32768}) {
    const std::vector<int32_t> bounds = Bounds(max_context);
    int64_t grows = 0, shrinks = 0;
    for (int32_t current : bounds) {
      for (int32_t offered : bounds) {
        if (offered == current) continue;
        ASSERT_LE(RegimeWindowLo(offered), RegimeTakeLo(offered)) << offered;
        ASSERT_LT(RegimeTakeLo(offered), offered);
        for (int32_t c = 1; c <= max_context; ++c) {
          const int32_t host = NextRegime(current, c, max_context);
          const bool stays = c > RegimeWindowLo(current) && c <= current;
          ASSERT_EQ(stays, host == current) << max_context << " " << current << " " << c;
          const bool takes = !stays && c > RegimeTakeLo(offered) && c <= offered;
          ASSERT_EQ(takes, host == offered)
              << max_context << " " << current << " offered " << offered << " " << c;
          if (takes) {
            ASSERT_GT(c, RegimeWindowLo(offered));
            (offered > current ? grows : shrinks) += 1;
          }
        }
      }
    }
    if (bounds.size() >= 3) {  // regimes of 512 and up shrink
      EXPECT_GT(grows, 0);
      EXPECT_GT(shrinks, 0);
    }
  }
}

TEST(RegimePolicyTest, ShrinksOnlyTwoLevelsDown) {
  EXPECT_EQ(RegimeWindowLo(128), 0);
  EXPECT_EQ(RegimeWindowLo(256), 0);
  EXPECT_EQ(RegimeWindowLo(512), 128);
  EXPECT_EQ(RegimeWindowLo(1024), 256);
  EXPECT_EQ(RegimeWindowLo(2000), 256);  // 512 * 4 > 2000
  EXPECT_EQ(NextRegime(1024, 257, 4096), 1024);
  EXPECT_EQ(NextRegime(1024, 256, 4096), 256);
  EXPECT_EQ(NextRegime(1024, 100, 4096), 128);
  EXPECT_EQ(NextRegime(1024, 1025, 4096), 2048);
  EXPECT_EQ(NextRegime(1024, 3000, 4096), 4096);
}

TEST(RegimePolicyTest, PreparesTheNextLaunchsRegimeThenTheNextUpThenTheShrink) {
  auto prepare = [](int32_t current, int32_t longest, int32_t rest) {
    return RegimeToPrepare(
        {.current = current, .max_context = 4096, .longest = longest, .rest = rest});
  };
  EXPECT_EQ(prepare(1024, 0, 0), std::nullopt);  // nothing decodes or waits
  // A queued prompt past the window: the regime its first step needs.
  EXPECT_EQ(prepare(256, 3000, 0), 4096);
  // Already below the window (the loop exits there): the shrink the launch will make.
  EXPECT_EQ(prepare(1024, 200, 200), 256);
  // Near the top, the next one up, shrink candidates or not.
  EXPECT_EQ(prepare(1024, 1024 - kPrepareRegimeAhead + 1, 0), 2048);
  EXPECT_EQ(prepare(1024, 1024 - kPrepareRegimeAhead + 1, 100), 2048);
  EXPECT_EQ(prepare(4096, 4090, 0), std::nullopt);  // none larger
  EXPECT_EQ(prepare(4096, 4097, 0), std::nullopt);  // nor past the model's length
  // Far from the top: the shrink that follows once the streams above 256 end.
  EXPECT_EQ(prepare(1024, 1024 - kPrepareRegimeAhead, 0), std::nullopt);
  EXPECT_EQ(prepare(1024, 700, 100), 128);
  EXPECT_EQ(prepare(1024, 700, 129), 256);
  EXPECT_EQ(prepare(1024, 700, 256), 256);
  // Whatever it prepares for a shrink is the host-driven mode's pick once only `rest` remains.
  for (int32_t rest = 1; rest <= 256; ++rest) {
    EXPECT_EQ(prepare(1024, 700, rest), NextRegime(1024, rest, 4096)) << rest;
  }
  // Regimes of 256 and below never shrink, so nothing is prepared for one.
  EXPECT_EQ(prepare(256, 150, 0), std::nullopt);
}

}  // namespace
}  // namespace ts
