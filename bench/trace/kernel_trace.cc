// libts_kernel_trace.so: a CUPTI injection library that records every kernel's start and end on
// the GPU, graph nodes included, so that a captured decode step's timeline (PDL overlaps, gaps,
// stragglers) can be read kernel by kernel. ncu times each node alone and drops the overlap; this
// keeps the graph as it runs. Load it into any CUDA program:
//   CUDA_INJECTION64_PATH=.../libts_kernel_trace.so TS_KERNEL_TRACE=trace.csv <program>
// One CSV line per kernel: start_ns,end_ns,graph_id,node_id,grid_x,grid_y,grid_z,cluster_y,name.
// bench/trace/step_timeline.py turns it into a per-op table of one decode step.
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr size_t kBufferBytes = 8 << 20;

struct Record {
  uint64_t start, end, node;
  uint32_t graph;
  int32_t gx, gy, gz;
  uint32_t cluster_y;
  std::string name;
};

std::mutex mu;
std::vector<Record>* records = new std::vector<Record>();

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* a = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  while (cuptiActivityGetNextRecord(buffer, valid, &a) == CUPTI_SUCCESS) {
    if (a->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(a);
    records->push_back({k->start, k->end, k->graphNodeId, k->graphId, k->gridX, k->gridY, k->gridZ,
                        k->clusterY, k->name != nullptr ? k->name : "?"});
  }
  free(buffer);
}

void Flush() {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  const char* path = std::getenv("TS_KERNEL_TRACE");
  FILE* f = std::fopen(path != nullptr ? path : "kernel_trace.csv", "w");
  if (f == nullptr) return;
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(f, "start_ns,end_ns,graph_id,node_id,grid_x,grid_y,grid_z,cluster_y,name\n");
  for (const Record& r : *records) {
    std::string name = r.name;
    for (char& c : name) {
      if (c == ',') c = ';';
    }
    std::fprintf(f, "%llu,%llu,%u,%llu,%d,%d,%d,%u,%s\n", (unsigned long long)r.start,
                 (unsigned long long)r.end, r.graph, (unsigned long long)r.node, r.gx, r.gy, r.gz,
                 r.cluster_y, name.c_str());
  }
  std::fclose(f);
  std::fprintf(stderr, "kernel_trace: %zu kernels\n", records->size());
}

}  // namespace

extern "C" int InitializeInjection(void) {
  if (cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
    std::fprintf(stderr, "kernel_trace: CUPTI setup failed\n");
    return 0;
  }
  std::atexit(Flush);
  return 1;
}
