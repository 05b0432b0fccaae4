// A request's sampling parameters (models/sampling.h) as the GPU sampler reads them
// (kernels/sampling.cuh's SamplingRow). Here, in the engine, because kernels/ includes nothing
// from models/.
#pragma once

#include <cstdint>

#include "kernels/sampling.cuh"
#include "models/sampling.h"

namespace ts {

// `position`: the absolute position of the token to be sampled.
inline kernels::SamplingRow ToSamplingRow(const SamplingParams& p, uint64_t position) {
  kernels::SamplingRow r;
  r.temperature = p.temperature;
  r.top_k = p.top_k;
  r.top_p = p.top_p;
  r.min_p = p.min_p;
  r.repetition_penalty = p.repetition_penalty;
  r.presence_penalty = p.presence_penalty;
  r.frequency_penalty = p.frequency_penalty;
  r.seed = p.seed;
  r.position = position;
  return r;
}

}  // namespace ts
