// The request mix and the three-wave scenario that the pipeline tests share: greedy and seeded
// requests of mixed lengths, sent in waves of four, each once the previous wave's first stream
// has a token, so prompts are prefilled while others decode and admission waits for slots.
#pragma once

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "engine/engine.h"
#include "tests/engine/stream_reader.h"

namespace ts::testing {

// The name of a (fixture, stages or ranks, loop) test parameter, e.g. tiny_gqa_untied_3_loop.
inline std::string FixtureStagesModeName(
    const ::testing::TestParamInfo<std::tuple<std::string, int32_t, bool>>& info) {
  std::string name = std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) +
                     (std::get<2>(info.param) ? "_loop" : "_host");
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

// An engine over `backend` as the pipeline tests run it: buckets 1, 2, 4, `slots` at once.
inline std::unique_ptr<Engine> MakeWaveEngine(std::unique_ptr<Backend> backend, bool loop,
                                              int32_t slots, int32_t context) {
  EngineOptions e;
  e.max_batch = slots;
  e.buckets = {1, 2, 4};
  e.max_context = context;
  e.run_mode = loop ? RunMode::kLoop : RunMode::kOneStep;
  auto engine = Engine::Create(e, std::move(backend));
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(*engine) : nullptr;
}

struct WaveResult {
  std::vector<int32_t> tokens;
  FinishReason reason = FinishReason::kNone;
  absl::Status status;
};

// Ten requests: prompts of 1-40 ids in [3, vocab), 4-63 new tokens with EOS ignored, every third
// one sampled with seed sampling_seed + i, the rest greedy.
inline std::vector<GenerateRequest> MixedRequests(int32_t vocab, uint32_t rng_seed,
                                                  const std::string& id_prefix,
                                                  uint64_t sampling_seed) {
  std::mt19937 rng(rng_seed);
  std::vector<GenerateRequest> out;
  for (int i = 0; i < 10; ++i) {
    GenerateRequest r;
    r.request_id = id_prefix + std::to_string(i);
    const int len = 1 + static_cast<int>(rng() % 40);
    for (int t = 0; t < len; ++t) r.prompt.push_back(3 + static_cast<int32_t>(rng() % (vocab - 3)));
    r.stop.max_new_tokens = 4 + static_cast<int32_t>(rng() % 60);
    r.stop.ignore_eos = true;
    r.sampling.temperature = i % 3 == 1 ? 0.9f : 0.0f;
    r.sampling.seed = sampling_seed + i;
    out.push_back(std::move(r));
  }
  return out;
}

// Sends `reqs` in waves of four and reads every stream to its end; the ids in `cancel` are
// cancelled once the last wave streams.
inline std::vector<WaveResult> RunWaves(Engine& engine, const std::vector<GenerateRequest>& reqs,
                                        const std::vector<int>& cancel) {
  std::vector<std::unique_ptr<StreamReader>> readers;
  for (size_t first = 0; first < reqs.size(); first += 4) {
    for (size_t i = first; i < std::min(reqs.size(), first + 4); ++i) {
      auto s = engine.Submit(reqs[i]);
      EXPECT_TRUE(s.ok()) << s.status();
      if (!s.ok()) return {};
      readers.push_back(std::make_unique<StreamReader>(*s));
    }
    ReadAtLeast(readers[first].get(), 1);
  }
  for (int i : cancel) engine.Cancel(reqs[i].request_id);
  std::vector<WaveResult> out;
  for (auto& r : readers) {
    ReadToEnd(r.get());
    out.push_back(WaveResult{r->tokens, r->reason, r->status});
  }
  return out;
}

}  // namespace ts::testing
