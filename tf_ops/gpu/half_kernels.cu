// GPU kernels of the fp16 ops (half_ops.cc): HalfPack / HalfUnpack convert one part per launch,
// one thread per element, rounding to nearest even as the CPU's F16C and Eigen conversions do;
// HalfMean is cores.h's RowMean per element, rounded to float16 once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "launchers.h"

namespace hvd_compress {
namespace gpu {
namespace {

template <typename From, typename To>
__global__ void ConvertKernel(const From* x, int64_t n, To* y) {
  HC_GRID_LOOP(i, n) y[i] = static_cast<To>(static_cast<float>(x[i]));
}

template <typename From, typename To>
int Convert(const void* x, int64_t n, void* y, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  ConvertKernel<<<Blocks(n), kThreads, 0, stream>>>(static_cast<const From*>(x), n, static_cast<To*>(y));
  return Launched();
}

struct HalfRows {
  const __half* x;
  int64_t m, i;
  __device__ float operator()(int64_t r) const { return __half2float(x[r * m + i]); }
};

__global__ void HalfMeanKernel(const __half* x, int64_t count, int64_t m, __half* mean) {
  HC_GRID_LOOP(i, m) mean[i] = __float2half_rn(RowMean(HalfRows{x, m, i}, count));
}

}  // namespace
}  // namespace gpu
}  // namespace hvd_compress

using namespace hvd_compress::gpu;  // NOLINT: the C launchers below are thin

extern "C" {

int hc_half_from_f32(const float* x, int64_t n, void* y, hc_stream stream) {
  return Convert<float, __half>(x, n, y, stream);
}

int hc_half_from_bf16(const void* x, int64_t n, void* y, hc_stream stream) {
  return Convert<__nv_bfloat16, __half>(x, n, y, stream);
}

int hc_half_to_f32(const void* x, int64_t n, float* y, hc_stream stream) {
  return Convert<__half, float>(x, n, y, stream);
}

int hc_half_to_bf16(const void* x, int64_t n, void* y, hc_stream stream) {
  return Convert<__half, __nv_bfloat16>(x, n, y, stream);
}

int hc_half_mean(const void* x, int64_t count, int64_t m, void* mean, hc_stream stream) {
  if (count < 1) return cudaErrorInvalidValue;  // a mean of no rows
  if (m == 0) return cudaSuccess;
  HalfMeanKernel<<<Blocks(m), kThreads, 0, stream>>>(static_cast<const __half*>(x), count, m,
                                                     static_cast<__half*>(mean));
  return Launched();
}

}  // extern "C"
