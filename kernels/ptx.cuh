// Thin wrappers over the PTX instructions that several kernels stage shared memory with
// (cp.async), load mma fragments with (ldmatrix) and multiply with (mma): one definition each.
// The fragment layouts are those of the PTX ISA; each kernel's comments say how it maps its tiles
// onto them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ts::kernels::ptx {

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// cp.async.cg: 16 bytes global -> shared through L2 only (L1 bypassed), asynchronous; completion
// is tracked per thread by commit and wait groups. src_bytes = 0 reads nothing and fills the 16
// bytes with zeros (a row or key past the end); src must still be a valid address.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most `kPending` of this thread's committed groups are still in flight. Other
// threads' copies are visible only after a barrier that follows the wait.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// ldmatrix.x4: four 8x8 b16 matrices from shared memory. Lane l gives the address of row l % 8
// of matrix l / 8 (16 contiguous bytes, 16-B aligned); register i of lane l receives matrix i's
// row l / 4 at columns 2 (l % 4) and 2 (l % 4) + 1.
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}
// As LdMatrixX4, transposed: register i holds matrix i's rows 2 (l % 4) and 2 (l % 4) + 1 at
// column l / 4 (the B fragment of an mma whose k index runs along the matrix rows).
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

// mma.sync m16n8k16, bf16 in, fp32 accumulate: c[16 x 8] += a[16 x 16] * b[16 x 8]. Fragment
// ownership with lane = 4g + t: A rows g and g+8 at columns 2t, 2t+1 (a0, a1) and 2t+8, 2t+9
// (a2, a3); B column g at rows 2t, 2t+1 (b0) and 2t+8, 2t+9 (b1); C rows g and g+8 at columns 2t,
// 2t+1 (c0, c1 and c2, c3).
__device__ __forceinline__ void MmaBf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace ts::kernels::ptx
