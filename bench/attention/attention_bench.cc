// tailserve-attn-bench: paged decode attention on a ragged batch vs a uniform batch with the same
// total tokens, static split vs work queue; plus one causal prefill. Each variant is captured in a
// CUDA graph (as in the decode step) and timed per replay with CUDA events after warm-up; the
// table reports the median (and p10/p90) in us, the achieved GB/s of K/V read, and the floor (KV
// bytes at the device-to-device copy bandwidth measured in the same run, bench/common/copy_roof.h)
// as a share of the median.
//
// The prefill is one chunk of prefill_len queries after a cached prefix of prefill_start tokens
// (0: a fresh prompt; > 0: chunked prefill), timed at PrefillAttentionSplits' choice and a sweep of
// key splits around it, with TFLOP/s over the (start + i + 1) keys query i attends to.
//
//   tailserve-attn-bench [--num_seqs=32] [--min_ctx=100] [--max_ctx=4000] [--q_heads=32]
//                        [--kv_heads=8] [--head_dim=128] [--iters=100] [--warmup=10]
//                        [--prefill_len=2048] [--prefill_start=0]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "bench/common/copy_roof.h"
#include "bench/common/graph_timing.h"
#include "kernels/decode_attention.cuh"
#include "kernels/prefill_attention.cuh"

namespace ts::bench {
namespace {

using kernels::DecodeAttentionMode;
using kernels::DecodeAttentionParams;

struct Options {
  int num_seqs = 32;
  int min_ctx = 100;
  int max_ctx = 4000;
  int q_heads = 32;
  int kv_heads = 8;
  int head_dim = 128;
  int block_size = 16;
  int max_splits = 64;
  int iters = 100;
  int warmup = 10;
  int prefill_len = 2048;
  int prefill_start = 0;
};

// The partials' capacity in (token, split) pairs, as the engine sizes it (CudaModel's
// kPrefillSplitRows).
constexpr int32_t kPrefillSplitRows = 2048;

bool ParseFlag(const char* arg, const char* name, int* out) {
  const std::string prefix = absl::StrCat("--", name, "=");
  if (std::strncmp(arg, prefix.c_str(), prefix.size()) != 0) return false;
  *out = std::atoi(arg + prefix.size());
  return true;
}

bool Parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (!(ParseFlag(a, "num_seqs", &o->num_seqs) || ParseFlag(a, "min_ctx", &o->min_ctx) ||
          ParseFlag(a, "max_ctx", &o->max_ctx) || ParseFlag(a, "q_heads", &o->q_heads) ||
          ParseFlag(a, "kv_heads", &o->kv_heads) || ParseFlag(a, "head_dim", &o->head_dim) ||
          ParseFlag(a, "block_size", &o->block_size) ||
          ParseFlag(a, "max_splits", &o->max_splits) || ParseFlag(a, "iters", &o->iters) ||
          ParseFlag(a, "warmup", &o->warmup) || ParseFlag(a, "prefill_len", &o->prefill_len) ||
          ParseFlag(a, "prefill_start", &o->prefill_start))) {
      std::fprintf(stderr, "unknown flag %s\n", a);
      return false;
    }
  }
  return o->num_seqs > 0 && o->min_ctx > 0 && o->max_ctx >= o->min_ctx && o->iters > 0 &&
         o->prefill_start >= 0;
}

template <typename T>
T* DeviceAlloc(size_t n) {
  T* p = nullptr;
  BENCH_CUDA(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return p;
}

// Random bf16 in [-1, 1], never zero (zeros can run faster than real data).
void FillRandom(__nv_bfloat16* dst, size_t n, uint64_t seed) {
  std::vector<__nv_bfloat16> h(n);
  uint64_t x = seed;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    float f = static_cast<float>(x >> 40) / static_cast<float>(1ull << 24) * 2.f - 1.f;
    if (std::fabs(f) < 1e-3f) f = 1e-3f;
    h[i] = __float2bfloat16(f);
  }
  BENCH_CUDA(cudaMemcpy(dst, h.data(), n * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
}

struct Timing {
  double median_us, p10_us, p90_us;
};

// Captures fn into a graph and times `iters` replays one by one with events.
Timing TimeGraph(const Options& o, cudaStream_t stream,
                 const std::function<absl::Status(cudaStream_t)>& fn) {
  const std::vector<double> us = TimeGraphReplays(stream, o.warmup, o.iters, fn);
  return {us[us.size() / 2], us[us.size() / 10], us[us.size() * 9 / 10]};
}

struct Batch {
  std::vector<int32_t> ctx;
  __nv_bfloat16 *q, *k, *v, *out;
  int32_t *tables, *dctx;
  int32_t num_blocks, max_blocks;
  void* ws;
  size_t ws_bytes;
  double kv_bytes;  // K and V bytes the attention must read
};

Batch MakeBatch(const Options& o, std::vector<int32_t> ctx, uint64_t seed) {
  Batch b;
  b.ctx = std::move(ctx);
  b.max_blocks = 0;
  int64_t total_blocks = 0;
  double tokens = 0;
  for (int32_t c : b.ctx) {
    const int blocks = (c + o.block_size - 1) / o.block_size;
    b.max_blocks = std::max(b.max_blocks, blocks);
    total_blocks += blocks;
    tokens += c;
  }
  b.num_blocks = static_cast<int32_t>(total_blocks);
  std::vector<int32_t> perm(b.num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937 gen(static_cast<uint32_t>(seed));
  std::shuffle(perm.begin(), perm.end(), gen);  // pages scattered as in a long-running server
  std::vector<int32_t> tables(static_cast<size_t>(o.num_seqs) * b.max_blocks, 0);
  size_t next = 0;
  for (int s = 0; s < o.num_seqs; ++s) {
    for (int j = 0; j < (b.ctx[s] + o.block_size - 1) / o.block_size; ++j)
      tables[static_cast<size_t>(s) * b.max_blocks + j] = perm[next++];
  }
  const size_t kv_elems =
      static_cast<size_t>(b.num_blocks) * o.kv_heads * o.block_size * o.head_dim;
  const size_t q_elems = static_cast<size_t>(o.num_seqs) * o.q_heads * o.head_dim;
  b.q = DeviceAlloc<__nv_bfloat16>(q_elems);
  b.out = DeviceAlloc<__nv_bfloat16>(q_elems);
  b.k = DeviceAlloc<__nv_bfloat16>(kv_elems);
  b.v = DeviceAlloc<__nv_bfloat16>(kv_elems);
  FillRandom(b.q, q_elems, seed + 1);
  FillRandom(b.k, kv_elems, seed + 2);
  FillRandom(b.v, kv_elems, seed + 3);
  b.tables = DeviceAlloc<int32_t>(tables.size());
  b.dctx = DeviceAlloc<int32_t>(b.ctx.size());
  BENCH_CUDA(cudaMemcpy(b.tables, tables.data(), tables.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(b.dctx, b.ctx.data(), b.ctx.size() * 4, cudaMemcpyHostToDevice));
  b.ws_bytes =
      kernels::DecodeAttentionWorkspaceBytes(o.num_seqs, o.q_heads, o.head_dim, o.max_splits);
  b.ws = DeviceAlloc<uint8_t>(b.ws_bytes);
  CheckOk(kernels::ResetDecodeAttentionWorkspace(b.ws, b.ws_bytes, nullptr), "reset workspace");
  b.kv_bytes = tokens * o.kv_heads * o.head_dim * 2.0 * 2.0;
  return b;
}

void FreeBatch(Batch& b) {
  for (void* p :
       {static_cast<void*>(b.q), static_cast<void*>(b.out), static_cast<void*>(b.k),
        static_cast<void*>(b.v), static_cast<void*>(b.tables), static_cast<void*>(b.dctx), b.ws}) {
    cudaFree(p);
  }
}

DecodeAttentionParams Params(const Options& o, const Batch& b) {
  DecodeAttentionParams p;
  p.q = b.q;
  p.k_cache = b.k;
  p.v_cache = b.v;
  p.block_tables = b.tables;
  p.context_lens = b.dctx;
  p.out = b.out;
  p.workspace = b.ws;
  p.workspace_bytes = b.ws_bytes;
  p.num_seqs = o.num_seqs;
  p.num_q_heads = o.q_heads;
  p.num_kv_heads = o.kv_heads;
  p.head_dim = o.head_dim;
  p.block_size = o.block_size;
  p.num_blocks = b.num_blocks;
  p.max_blocks_per_seq = b.max_blocks;
  p.scale = 1.f / std::sqrt(static_cast<float>(o.head_dim));
  p.max_splits = o.max_splits;
  return p;
}

std::vector<float> Download(const Options& o, const Batch& b) {
  std::vector<__nv_bfloat16> h(static_cast<size_t>(o.num_seqs) * o.q_heads * o.head_dim);
  BENCH_CUDA(cudaMemcpy(h.data(), b.out, h.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<float> f(h.size());
  for (size_t i = 0; i < h.size(); ++i) f[i] = __bfloat162float(h[i]);
  return f;
}

void RunDecode(const Options& o, const char* name, std::vector<int32_t> ctx, int sms,
               double copy_gbps, cudaStream_t stream) {
  Batch b = MakeBatch(o, std::move(ctx), 1234);
  kernels::SplitChoiceInputs in;
  in.num_seqs = o.num_seqs;
  in.num_q_heads = o.q_heads;
  in.num_kv_heads = o.kv_heads;
  in.max_context_len = *std::max_element(b.ctx.begin(), b.ctx.end());
  in.num_sms = sms;
  in.max_splits = o.max_splits;
  const absl::StatusOr<int32_t> per_sm =
      kernels::DecodeAttentionCtasPerSm(o.head_dim, o.q_heads, o.kv_heads);
  CheckOk(per_sm.status(), "DecodeAttentionCtasPerSm");
  in.ctas_per_sm = *per_sm;
  std::printf("%-8s decode kernel: %d CTAs per SM\n", name, *per_sm);
  const int chosen = kernels::ChooseNumSplits(in);
  const kernels::WorkQueueConfig wq = kernels::ChooseWorkQueueConfig(in, o.block_size);

  struct Variant {
    std::string label;
    DecodeAttentionParams p;
  };
  std::vector<Variant> variants;
  // A sweep around the heuristic's choice, so the table shows what it leaves on the table.
  std::vector<int> sweep = {1, 2, 3, 4, 6, 8, 12, 16, chosen};
  std::sort(sweep.begin(), sweep.end());
  sweep.erase(std::unique(sweep.begin(), sweep.end()), sweep.end());
  for (int splits : sweep) {
    if (splits > o.max_splits) continue;
    DecodeAttentionParams p = Params(o, b);
    p.mode = DecodeAttentionMode::kStaticSplit;
    p.num_splits = splits;
    variants.push_back(
        {absl::StrCat("static splits=", splits, splits == chosen ? " (chosen)" : ""), p});
  }
  for (int chunk : {wq.chunk_tokens, 128, 256, 512}) {
    for (int claim : {1, 4}) {
      DecodeAttentionParams p = Params(o, b);
      p.mode = DecodeAttentionMode::kWorkQueue;
      p.chunk_tokens = chunk;
      p.persistent_ctas = wq.persistent_ctas;
      p.tiles_per_claim = claim;
      variants.push_back(
          {absl::StrCat("queue chunk=", chunk, " claim=", claim, " ctas=", wq.persistent_ctas), p});
    }
  }
  const double floor_us = b.kv_bytes / (copy_gbps * 1e3);
  std::vector<float> baseline;
  for (const Variant& v : variants) {
    const Timing t = TimeGraph(
        o, stream, [&](cudaStream_t s) { return kernels::LaunchDecodeAttention(v.p, s); });
    BENCH_CUDA(cudaStreamSynchronize(stream));
    const std::vector<float> out = Download(o, b);
    double diff = 0;
    if (baseline.empty()) baseline = out;
    for (size_t i = 0; i < out.size(); ++i)
      diff = std::max(diff, static_cast<double>(std::fabs(out[i] - baseline[i])));
    std::printf("%-8s %-40s %9.1f %9.1f %9.1f %8.0f %6.0f%% %10.2e\n", name, v.label.c_str(),
                t.median_us, t.p10_us, t.p90_us, b.kv_bytes / (t.median_us * 1e3),
                100 * floor_us / t.median_us, diff);
  }
  std::printf("%-8s KV read %.1f MB, floor at %.0f GB/s (copy) %.1f us\n", name, b.kv_bytes / 1e6,
              copy_gbps, floor_us);
  FreeBatch(b);
}

void RunPrefill(const Options& o, int sms, cudaStream_t stream) {
  Options po = o;
  po.num_seqs = 1;
  const int32_t len = o.prefill_len;
  const int32_t start = o.prefill_start;
  Batch b = MakeBatch(po, {start + len}, 99);  // the chunk's own K/V sit after the prefix
  const size_t q_elems = static_cast<size_t>(len) * o.q_heads * o.head_dim;
  __nv_bfloat16* q = DeviceAlloc<__nv_bfloat16>(q_elems);    // [len, q_heads, head_dim]
  __nv_bfloat16* out = DeviceAlloc<__nv_bfloat16>(q_elems);  // [len, q_heads, head_dim]
  FillRandom(q, q_elems, 7);
  const int32_t host_meta[3] = {0, len, start};  // cu_seqlens [2], start_pos [1]
  int32_t* meta = DeviceAlloc<int32_t>(3);
  BENCH_CUDA(cudaMemcpy(meta, host_meta, sizeof(host_meta), cudaMemcpyHostToDevice));
  const size_t ws_bytes =
      kernels::PrefillAttentionWorkspaceBytes(kPrefillSplitRows, o.q_heads, o.head_dim);
  char* ws = DeviceAlloc<char>(ws_bytes);
  kernels::PrefillAttentionParams p;
  p.q = q;
  p.k_cache = b.k;
  p.v_cache = b.v;
  p.block_tables = b.tables;
  p.cu_seqlens = meta;
  p.start_pos = meta + 2;
  p.out = out;
  p.num_seqs = 1;
  p.total_tokens = len;
  p.max_q_len = len;
  p.num_q_heads = o.q_heads;
  p.num_kv_heads = o.kv_heads;
  p.head_dim = o.head_dim;
  p.block_size = o.block_size;
  p.num_blocks = b.num_blocks;
  p.max_blocks_per_seq = b.max_blocks;
  p.scale = 1.f / std::sqrt(static_cast<float>(o.head_dim));
  p.partial_out = reinterpret_cast<float*>(ws);
  p.partial_lse = reinterpret_cast<float*>(
      ws + kernels::PrefillAttentionLseOffset(kPrefillSplitRows, o.q_heads, o.head_dim));
  const int32_t chosen = kernels::PrefillAttentionSplits(len, len, 1, o.q_heads, o.kv_heads,
                                                         start + len, sms, kPrefillSplitRows);
  // Query i attends to start + i + 1 keys; 4 * D flops per query-key pair and head (QK^T, PV).
  const double pairs = static_cast<double>(len) * start + 0.5 * len * (len + 1.0);
  const double flops = pairs * o.q_heads * 4.0 * o.head_dim;
  std::vector<int32_t> sweep = {1, 2, 3, 4, 6, 8, 12, 16, chosen};
  std::sort(sweep.begin(), sweep.end());
  sweep.erase(std::unique(sweep.begin(), sweep.end()), sweep.end());
  std::vector<__nv_bfloat16> baseline, got(q_elems);
  for (const int32_t splits : sweep) {
    if (static_cast<int64_t>(splits) * len > kPrefillSplitRows && splits > 1) continue;
    p.num_splits = splits;
    const Timing t =
        TimeGraph(o, stream, [&](cudaStream_t s) { return kernels::LaunchPrefillAttention(p, s); });
    BENCH_CUDA(cudaStreamSynchronize(stream));
    BENCH_CUDA(cudaMemcpy(got.data(), out, q_elems * 2, cudaMemcpyDeviceToHost));
    if (baseline.empty()) baseline = got;
    double diff = 0;
    for (size_t i = 0; i < q_elems; ++i) {
      diff = std::max(diff, static_cast<double>(std::fabs(__bfloat162float(got[i]) -
                                                          __bfloat162float(baseline[i]))));
    }
    const std::string label =
        absl::StrCat("start=", start, " splits=", splits, splits == chosen ? " (chosen)" : "");
    std::printf("prefill  len=%-5d %-30s %9.1f %9.1f %9.1f %8.1f TFLOP/s %10.2e\n", len,
                label.c_str(), t.median_us, t.p10_us, t.p90_us, flops / (t.median_us * 1e6), diff);
  }
  cudaFree(q);
  cudaFree(out);
  cudaFree(meta);
  cudaFree(ws);
  FreeBatch(b);
}

int Main(int argc, char** argv) {
  Options o;
  if (!Parse(argc, argv, &o)) {
    std::fprintf(stderr, "usage: see the header of bench/attention/attention_bench.cc\n");
    return 2;
  }
  int dev = 0, sms = 0;
  BENCH_CUDA(cudaGetDevice(&dev));
  BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, dev));
  std::printf(
      "device %s, %d SMs; %d seqs, Hq=%d Hkv=%d D=%d, block %d, graph replays, median of "
      "%d\n",
      prop.name, sms, o.num_seqs, o.q_heads, o.kv_heads, o.head_dim, o.block_size, o.iters);
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  std::mt19937 gen(42);
  std::uniform_int_distribution<int> dist(o.min_ctx, o.max_ctx);
  std::vector<int32_t> ragged(o.num_seqs);
  for (int32_t& c : ragged) c = dist(gen);
  const int64_t total = std::accumulate(ragged.begin(), ragged.end(), int64_t{0});
  const std::vector<int32_t> uniform(o.num_seqs, static_cast<int32_t>(total / o.num_seqs));

  const double copy_gbps = MeasureCopyBandwidthGbps();
  std::printf("device-to-device copy: %.0f GB/s (read + write)\n", copy_gbps);
  std::printf("%-8s %-40s %9s %9s %9s %8s %7s %10s\n", "batch", "variant", "med us", "p10 us",
              "p90 us", "GB/s", "floor", "maxdiff");
  RunDecode(o, "ragged", ragged, sms, copy_gbps, stream);
  RunDecode(o, "uniform", uniform, sms, copy_gbps, stream);
  if (o.prefill_len > 0) RunPrefill(o, sms, stream);
  BENCH_CUDA(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace
}  // namespace ts::bench

int main(int argc, char** argv) {
  return ts::bench::Main(argc, argv);
}
