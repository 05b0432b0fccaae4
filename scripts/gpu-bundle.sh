#!/usr/bin/env bash
# Builds the GPU tests and benchmarks on this (GPU-less) machine and collects them, with their
# non-system shared libraries (found with ldd), into .bundle/ for the device machine, which has the
# CUDA toolkit but no gRPC, abseil or GoogleTest. tests/gpu/run-bundle.sh runs them there.
#   TARGETS="..." overrides the list; BUILD_DIR defaults to build-bundle, BUILD_TYPE to Release
#   (an existing RelWithDebInfo tree can be bundled as it is: its device code is the same, and the
#   binaries are stripped of debug info on the way into the bundle).
# It also packs the bundle as .bundle.tar.xz (about a fifth of its size): the device tool carries
# at most 64 MiB with the working tree, which the shipped model already fills by a quarter. Carry
# either; tests/gpu/run-bundle.sh unpacks the archive when .bundle/ is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/cuda/bin:$PATH
BUILD_DIR=${BUILD_DIR:-build-bundle}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-Release} >/dev/null
if [ -z "${TARGETS:-}" ]; then
  # Every gpu-labelled test plus the benchmarks (ctest knows the labels once built targets exist).
  TARGETS=$(ninja -C "$BUILD_DIR" -t targets all | sed -n 's/^\([A-Za-z0-9_-]*\): phony$/\1/p' |
            grep -E '^(kernels_|graphs_|engine_cuda|engine_nccl|server_cuda|tailserve-(bench|attn-bench|graph-bench|boundary-bench|idle-node-bench|gemv-bench|cublaslt-sweep|cublaslt-search|cublaslt-pdl|load)$|tailserve$|ts_kernel_trace$)' || true)
fi
echo "gpu-bundle: building $(echo $TARGETS | wc -w) targets"
cmake --build "$BUILD_DIR" -j "${JOBS:-2}" --target $TARGETS
rm -rf .bundle && mkdir -p .bundle/bin .bundle/lib
for t in $TARGETS; do
  f=$(find "$BUILD_DIR" -type f -name "$t" -perm -u+x | head -1)
  [ -n "$f" ] && cp "$f" .bundle/bin/ && strip --strip-debug ".bundle/bin/$t"
done
# Libraries the device lacks: everything ldd resolves except glibc/libstdc++, the CUDA driver and
# the CUDA 13 toolkit libraries (cudart, cuBLAS, NCCL), which the device has in the same version.
for b in .bundle/bin/*; do
  ldd "$b" | awk '/=> \// {print $3}'
done | sort -u | grep -vE '/(libc|libm|libdl|librt|libpthread|libgcc_s|libstdc\+\+|ld-linux[^/]*|libcuda|libcudart|libcublas|libcublasLt|libnccl)\.so' |
  grep -v '^/usr/local/cuda' |
  while read -r lib; do cp -L "$lib" .bundle/lib/; done
# Loaded with dlopen, so ldd does not list it (models/tokenizer/sp_backend.h): the SentencePiece
# shim and the library it needs, found on the device through LD_LIBRARY_PATH.
sp=$(find "$BUILD_DIR" -name libts_sentencepiece.so | head -1)
if [ -n "$sp" ]; then
  cp "$sp" .bundle/lib/
  ldd "$sp" | awk '/libsentencepiece/ {print $3}' | xargs -r -I{} cp -L {} .bundle/lib/
fi
# The kernel tracer (bench/trace/README.md), loaded through CUDA_INJECTION64_PATH, with the CUPTI
# it links (the device's toolkit may lack it), and its timeline script.
tr=$(find "$BUILD_DIR" -name libts_kernel_trace.so | head -1)
if [ -n "$tr" ]; then
  cp "$tr" .bundle/lib/
  ldd "$tr" | awk '/libcupti/ {print $3}' | xargs -r -I{} cp -L {} .bundle/lib/
  cp bench/trace/step_timeline.py .bundle/bin/
fi
# Which tests are gpu-labelled, so the device runs exactly those, each with the TIMEOUT that
# tailserve_add_test registered (one line each: name, seconds).
(cd "$BUILD_DIR" && ctest -L gpu --show-only=json-v1) | python3 -c '
import json, sys
for t in json.load(sys.stdin)["tests"]:
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    print(t["name"], int(float(props.get("TIMEOUT", 600))))
' > .bundle/gpu-tests.txt
rm -f .bundle.tar.xz && tar -cf - .bundle | xz -6 -T"${JOBS:-2}" > .bundle.tar.xz
du -sh .bundle .bundle.tar.xz
