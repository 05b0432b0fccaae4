// Hopper's warpgroup MMA (wgmma, sm_90a only): thin wrappers for the one operand layout the
// wgmma GEMV kernel uses (kernels/gemv_wgmma.cu). Both operands in shared memory, K-major (each
// row's k values contiguous), bf16 in, fp32 accumulate in registers; the PTX ISA's "Asynchronous
// Warpgroup Level Matrix Multiply-Accumulate" section defines the descriptors and fragment layouts.
//
// Shared-memory layout the descriptors describe: rows of 64 bf16 (128 bytes), 16-byte chunk c of
// row r stored at chunk c ^ (r % 8) (the 128-byte swizzle, which is also what a TMA copy with
// CU_TENSOR_MAP_SWIZZLE_128B writes), 8-row groups 1024 bytes apart, and every 8-row group
// 1024-byte aligned. Advancing k by 16 inside a row adds 32 bytes to the start address; the
// hardware applies the swizzle to the final address.
//
// Accumulator layout of m64nN (fp32): warp w of the warpgroup owns rows 16 w..16 w + 15; with lane
// = 4 g + t, d[4 j + e] is row 16 w + g + 8 (e / 2), column 8 j + 2 t + (e % 2) - the mma.m16n8
// C fragment repeated over the N / 8 column blocks.
//
// Protocol: operands written by the generic proxy (st.shared, cp.async) need FenceProxyAsync and a
// barrier first; operands a TMA copy wrote are visible once its mbarrier phase completes. The
// warpgroup then issues WgmmaFence, the MMAs, WgmmaCommit, and WgmmaWait<n> before touching d or
// letting the operands' memory be overwritten.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ts::kernels::wgmma {

// Descriptor of a K-major, 128-byte-swizzled operand tile starting at shared address `addr`
// (bits 0-13: address / 16; 16-29: leading offset, unused with this swizzle; 32-45: 8-row group
// stride / 16; 62-63: swizzle mode 1 = 128 bytes).
__device__ __forceinline__ uint64_t DescSw128(uint32_t addr) {
  return uint64_t{(addr & 0x3FFFF) >> 4} | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// d[64 x N] += A[64 x 16] B[N x 16]^T; A and B are descriptors (DescSw128) of K-major tiles.
__device__ __forceinline__ void WgmmaBf16M64N32(float (&d)[16], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
      "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

__device__ __forceinline__ void WgmmaBf16M64N64(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
      "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

__device__ __forceinline__ void WgmmaBf16M64N128(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

template <int kN>
__device__ __forceinline__ void WgmmaBf16(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b) {
  static_assert(kN == 32 || kN == 64 || kN == 128, "add the wrapper for this N");
  if constexpr (kN == 32) {
    WgmmaBf16M64N32(d, desc_a, desc_b);
  } else if constexpr (kN == 64) {
    WgmmaBf16M64N64(d, desc_a, desc_b);
  } else {
    WgmmaBf16M64N128(d, desc_a, desc_b);
  }
}

}  // namespace ts::kernels::wgmma
