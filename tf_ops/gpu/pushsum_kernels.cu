// GPU kernel of PushSumShare (pushsum_ops.cc; CPU: pushsum_kernels.cc): one launch per part writes its
// slice of the share, one thread per element, and a last one-thread launch writes w / parts. The weight is
// read on the device (no host synchronisation). Compiled with -fmad=false, and `/` is IEEE division (nvcc's
// default -prec-div=true), so every product, difference and quotient rounds as the CPU kernel's.
#include "common.cuh"
#include "launchers.h"

namespace hvd_compress {
namespace gpu {
namespace {

// M == 0: y = (z * w) / parts.
__global__ void ShareKernel(const float* z, int64_t n, const float* weight, float parts, float* y) {
  const float w = *weight;
  HC_GRID_LOOP(i, n) y[i] = (z[i] * w) / parts;
}

// M == N: y = (z - (1 - w) * b) / parts, 1 - w rounded first.
__global__ void ShareWithBeforeKernel(const float* z, const float* b, int64_t n, const float* weight, float parts,
                                      float* y) {
  const float one_minus_w = 1.0f - *weight;
  HC_GRID_LOOP(i, n) y[i] = (z[i] - one_minus_w * b[i]) / parts;
}

__global__ void WeightShareKernel(const float* weight, float parts, float* y) { *y = *weight / parts; }

}  // namespace
}  // namespace gpu
}  // namespace hvd_compress

using namespace hvd_compress::gpu;  // NOLINT: the C launcher below is thin

extern "C" {

int hc_push_sum_share(const float* const* values_host, const float* const* before_host, const int64_t* sizes_host,
                      int64_t num_parts, const float* weight, int64_t parts, float* share, hc_stream stream) {
  if (parts < 2) return cudaErrorInvalidValue;
  const float p = static_cast<float>(parts);
  float* y = share;
  for (int64_t part = 0; part < num_parts; y += sizes_host[part], ++part) {
    const int64_t n = sizes_host[part];
    if (n == 0) continue;
    if (before_host == nullptr) {
      ShareKernel<<<Blocks(n), kThreads, 0, stream>>>(values_host[part], n, weight, p, y);
    } else {
      ShareWithBeforeKernel<<<Blocks(n), kThreads, 0, stream>>>(values_host[part], before_host[part], n, weight, p,
                                                                y);
    }
    const cudaError_t error = Launched();
    if (error != cudaSuccess) return error;
  }
  WeightShareKernel<<<1, 1, 0, stream>>>(weight, p, y);
  return Launched();
}

}  // extern "C"
