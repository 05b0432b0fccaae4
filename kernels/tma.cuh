// Hopper's tensor memory accelerator (TMA) and the shared-memory mbarriers that track its copies:
// thin wrappers over the PTX instructions (the PTX ISA's "cp.async.bulk.tensor" and "mbarrier"
// sections), plus the host encoding of a tensor map. One definition each; the kernels that use
// them (kernels/gemv_wgmma.cu) say how their pipelines use the phases.
//
// An mbarrier completes a phase when its pending arrivals reach zero and the transaction bytes
// announced with ExpectTx have all landed. Waiters name the phase by parity: Wait(bar, p) returns
// once the phase with parity p has completed (phase 0 first).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/statusor.h"

namespace ts::kernels::tma {

__device__ __forceinline__ void MbarrierInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes initialised mbarriers visible to the async proxy (TMA) and to the cluster; a CTA barrier
// must follow before anyone uses them.
__device__ __forceinline__ void FenceMbarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also announces `bytes` of transactions for the current phase.
__device__ __forceinline__ void ArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void Arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void Wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Brings the tensor map (a __grid_constant__ kernel parameter) into the TMA unit's cache ahead of
// the first copy.
__device__ __forceinline__ void PrefetchTensorMap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Copies the 2-D box at (x = inner coordinate, y = row) of `map` into shared memory at `dst`
// (aligned as the map's swizzle needs), completing `bytes` of transactions on `bar`. Elements
// outside the tensor are written as zeros and still count.
__device__ __forceinline__ void Load2d(uint32_t dst, const CUtensorMap* map, int32_t x, int32_t y,
                                       uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

// Host: the tensor map of a row-major bf16 matrix [rows, cols] (cols a multiple of 8, base
// 16-byte aligned), read in boxes of box_rows x 64 columns (128 bytes, the 128-byte swizzle that
// kernels/wgmma.cuh's descriptors expect), zeros outside the matrix. A pure host computation
// through the driver's cuTensorMapEncodeTiled (found once at run time, so nothing links
// libcuda): capture-safe.
absl::StatusOr<CUtensorMap> EncodeBf16RowsSw128(const void* base, int64_t rows, int64_t cols,
                                                int32_t box_rows);

}  // namespace ts::kernels::tma
