#include "graphs/device_loop.cuh"

#include <cstddef>
#include <memory>
#include <new>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "graphs/device_graph.h"
#include "kernels/cuda_check.h"
#include "kernels/pdl.cuh"

namespace ts::graphs {
namespace {

namespace k = ::ts::kernels;

struct LoopKernelParams {
  DeviceLoopParams loop;
  DeviceLoopControl* control;  // [1] device
  DeviceLoopState* state;      // [1] host-mapped
};

// Thread 0 only. The next Launch's copy sets running again, stream-ordered after this loop.
__device__ void Exit(const LoopKernelParams& p, int32_t reason) {
  *static_cast<volatile int32_t*>(&p.state->exit_reason) = reason;
  p.control->running = 0;
}

template <typename T>
__device__ __forceinline__ T LoadVolatile(const T* p) {
  return *static_cast<const volatile T*>(p);
}

// One block, one thread per slot (blockDim.x a multiple of 32 covering num_slots). The last node
// of every bucket's decode graph, and the only node of the start graph.
//
// The kernel is a chain of memory round trips between the step's postprocess and the next
// step's first kernel, and the GPU idles for its whole length (docs/device-loop.md, One step
// boundary). So every load is issued as early as its address is known: the control words and
// the slot rows at once, the table entries right after the running check, and the step counter
// is claimed with an atomic whose result nobody waits for (the scheduler is its only writer, so
// the value read up front plus one is the claim).
__global__ void SchedulerKernel(LoopKernelParams p) {
  __shared__ int32_t warp_offset[kDeviceLoopMaxSlots / 32 + 1];
  __shared__ int32_t max_context;
  __shared__ unsigned long long offer;
  __shared__ const cudaGraphExec_t* flip_table;
  __shared__ int32_t flip_context_lo;
  const DeviceLoopParams& q = p.loop;
  DeviceLoopControl* c = p.control;
  const int32_t tid = static_cast<int32_t>(threadIdx.x);
  const int32_t warp = tid / 32, lane = tid % 32;
  // Behind a step's postprocess: its FINISHED stores are visible after the wait.
  kernels::GridDepWait();
  const int32_t running = LoadVolatile(&c->running);
  const int32_t pause_word = LoadVolatile(&c->pause);
  const int32_t context_lo = c->context_lo, context_hi = c->context_hi;
  // state, prompt_len, generated, last_token: one 16-byte load (static_asserts below).
  int4 row = make_int4(k::kSlotFree, 0, 0, 0);
  if (tid < q.num_slots) row = __ldcv(reinterpret_cast<const int4*>(&q.slots[tid]));
  unsigned long long steps = 0;
  if (tid == 0) {
    steps = LoadVolatile(&c->steps);
    // One thread reads the host's offer and shares it, so the block decides as one.
    offer = LoadVolatile(reinterpret_cast<const unsigned long long*>(&c->offer));
  }
  // A decode graph the host launched itself: the host-driven mode, no loop to continue. Uniform
  // across the block, so the barriers below are reached by all or none.
  if (running == 0) return;
  cudaGraphExec_t exec = nullptr;  // warp 0: lane b holds bucket b's current exec
  if (warp == 0 && lane < q.num_buckets) exec = c->table[lane];
  if (tid == 0) max_context = 0;
  int32_t state = row.x;
  if (state == k::kSlotReady) {
    // Pairs with the fence before the prefill postprocess's READY store: this step's kernels
    // read the row's token, counts and KV that the prefill wrote, and the context is re-read
    // after the fence.
    __threadfence();
    k::SlotRow& s = q.slots[tid];
    *static_cast<volatile int32_t*>(&s.state) = k::kSlotActive;
    state = k::kSlotActive;
    row.y = LoadVolatile(&s.prompt_len);
    row.z = LoadVolatile(&s.generated);
  }
  const bool active = state == k::kSlotActive;
  const int32_t context = active ? row.y + row.z : 0;
  // Stable compaction: ascending slot order, as the host-driven mode's row list.
  const uint32_t ballot = __ballot_sync(0xffffffffu, active);
  const int32_t num_warps = static_cast<int32_t>(blockDim.x) / 32;
  if (lane == 0) warp_offset[warp + 1] = __popc(ballot);
  __syncthreads();  // max_context = 0 is visible before anyone raises it
  if (active) atomicMax(&max_context, context);
  __syncthreads();
  if (tid == 0) {
    warp_offset[0] = 0;
    for (int32_t w = 1; w <= num_warps; ++w) warp_offset[w] += warp_offset[w - 1];
  }
  __syncthreads();
  const int32_t n = warp_offset[num_warps];
  const bool pause = pause_word != 0;
  const bool outside = max_context <= context_lo || max_context > context_hi;
  // The longest context has just left the window: the offered regime takes over at this step if
  // the context lies in its take range, where the host-driven mode would update to exactly that
  // regime (DeviceLoop::OfferFlip).
  const int32_t take_lo = static_cast<int32_t>((offer & 0xffffffffull) >> 2);
  const int32_t offer_hi = static_cast<int32_t>(offer >> 32);
  const bool flip = n > 0 && !pause && outside && (offer & 1ull) != 0 && offer_hi > 0 &&
                    max_context > take_lo && max_context <= offer_hi;
  if (n == 0 || pause || (outside && !flip)) {
    if (tid == 0) Exit(p, n == 0 ? kLoopExitIdle : pause ? kLoopExitPaused : kLoopExitContext);
    return;
  }
  if (flip) {
    if (tid == 0) {
      __threadfence();  // the table was written before the offer word this thread has seen
      flip_table = LoadVolatile(&c->offer_table);
      flip_context_lo = LoadVolatile(&c->offer_context_lo);
    }
    __syncthreads();
    if (warp == 0 && lane < q.num_buckets) exec = flip_table[lane];
  }
  int32_t b = 0;
  while (b + 1 < q.num_buckets && q.buckets[b] < n) ++b;
  if (active) {
    q.row_slots[warp_offset[warp] + __popc(ballot & ((1u << lane) - 1u))] = tid;
  }
  for (int32_t r = n + tid; r < q.buckets[b]; r += static_cast<int32_t>(blockDim.x)) {
    q.row_slots[r] = -1;
  }
  if (warp != 0) return;
  exec = reinterpret_cast<cudaGraphExec_t>(
      __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(exec), b));
  if (tid != 0) return;
  // The tail-launched step starts after this whole graph has ended, so every row-list store
  // above is visible to it without a barrier.
  DeviceLoopState* st = p.state;
  // The claim is a device atomic (host-mapped memory need not support them); the host reads the
  // mirror.
  atomicAdd(reinterpret_cast<unsigned long long*>(&c->steps), 1ull);
  if (flip) {
    // Later steps of this launch run the offered table and window; the host sees the flip in the
    // mapped state before the step counter passes it.
    c->table = flip_table;
    c->context_lo = flip_context_lo;
    c->context_hi = offer_hi;
    *static_cast<volatile unsigned long long*>(reinterpret_cast<unsigned long long*>(&c->offer)) =
        0ull;
    *static_cast<volatile uint64_t*>(&st->flip_step) = steps + 1;
    __threadfence_system();
    *static_cast<volatile int32_t*>(&st->flips) = st->flips + 1;
  }
  *static_cast<volatile uint64_t*>(&st->steps) = steps + 1;
  *static_cast<volatile int32_t*>(&st->last_rows) = n;
  // The bucket's exec ends with this kernel, which decides the step after it. When the bucket
  // does not change, that exec is the running graph: its one pending self-launch.
  if (q.stamps != nullptr) kernels::StampStepLaunch(q.stamps);
  const cudaError_t err = cudaGraphLaunch(exec, cudaStreamGraphTailLaunch);
  if (err != cudaSuccess) {
    volatile int32_t* status = &st->status;
    if (*status == 0) *status = static_cast<int32_t>(err);
    Exit(p, kLoopExitError);
  }
}

static_assert(offsetof(k::SlotRow, state) == 0 && offsetof(k::SlotRow, prompt_len) == 4 &&
                  offsetof(k::SlotRow, generated) == 8 && alignof(k::SlotRow) <= 16 &&
                  sizeof(k::SlotRow) % 16 == 0,
              "the scheduler reads a row's first 16 bytes in one load");

absl::Status Validate(const DeviceLoopParams& p) {
  if (p.num_buckets < 1 || p.num_buckets > kDeviceLoopMaxBuckets) {
    return absl::InvalidArgumentError(absl::StrCat("device_loop.num_buckets must be in [1, ",
                                                   kDeviceLoopMaxBuckets, "], got ",
                                                   p.num_buckets));
  }
  for (int32_t i = 0; i < p.num_buckets; ++i) {
    if (p.buckets[i] < 1 || (i > 0 && p.buckets[i] <= p.buckets[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("device_loop.buckets[", i, "] = ", p.buckets[i],
                       ": buckets must be positive and strictly ascending"));
    }
  }
  if (p.num_slots < 1 || p.num_slots > kDeviceLoopMaxSlots ||
      p.num_slots > p.buckets[p.num_buckets - 1]) {
    return absl::InvalidArgumentError(
        absl::StrCat("device_loop.num_slots must be in [1, min(", kDeviceLoopMaxSlots,
                     ", largest bucket ", p.buckets[p.num_buckets - 1], ")], got ", p.num_slots));
  }
  if (p.slots == nullptr) return absl::InvalidArgumentError("device_loop.slots is null");
  if (p.row_slots == nullptr) return absl::InvalidArgumentError("device_loop.row_slots is null");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceLoop>> DeviceLoop::Create(const DeviceLoopParams& params,
                                                               cudaStream_t stream) {
  TS_RETURN_IF_ERROR(Validate(params));
  std::unique_ptr<DeviceLoop> loop(new DeviceLoop());
  TS_CUDA_RETURN_IF_ERROR(cudaMalloc(&loop->control_, sizeof(DeviceLoopControl)));
  TS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(loop->control_, 0, sizeof(DeviceLoopControl), stream));
  void* host = nullptr;
  TS_CUDA_RETURN_IF_ERROR(
      cudaHostAlloc(&host, sizeof(DeviceLoopState), cudaHostAllocMapped | cudaHostAllocPortable));
  loop->state_host_ = new (host) DeviceLoopState();
  void* alias = nullptr;
  TS_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&alias, host, 0));
  loop->state_device_ = static_cast<DeviceLoopState*>(alias);
  TS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&loop->done_, cudaEventDisableTiming));
  void* staging = nullptr;
  TS_CUDA_RETURN_IF_ERROR(cudaMallocHost(&staging, sizeof(DeviceLoopControl)));
  loop->staging_ = new (staging) DeviceLoopControl();
  void* offer_staging = nullptr;
  TS_CUDA_RETURN_IF_ERROR(cudaMallocHost(&offer_staging, sizeof(DeviceLoopControl)));
  loop->offer_staging_ = new (offer_staging) DeviceLoopControl();
  loop->params_ = params;
  absl::StatusOr<cudaGraphExec_t> exec =
      CaptureForDeviceLaunch([&](cudaStream_t s) { return loop->EnqueueKernel(s, /*pdl=*/false); });
  if (!exec.ok()) return exec.status();
  loop->exec_ = *exec;
  TS_CUDA_RETURN_IF_ERROR(cudaGraphUpload(loop->exec_, stream));
  return loop;
}

cudaError_t DeviceLoop::EnqueueKernel(cudaStream_t stream, bool pdl) const {
  const LoopKernelParams kp{.loop = params_, .control = control_, .state = state_device_};
  const int32_t threads = (params_.num_slots + 31) / 32 * 32;
  return kernels::LaunchWithPdl(SchedulerKernel, dim3(1), dim3(threads), 0, stream, pdl, kp);
}

absl::Status DeviceLoop::EnqueueScheduler(cudaStream_t stream) const {
  TS_CUDA_RETURN_IF_ERROR(EnqueueKernel(stream, /*pdl=*/true));
  return absl::OkStatus();
}

absl::Status DeviceLoop::BindTable(const cudaGraphExec_t* table) {
  if (table == nullptr) return absl::InvalidArgumentError("device_loop.table is null");
  table_ = table;
  return absl::OkStatus();
}

DeviceLoop::~DeviceLoop() {
  // The owner has waited for the loop (a destroyed exec may still run, the driver defers it; the
  // pause word and the state must outlive it).
  if (launched_) (void)cudaEventSynchronize(done_);
  if (exec_ != nullptr) (void)cudaGraphExecDestroy(exec_);
  if (done_ != nullptr) (void)cudaEventDestroy(done_);
  if (control_ != nullptr) (void)cudaFree(control_);
  if (state_host_ != nullptr) (void)cudaFreeHost(state_host_);
  if (staging_ != nullptr) (void)cudaFreeHost(staging_);
  if (offer_staging_ != nullptr) (void)cudaFreeHost(offer_staging_);
}

absl::Status DeviceLoop::Launch(cudaStream_t stream, int32_t context_lo, int32_t context_hi) {
  if (table_ == nullptr) return absl::FailedPreconditionError("device loop: no table bound");
  if (Running()) return absl::FailedPreconditionError("device loop: launched while running");
  if (context_lo >= context_hi) {
    return absl::InvalidArgumentError(
        absl::StrCat("device loop: empty context window (", context_lo, ", ", context_hi, "]"));
  }
  // Pinned staging, read by the copy when the stream gets there: the previous loop has exited,
  // so the previous copy has too.
  staging_->table = table_;
  staging_->context_lo = context_lo;
  staging_->context_hi = context_hi;
  staging_->running = 1;
  staging_->offer = 0;  // an offer made for the last launch is not this one's
  constexpr size_t kFirst = offsetof(DeviceLoopControl, table);
  constexpr size_t kEnd = offsetof(DeviceLoopControl, offer) + sizeof(uint64_t);
  TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(reinterpret_cast<char*>(control_) + kFirst,
                                          reinterpret_cast<const char*>(staging_) + kFirst,
                                          kEnd - kFirst, cudaMemcpyHostToDevice, stream));
  TS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(&control_->pause, 0, sizeof(int32_t), stream));
  TS_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec_, stream));
  TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(done_, stream));
  launched_ = true;
  return absl::OkStatus();
}

absl::Status DeviceLoop::RequestPause(cudaStream_t control_stream) {
  TS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(&control_->pause, 1, sizeof(int32_t), control_stream));
  return absl::OkStatus();
}

absl::Status DeviceLoop::OfferFlip(const cudaGraphExec_t* table, int32_t take_lo,
                                   int32_t context_lo, int32_t context_hi,
                                   cudaStream_t control_stream) {
  if (table == nullptr) return absl::InvalidArgumentError("device loop: offered table is null");
  if (context_lo < 0 || take_lo < context_lo || take_lo >= context_hi || take_lo >= (1 << 29)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device loop: offered take range (", take_lo, ", ", context_hi, "] is empty, too large or ",
        "outside the offered window (", context_lo, ", ", context_hi, "]"));
  }
  // The table and window bottom first, then the word that makes them an offer: a scheduler that
  // reads the word reads them after it. Pinned sources, so the copies are waited for before
  // returning (the next offer reuses them).
  offer_staging_->offer_table = table;
  offer_staging_->offer_context_lo = context_lo;
  offer_staging_->offer =
      (static_cast<uint64_t>(context_hi) << 32) | (static_cast<uint64_t>(take_lo) << 2) | 1u;
  constexpr size_t kFirst = offsetof(DeviceLoopControl, offer_table);
  constexpr size_t kEnd = offsetof(DeviceLoopControl, offer_context_lo) + sizeof(int32_t);
  TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(reinterpret_cast<char*>(control_) + kFirst,
                                          reinterpret_cast<const char*>(offer_staging_) + kFirst,
                                          kEnd - kFirst, cudaMemcpyHostToDevice, control_stream));
  TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&control_->offer, &offer_staging_->offer,
                                          sizeof(uint64_t), cudaMemcpyHostToDevice,
                                          control_stream));
  TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(control_stream));
  return absl::OkStatus();
}

absl::Status DeviceLoop::WithdrawOffer(cudaStream_t control_stream) {
  // A memset is no single 64-bit store either; each torn state has a zero half (DeviceLoopControl).
  TS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(&control_->offer, 0, sizeof(uint64_t), control_stream));
  TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(control_stream));
  return absl::OkStatus();
}

bool DeviceLoop::Running() const {
  return launched_ && cudaEventQuery(done_) == cudaErrorNotReady;
}

absl::Status DeviceLoop::Wait() const {
  if (launched_) TS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(done_));
  return absl::OkStatus();
}

uint64_t DeviceLoop::steps() const {
  return *static_cast<const volatile uint64_t*>(&state_host_->steps);
}

int32_t DeviceLoop::exit_reason() const {
  return *static_cast<const volatile int32_t*>(&state_host_->exit_reason);
}

int32_t DeviceLoop::flips() const {
  return *static_cast<const volatile int32_t*>(&state_host_->flips);
}

uint64_t DeviceLoop::flip_step() const {
  return *static_cast<const volatile uint64_t*>(&state_host_->flip_step);
}

absl::Status DeviceLoop::status() const {
  const int32_t s = *static_cast<const volatile int32_t*>(&state_host_->status);
  if (s == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("device loop: a device-side graph launch failed: ",
                                          cudaGetErrorString(static_cast<cudaError_t>(s))));
}

}  // namespace ts::graphs
