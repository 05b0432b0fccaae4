#include "engine/prefill_queue.h"

#include <algorithm>

#include "common/status.h"

namespace ts {

void PrefillQueue::Push(const SlotInit& init, Clock::time_point queued_at) {
  auto job = std::make_unique<Job>();
  job->prompt.assign(init.prompt.begin(), init.prompt.end());
  job->block_table.assign(init.block_table.begin(), init.block_table.end());
  job->init = init;
  job->init.prompt = job->prompt;
  job->init.block_table = job->block_table;
  job->queued_at = queued_at;
  jobs_.push_back(std::move(job));
}

int64_t PrefillQueue::pending_rows() const {
  int64_t rows = 0;
  for (const auto& j : jobs_) rows += static_cast<int64_t>(j->prompt.size()) - j->next;
  return rows;
}

bool PrefillQueue::Contains(SlotId slot) const {
  return std::any_of(jobs_.begin(), jobs_.end(),
                     [&](const std::unique_ptr<Job>& j) { return j->init.slot == slot; });
}

std::optional<PrefillQueue::Clock::time_point> PrefillQueue::oldest_unstarted() const {
  // Jobs are in arrival order, so the first unstarted one waited longest.
  for (const auto& j : jobs_) {
    if (j->next == 0) return j->queued_at;
  }
  return std::nullopt;
}

std::vector<PrefillQueue::Piece> PrefillQueue::NextChunk(int32_t max_rows, int32_t keys_per_row) {
  TS_CHECK_GE(max_rows, 1);
  TS_CHECK_GE(keys_per_row, 0);
  std::vector<Piece> pieces;
  double left = max_rows;
  for (const auto& j : jobs_) {
    if (left < 1) break;
    const int32_t len = static_cast<int32_t>(j->prompt.size());
    if (j->next == len) continue;  // handed out whole, waiting for PopFinished
    int32_t take = 0;
    for (int32_t pos = j->next; pos < len; ++pos) {
      const double cost =
          keys_per_row > 0 ? 1.0 + static_cast<double>(pos + 1) / keys_per_row : 1.0;
      if (cost > left && !(pieces.empty() && take == 0)) break;
      left -= cost;
      ++take;
    }
    if (take == 0) break;
    pieces.push_back(Piece{.init = &j->init,
                           .start = j->next,
                           .len = take,
                           .first = j->next == 0,
                           .last = j->next + take == len});
    j->next += take;
  }
  return pieces;
}

void PrefillQueue::PopFinished() {
  std::erase_if(jobs_, [](const std::unique_ptr<Job>& j) {
    return j->next == static_cast<int32_t>(j->prompt.size());
  });
}

PrefillQueue::DropResult PrefillQueue::Drop(SlotId slot) {
  for (auto it = jobs_.begin(); it != jobs_.end(); ++it) {
    Job& j = **it;
    if (j.init.slot != slot) continue;
    if (j.next == static_cast<int32_t>(j.prompt.size())) return DropResult::kNotQueued;
    const DropResult r = j.next > 0 ? DropResult::kStarted : DropResult::kUnstarted;
    jobs_.erase(it);
    return r;
  }
  return DropResult::kNotQueued;
}

}  // namespace ts
