// NextLoopAction (engine/cuda/loop_policy.h): what the CUDA device loop's Run(kLoop) does next.
// Every combination of the host's view is checked against the rules written out once more here,
// and the cases that carry a past bug or a design decision are named on their own.
#include "engine/cuda/loop_policy.h"

#include <gtest/gtest.h>

#include <chrono>
#include <optional>
#include <string>

namespace ts {
namespace {

std::string Describe(const LoopState& s) {
  return std::string("running=") + (s.loop_running ? "1" : "0") +
         " stepped=" + (s.stepped_since_launch ? "1" : "0") +
         " pause=" + (s.pause_requested ? "1" : "0") + " queued=" + (s.prompts_queued ? "1" : "0") +
         " staging_free=" + (s.staging_free ? "1" : "0") + " decoding=" + (s.decoding ? "1" : "0") +
         " ready=" + (s.ready_unadmitted ? "1" : "0");
}

TEST(LoopPolicyTest, EveryViewGetsTheActionItsRulesGive) {
  for (int bits = 0; bits < 128; ++bits) {
    const LoopState s{.loop_running = (bits & 1) != 0,
                      .stepped_since_launch = (bits & 2) != 0,
                      .pause_requested = (bits & 4) != 0,
                      .prompts_queued = (bits & 8) != 0,
                      .staging_free = (bits & 16) != 0,
                      .decoding = (bits & 32) != 0,
                      .ready_unadmitted = (bits & 64) != 0};
    LoopAction want = LoopAction::kNone;
    if (s.loop_running) {
      if (s.prompts_queued && !s.pause_requested && s.stepped_since_launch) {
        want = LoopAction::kRequestPause;
      }
    } else if (s.prompts_queued && s.decoding && s.ready_unadmitted) {
      want = LoopAction::kLaunch;
    } else if (s.prompts_queued) {
      if (s.staging_free) want = s.decoding ? LoopAction::kMixedStep : LoopAction::kPlainChunk;
    } else if (s.decoding) {
      want = LoopAction::kLaunch;
    }
    EXPECT_EQ(NextLoopAction(s), want) << Describe(s);
  }
}

// The pause word is cleared by the launch itself, on the loop's stream, possibly behind mixed
// steps still running: a request before the launch's first step could land first and be undone.
TEST(LoopPolicyTest, APauseWaitsForTheLaunchsFirstStep) {
  LoopState s{.loop_running = true, .prompts_queued = true, .decoding = true};
  EXPECT_EQ(NextLoopAction(s), LoopAction::kNone);
  s.stepped_since_launch = true;
  EXPECT_EQ(NextLoopAction(s), LoopAction::kRequestPause);
  s.pause_requested = true;  // asked once
  EXPECT_EQ(NextLoopAction(s), LoopAction::kNone);
}

// Prompts waiting beside decoding streams go in mixed steps, never a chunk between steps, and
// only once the last step's staging is free: the host does not block.
TEST(LoopPolicyTest, PromptsBesideDecodingStreamsGoInMixedSteps) {
  LoopState s{.prompts_queued = true, .staging_free = true, .decoding = true};
  EXPECT_EQ(NextLoopAction(s), LoopAction::kMixedStep);
  s.staging_free = false;
  EXPECT_EQ(NextLoopAction(s), LoopAction::kNone);
  s.prompts_queued = false;  // the last mixed step is in flight: the loop goes behind it
  EXPECT_EQ(NextLoopAction(s), LoopAction::kLaunch);
}

// READY slots are admitted only by a loop step: after a plain chunk the loop runs first, even
// with more prompts waiting, and with nothing decoding a plain chunk takes the whole buffer.
TEST(LoopPolicyTest, ReadySlotsAreAdmittedByTheLoopBeforeAnyMixedStep) {
  LoopState s{.prompts_queued = true, .staging_free = true};
  EXPECT_EQ(NextLoopAction(s), LoopAction::kPlainChunk);
  s.decoding = true;
  s.ready_unadmitted = true;
  s.staging_free = false;  // the chunk's copies are still queued: the loop goes behind it anyway
  EXPECT_EQ(NextLoopAction(s), LoopAction::kLaunch);
}

TEST(LoopPolicyTest, NothingToDoWithNothingQueuedOrDecoding) {
  EXPECT_EQ(NextLoopAction(LoopState{}), LoopAction::kNone);
  EXPECT_EQ(NextLoopAction(LoopState{.loop_running = true, .stepped_since_launch = true}),
            LoopAction::kNone);
}

// ShouldOfferFlip and CanAdoptFlip (the loop's own regime switch) over every combination of their
// flags, with the step counter before, at and past the switch's first step.
TEST(LoopPolicyTest, EveryFlipViewGetsTheDecisionItsRulesGive) {
  for (int bits = 0; bits < 128; ++bits) {
    for (uint64_t steps : {9u, 10u, 11u}) {
      const FlipState s{.loop_running = (bits & 1) != 0,
                        .stepped_since_launch = (bits & 2) != 0,
                        .offered = (bits & 4) != 0,
                        .flips = (bits & 8) != 0 ? 3 : 2,
                        .flips_adopted = 2,
                        .steps = steps,
                        .flip_step = 10,
                        .prompts_queued = (bits & 16) != 0,
                        .wanted_prepared = (bits & 32) != 0};
      const bool unadopted = s.flips != s.flips_adopted;
      EXPECT_EQ(CanAdoptFlip(s), unadopted && (!s.loop_running || steps > 10))
          << bits << " " << steps;
      EXPECT_EQ(ShouldOfferFlip(s), s.loop_running && s.stepped_since_launch && !s.offered &&
                                        !unadopted && !s.prompts_queued && s.wanted_prepared)
          << bits << " " << steps;
    }
  }
}

// The scheduler switches inside the old execs' last step, which runs until the new execs' first
// step begins: until a step after that one is claimed, the old execs may still run, and
// preparing the next regime into them must wait.
TEST(LoopPolicyTest, AFlipIsAdoptedOnlyOnceTheOldExecsAreDone) {
  FlipState s{.loop_running = true, .flips = 1, .flips_adopted = 0, .steps = 40, .flip_step = 40};
  EXPECT_FALSE(CanAdoptFlip(s));
  s.steps = 41;
  EXPECT_TRUE(CanAdoptFlip(s));
  s.steps = 40;
  s.loop_running = false;  // exited right after switching
  EXPECT_TRUE(CanAdoptFlip(s));
}

// The launch clears the offer on the loop's stream, so an offer before the launch's first step
// could be undone, as a pause could; and a switch not yet adopted leaves no prepared execs.
TEST(LoopPolicyTest, AnOfferWaitsForTheFirstStepAndTheLastAdoption) {
  FlipState s{.loop_running = true, .wanted_prepared = true};
  EXPECT_FALSE(ShouldOfferFlip(s));
  s.stepped_since_launch = true;
  EXPECT_TRUE(ShouldOfferFlip(s));
  s.flips = 1;
  EXPECT_FALSE(ShouldOfferFlip(s));
  s.flips_adopted = 1;
  EXPECT_TRUE(ShouldOfferFlip(s));
  s.offered = true;
  EXPECT_FALSE(ShouldOfferFlip(s));
}

// A withdrawn offer may have been read by the scheduler of the step after the counter the host
// read once the clear had landed; that scheduler writes flips before the count, so only a count
// past it (or the loop's end) makes flips final.
TEST(LoopPolicyTest, AWithdrawalSettlesOnlyAfterTheNextStepOrTheExit) {
  EXPECT_FALSE(WithdrawalSettled(/*loop_running=*/true, /*steps=*/7, /*withdraw_steps=*/7));
  EXPECT_TRUE(WithdrawalSettled(true, 8, 7));
  EXPECT_TRUE(WithdrawalSettled(false, 7, 7));
}

// A mixed step's prompt rows: the step's rows less the bucket's decode rows, at least a quarter of
// the step, within the prefill buffers; catch-up steps only once a prompt has waited longer than
// catchup_after without a chunk.
TEST(LoopPolicyTest, MixedStepsGiveThePromptsTheStepLessItsDecodeRows) {
  const MixedStepBudget b{
      .step_tokens = 256, .catchup_tokens = 512, .catchup_after = {}, .chunk_tokens = 2048};
  EXPECT_EQ(MixedStepPromptRows(b, 16, std::nullopt), 240);
  EXPECT_EQ(MixedStepPromptRows(b, 64, std::nullopt), 192);
  EXPECT_EQ(MixedStepPromptRows(b, 240, std::nullopt), 64);  // a quarter at least
  EXPECT_EQ(MixedStepPromptRows(b, 1024, std::nullopt), 64);
  // The step is capped by the prefill buffers, and so is the quarter.
  const MixedStepBudget small{.step_tokens = 256, .chunk_tokens = 100};
  EXPECT_EQ(MixedStepPromptRows(small, 64, std::nullopt), 36);
  const MixedStepBudget tight{.step_tokens = 256, .chunk_tokens = 80};
  EXPECT_EQ(MixedStepPromptRows(tight, 64, std::nullopt), 16);
  const MixedStepBudget one{.step_tokens = 1, .chunk_tokens = 2048};
  EXPECT_EQ(MixedStepPromptRows(one, 8, std::nullopt), 1);
}

TEST(LoopPolicyTest, CatchUpStepsOnlyOncePromptsHaveWaitedBehindOthersTooLong) {
  using namespace std::chrono_literals;
  const MixedStepBudget b{
      .step_tokens = 256, .catchup_tokens = 512, .catchup_after = 30ms, .chunk_tokens = 2048};
  EXPECT_EQ(MixedStepPromptRows(b, 64, std::nullopt), 192);  // nothing unstarted
  EXPECT_EQ(MixedStepPromptRows(b, 64, 0ns), 192);
  EXPECT_EQ(MixedStepPromptRows(b, 64, 30ms), 192);  // not longer than catchup_after
  EXPECT_EQ(MixedStepPromptRows(b, 64, 30ms + 1ns), 448);
  EXPECT_EQ(MixedStepPromptRows(b, 16, 2s), 496);
  // Off: catchup_after 0, or a catch-up step no larger than the plain one.
  MixedStepBudget off = b;
  off.catchup_after = 0ns;
  EXPECT_EQ(MixedStepPromptRows(off, 64, 10s), 192);
  MixedStepBudget smaller = b;
  smaller.catchup_tokens = 128;
  EXPECT_EQ(MixedStepPromptRows(smaller, 64, 10s), 192);
  // The prefill buffers cap a catch-up step too.
  MixedStepBudget capped = b;
  capped.chunk_tokens = 300;
  EXPECT_EQ(MixedStepPromptRows(capped, 64, 10s), 236);
  // Over a grid: within [1, chunk - bucket], never fewer rows for a longer wait.
  for (int32_t step : {1, 6, 64, 256, 700}) {
    for (int32_t catchup : {1, 256, 512, 4096}) {
      for (int32_t bucket : {1, 8, 64, 128}) {
        const MixedStepBudget g{.step_tokens = step,
                                .catchup_tokens = catchup,
                                .catchup_after = 30ms,
                                .chunk_tokens = 1024};
        int32_t last = 0;
        for (auto wait : {0ms, 29ms, 30ms, 31ms, 5000ms}) {
          const int32_t rows = MixedStepPromptRows(g, bucket, wait);
          EXPECT_GE(rows, 1);
          EXPECT_LE(rows, 1024 - bucket);
          EXPECT_GE(rows, last) << step << " " << catchup << " " << bucket;
          last = rows;
        }
      }
    }
  }
}

}  // namespace
}  // namespace ts
