// NCCL 2.28 device-API structs in the layout of the library actually loaded, for
// engine_nccl_graphs_test. The installed header's structs are not those of every 2.28 library:
// 2.28.7 added GIN, which inserted ncclDevCommRequirements::barrierCount before lsaBarrierCount,
// grew ncclWindow_vidmem (inlined in ncclDevComm, so every later field moved) and appended fields
// to ncclDevComm (checked against NVIDIA/nccl's tags v2.28.3-1, v2.28.7-1 and v2.28.9-1). The GPU
// machine has had 2.28.3 (docs/gpu-facts.md, Software on the GPU machine) while this toolkit
// ships 2.28.9, so for a 2.28.3 library the requirements go in, and the device communicator comes
// out, in 2.28.3's layout, converted to the header's for the kernels (which read only fields
// that 2.28.3 has).
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ts::pipeline::testing {

struct ReqsV22803 {
  ncclDevResourceRequirements_t* resourceRequirementsList;
  ncclTeamRequirements_t* teamRequirementsList;
  bool lsaMultimem;
  int lsaBarrierCount;
};
struct WindowV22803 {  // the prefix ncclWindow_vidmem still starts with
  void* winHost;
  char* lsaFlatBase;
  int lsaRank;
  int worldRank;
  uint32_t stride4G;
  uint32_t mcOffset4K;
};
struct DevCommV22803 {
  int rank, nRanks;
  uint32_t nRanks_rcp32;
  int lsaRank, lsaSize;
  uint32_t lsaSize_rcp32;
  ncclDevCommWindowTable* windowTable;
  ncclWindow_t resourceWindow;
  WindowV22803 resourceWindow_inlined;
  ncclMultimemHandle_t lsaMultimem;
  ncclLsaBarrierHandle_t lsaBarrier;
};

// Everything before resourceWindow_inlined, and that struct's 2.28.3 part, kept their places.
static_assert(offsetof(DevCommV22803, resourceWindow_inlined) ==
              offsetof(ncclDevComm, resourceWindow_inlined));
static_assert(offsetof(WindowV22803, mcOffset4K) == offsetof(ncclWindow_vidmem, mcOffset4K));

inline ncclDevComm FromV22803(const DevCommV22803& o) {
  ncclDevComm d;
  std::memset(&d, 0, sizeof(d));  // no GIN: its fields stay zero, as a 2.28.9 library leaves them
  std::memcpy(&d, &o, offsetof(DevCommV22803, resourceWindow_inlined));
  std::memcpy(&d.resourceWindow_inlined, &o.resourceWindow_inlined, sizeof(WindowV22803));
  d.lsaMultimem = o.lsaMultimem;
  d.lsaBarrier = o.lsaBarrier;
  return d;
}

enum class Layout { kHeader, kV22803, kUnknown };

// kHeader: the header describes the library; kV22803: use the structs above; kUnknown: neither.
inline Layout LayoutOf(int library) {
  auto gin_era = [](int v) { return v >= 22807 && v <= 22809; };  // 2.28.7 and 2.28.9: one layout
  if (library == NCCL_VERSION_CODE || (gin_era(library) && gin_era(NCCL_VERSION_CODE))) {
    return Layout::kHeader;
  }
  if (library == 22803 && gin_era(NCCL_VERSION_CODE)) return Layout::kV22803;
  return Layout::kUnknown;
}

}  // namespace ts::pipeline::testing
