// The device-resident decode loop's scheduler (docs/device-loop.md): a kernel that runs as the
// last node of every bucket's decode graph and, at every step boundary,
//   1. turns the slots a prefill made READY into ACTIVE (the publish point),
//   2. compacts the ACTIVE slots, in ascending slot order, into the decode row list,
//   3. exits when no slot is ACTIVE, the host asked for a pause, or the longest context left the
//      window the graphs' attention regime was chosen for (it never spins idle), unless it lies
//      in the range where the host offered another regime (OfferFlip, larger or smaller): then
//      it switches to that regime's table and window,
//   4. otherwise claims the step (atomicAdd on the step counter), picks the smallest bucket that
//      holds the rows, and tail-launches that bucket's current exec from the GraphCache's device
//      table, whose own last node is this kernel again.
// A tail launch runs after the launching graph ends, so this is one decode step after another
// with one graph boundary between two steps and no host call. The loop starts from a graph of
// its own holding only this kernel (Launch); a host event after it completes once the loop has
// exited (graphs/tail_launch.cuh has the rules). A decode graph the host launches itself (the
// host-driven mode) finds the loop not running and its scheduler node returns at once.
//
// The loop shares only device memory with the host: the slot table's state words (the host
// stages a slot as PREFILL, the prefill's postprocess makes it READY or FINISHED, a decode
// step's postprocess makes it FINISHED), the control block (written by the host with async
// copies and memsets on another stream) and the step counter, mirrored into host-mapped memory
// each step.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/postprocess.cuh"
#include "kernels/step_stamps.cuh"

namespace ts::graphs {

inline constexpr int32_t kDeviceLoopMaxBuckets = 32;
inline constexpr int32_t kDeviceLoopMaxSlots = 1024;  // one thread per slot, one block

// Why the last loop exited (DeviceLoopState::exit_reason).
inline constexpr int32_t kLoopExitIdle = 1;     // no slot was ACTIVE
inline constexpr int32_t kLoopExitPaused = 2;   // the host asked
inline constexpr int32_t kLoopExitError = 3;    // a device-side launch failed (status says which)
inline constexpr int32_t kLoopExitContext = 4;  // the longest context left the launch's window

// Device memory, written by the host only through async copies and memsets.
struct DeviceLoopControl {
  int32_t pause = 0;  // non-zero: the loop exits at the next step boundary
  int32_t reserved = 0;
  uint64_t steps = 0;  // the step counter the scheduler claims steps on (atomicAdd)
  // Written by Launch (one copy), cleared by the scheduler when the loop exits.
  const cudaGraphExec_t* table = nullptr;  // [num_buckets] device: GraphCache::device_table()
  // The loop runs steps only while the longest ACTIVE context (prompt_len + generated) is in
  // (context_lo, context_hi]: the graphs' attention split counts were chosen for that window,
  // and the host re-chooses them at exactly the step where the host-driven mode would.
  int32_t context_lo = 0;
  int32_t context_hi = 0;
  int32_t running = 0;  // 1 from Launch until the exit: a scheduler node that sees 0 does nothing
  int32_t padding = 0;
  // A regime offered while the loop runs (OfferFlip), or 0; cleared by Launch, by WithdrawOffer
  // and by the scheduler that takes it. Low word: take_lo << 2 | 1, high word: hi (> 0), so a
  // read torn between a host write and the word before it has a zero in one half and is no
  // offer. The scheduler takes it at a step outside the window whose longest context lies in
  // (take_lo, hi].
  uint64_t offer = 0;
  // The offered regime's table and window bottom, written before `offer` and read only once
  // `offer` is seen.
  const cudaGraphExec_t* offer_table = nullptr;
  int32_t offer_context_lo = 0;
  int32_t offer_padding = 0;
};

// Host-mapped; written by the scheduler kernel, read by the host at any time (volatile).
struct DeviceLoopState {
  uint64_t steps = 0;       // decode steps launched since Create
  int32_t status = 0;       // 0, or the first cudaError_t of a device-side launch
  int32_t exit_reason = 0;  // of the last exit (0 while the first loop has not exited)
  int32_t last_rows = 0;    // rows of the newest step
  int32_t flips = 0;        // offers taken (OfferFlip) since Create
  uint64_t flip_step = 0;   // the first step the last taken offer's table ran
};

struct DeviceLoopParams {
  int32_t num_buckets = 0;                      // [1, kDeviceLoopMaxBuckets]
  int32_t buckets[kDeviceLoopMaxBuckets] = {};  // batch sizes, ascending, as the cache's
  kernels::SlotRow* slots = nullptr;            // [num_slots] device slot table
  int32_t num_slots = 0;                        // [1, kDeviceLoopMaxSlots], <= buckets.back()
  int32_t* row_slots = nullptr;  // [buckets.back()] device: the decode row list the step reads
  kernels::StepStamps* stamps = nullptr;  // benchmarks only (kernels/step_stamps.cuh); nullptr
};

// Owns the start graph (the scheduler kernel alone, captured once, instantiated for device launch,
// uploaded), the control block and the host-mapped state. One owner thread. The order of use:
// Create; capture each bucket's decode graph ending with EnqueueScheduler; BindTable with the
// cache's device table; then Launch, RequestPause and Wait as often as needed.
class DeviceLoop {
 public:
  // Validates params (InvalidArgument naming the field) and builds the start graph on `stream`.
  static absl::StatusOr<std::unique_ptr<DeviceLoop>> Create(const DeviceLoopParams& params,
                                                            cudaStream_t stream);
  ~DeviceLoop();
  DeviceLoop(const DeviceLoop&) = delete;
  DeviceLoop& operator=(const DeviceLoop&) = delete;

  // Enqueues the scheduler kernel on `stream`, which is capturing a bucket's decode graph: it
  // must be that graph's last node. Launched with PDL (kernels/pdl.cuh) behind the node before
  // it, whose writes (the slot states a postprocess finished) it waits for.
  absl::Status EnqueueScheduler(cudaStream_t stream) const;
  // The device table the scheduler launches bucket execs from (GraphCache::device_table(), whose
  // graphs end with EnqueueScheduler). InvalidArgument for nullptr.
  absl::Status BindTable(const cudaGraphExec_t* table);

  // Starts the loop on `stream` (clearing the pause word first) for contexts in
  // (context_lo, context_hi] (DeviceLoopControl). FailedPrecondition if no table is bound or the
  // previous loop has not exited. Every bucket exec the loop can reach must be uploaded and must
  // not be updated until the loop has exited.
  absl::Status Launch(cudaStream_t stream, int32_t context_lo = 0, int32_t context_hi = INT32_MAX);
  // Asks the running loop to exit at the next step boundary, through an async memset on
  // `control_stream` (not the loop's stream, which the loop occupies). Does not wait.
  absl::Status RequestPause(cudaStream_t control_stream);
  // Offers the running loop another regime: at the first step whose longest context has left
  // the current window, if that context lies in (take_lo, context_hi], the scheduler switches to
  // `table` ([num_buckets] device execs, uploaded, whose graphs end with EnqueueScheduler) and
  // the window (context_lo, context_hi] instead of exiting (docs/device-loop.md, The attention
  // regime). The regime may be larger or smaller than the current one; context_lo <= take_lo <
  // context_hi. At most one offer stands at a time, made after the launch on the loop's stream
  // (Launch clears it), through async copies on `control_stream`, which must already be ordered
  // after the table's uploads; waits for those copies. flips() counts the offers taken.
  absl::Status OfferFlip(const cudaGraphExec_t* table, int32_t take_lo, int32_t context_lo,
                         int32_t context_hi, cudaStream_t control_stream);
  // Clears a standing offer and waits until the clear has landed. A scheduler that read the offer
  // before may still take it: only once steps() has passed its value read after this returns (or
  // the loop has exited) does flips() say for certain whether it was taken.
  absl::Status WithdrawOffer(cudaStream_t control_stream);
  // True from Launch until the loop and every step it launched have completed.
  bool Running() const;
  // Blocks until the loop has exited.
  absl::Status Wait() const;
  // The mapped state (volatile reads; exact once the loop has exited).
  uint64_t steps() const;
  int32_t exit_reason() const;
  int32_t flips() const;
  // The first step run from the last offer taken: once steps() has passed it, the execs of the
  // table before it no longer run.
  uint64_t flip_step() const;
  // OK, or the device-side launch failure of the loop.
  absl::Status status() const;

 private:
  DeviceLoop() = default;
  cudaError_t EnqueueKernel(cudaStream_t stream, bool pdl) const;
  cudaGraphExec_t exec_ = nullptr;
  const cudaGraphExec_t* table_ = nullptr;      // BindTable
  DeviceLoopControl* control_ = nullptr;        // [1] device
  DeviceLoopControl* staging_ = nullptr;        // [1] pinned: Launch's table, window and running
  DeviceLoopControl* offer_staging_ = nullptr;  // [1] pinned: OfferFlip's words
  DeviceLoopParams params_;
  DeviceLoopState* state_host_ = nullptr;    // [1] pinned, mapped
  DeviceLoopState* state_device_ = nullptr;  // its device alias
  cudaEvent_t done_ = nullptr;
  bool launched_ = false;
};

}  // namespace ts::graphs
