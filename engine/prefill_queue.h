// Prompts waiting for prefill, cut into chunks in arrival order (docs/device-loop.md, Prefill
// between steps). The device loop's backend runs one bounded chunk between decode steps, so a
// long prompt never stalls the running streams for longer than one chunk; a chunk packs the
// pieces of as many prompts as fit. Host-only and single-threaded: the backend's caller owns it.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "engine/backend.h"

namespace ts {

class PrefillQueue {
 public:
  // One prompt's rows [start, start + len) in a chunk.
  struct Piece {
    const SlotInit* init = nullptr;  // the job's own copy; valid until Pop or Drop of its slot
    int32_t start = 0;
    int32_t len = 0;
    bool first = false;  // its prompt's first piece: the slot is staged with it
    bool last = false;   // its prompt's last piece: the first token is sampled after it
  };

  using Clock = std::chrono::steady_clock;

  // Copies the prompt and block table: the caller's spans need not outlive the call.
  void Push(const SlotInit& init, Clock::time_point queued_at);
  bool empty() const { return jobs_.empty(); }
  int32_t size() const { return static_cast<int32_t>(jobs_.size()); }
  // Prompt rows not yet handed out in a chunk.
  int64_t pending_rows() const;
  bool Contains(SlotId slot) const;
  // When the longest-waiting prompt that no chunk has started yet was pushed; none when every
  // queued prompt has started. How long prompts wait behind the ones ahead of them, the backlog
  // a mixed step's catch-up budget answers (MixedStepPromptRows, engine/cuda/loop_policy.h).
  std::optional<Clock::time_point> oldest_unstarted() const;

  // The next chunk of at most max_rows (>= 1) rows, in arrival order: whole prompts while they
  // fit, then the front part of the next one. Pieces stay valid until PopFinished.
  // With keys_per_row > 0 the budget also pays for attention: a row at position p costs
  // 1 + (p + 1) / keys_per_row of max_rows (its attention reads p + 1 keys), so a chunk deep into
  // a long prompt holds fewer rows and costs about as much as one near its start. The first row
  // is always taken, whatever it costs.
  std::vector<Piece> NextChunk(int32_t max_rows, int32_t keys_per_row = 0);
  // Forgets every job whose last piece has been handed out (their init pointers die here).
  void PopFinished();
  enum class DropResult {
    kNotQueued,  // no job for the slot, or its last piece is already out
    kUnstarted,  // dropped before any piece was handed out
    kStarted,    // dropped part-way: its slot row was staged with the first piece
  };
  // Removes the slot's job unless its last piece has been handed out.
  DropResult Drop(SlotId slot);

 private:
  struct Job {
    SlotInit init;  // spans into the vectors below
    std::vector<int32_t> prompt;
    std::vector<int32_t> block_table;
    int32_t next = 0;  // prompt rows handed out so far
    Clock::time_point queued_at;
  };
  std::deque<std::unique_ptr<Job>> jobs_;
};

}  // namespace ts
