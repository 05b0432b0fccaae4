// main() for GPU tests. Where the machine has no CUDA device at all (no driver, or the driver
// sees no device) it exits 77 with a clear message, which tailserve_add_test maps to CTest's
// "Skipped", so a CPU-only machine such as CI reports these tests honestly instead of as passes.
//
// Anything else that keeps the test from reaching a device is a failure, not a skip: a device that
// is present but cannot be initialised, a driver/runtime mismatch, or, with TS_REQUIRE_GPU=1 (set
// by tests/gpu/run-bundle.sh on the GPU machine), no device at all. Otherwise a broken GPU machine
// would report a green suite of skips.
//
// A crash prints the faulting PC and, where it can unwind, the symbolised stack (abseil's failure
// signal handler): runs on the GPU machine are unattended, and under compute-sanitizer a crashed
// test otherwise leaves only "the application may have hit an error" behind.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/debugging/failure_signal_handler.h"
#include "absl/debugging/symbolize.h"

namespace {

bool GpuRequired() {
  const char* v = std::getenv("TS_REQUIRE_GPU");
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

// "No GPU here" as the runtime reports it on a machine without one: no driver, or no device.
bool MeansNoGpu(cudaError_t err) {
  return err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver;
}

}  // namespace

int main(int argc, char** argv) {
  absl::InitializeSymbolizer(argv[0]);
  absl::InstallFailureSignalHandler({});
  // A listing runs no test and needs no device, so the names a filter or a sanitizer shard plan
  // (tests/gpu/run-bundle.sh, SANITIZE_SHARD) will match can be checked on any machine.
  bool listing = false;
  for (int i = 1; i < argc; ++i)
    listing = listing || std::strcmp(argv[i], "--gtest_list_tests") == 0;
  if (listing) {
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
  }
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaSuccess && count == 0) err = cudaErrorNoDevice;
  if (err != cudaSuccess) {
    if (MeansNoGpu(err) && !GpuRequired()) {
      std::printf("SKIPPED: no CUDA device (%s: %s)\n", cudaGetErrorName(err),
                  cudaGetErrorString(err));
      return 77;
    }
    std::printf("FAILED: cannot reach a CUDA device (%s: %s)%s\n", cudaGetErrorName(err),
                cudaGetErrorString(err), GpuRequired() ? " and TS_REQUIRE_GPU is set" : "");
    return 1;
  }
  // The device exists: creating its context must work too (a wedged or busy device fails here).
  err = cudaFree(nullptr);
  if (err != cudaSuccess) {
    std::printf("FAILED: CUDA device 0 does not initialise (%s: %s)\n", cudaGetErrorName(err),
                cudaGetErrorString(err));
    return 1;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
