#!/usr/bin/env bash
# The test command: installs dependencies, builds, runs ctest, then builds the engine's concurrent
# tests (ring, scheduler, engine, CPU backend and its loop thread, in-process pipeline, the TCP
# transport and the pipeline of ranks over it) once more with ThreadSanitizer and runs them: any
# race report fails them. Used by CI (.ci/run).
#   BUILD_DIR (default build), JOBS (default nproc), CTEST_ARGS (extra ctest arguments),
#   TSAN=0 skips the ThreadSanitizer pass (TSAN_DIR, default $BUILD_DIR-tsan)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-RelWithDebInfo}
cmake --build "$BUILD_DIR" -j "$JOBS"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS" ${CTEST_ARGS:-}

[ "${TSAN:-1}" = 0 ] && exit 0
TSAN_DIR=${TSAN_DIR:-$BUILD_DIR-tsan}
tsan_tests=(engine_ring_test engine_scheduler_test engine_engine_test engine_cpu_backend_test
  engine_cpu_loop_test engine_local_pipeline_test engine_pipeline_backend_test
  engine_tcp_transport_test engine_ring_pipeline_test)
cmake -S . -B "$TSAN_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTAILSERVE_SANITIZE=thread \
  -DTAILSERVE_ENABLE_CUDA=OFF -DTAILSERVE_ENABLE_GRPC=OFF
cmake --build "$TSAN_DIR" -j "$JOBS" --target "${tsan_tests[@]}"
regex="^($(IFS='|'; echo "${tsan_tests[*]}"))\$"
TSAN_OPTIONS="second_deadlock_stack=1 ${TSAN_OPTIONS:-}" \
  ctest --test-dir "$TSAN_DIR" --output-on-failure -j "$JOBS" -R "$regex"
