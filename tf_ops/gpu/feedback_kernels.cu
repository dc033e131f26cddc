// GPU kernels of MomentumErrorFeed (feedback_ops.cc): one thread per element, cores.h's
// MomentumErrorFeedAt (built with -fmad=false, so each product and sum is rounded as on the CPU); and of error
// feedback's a = g + e, which BlockQuantizeCompress's GPU kernel adds on the way.
#include "common.cuh"
#include "launchers.h"

namespace hvd_compress {
namespace gpu {
namespace {

__global__ void MomentumErrorFeedKernel(const float* g, const float* m, const float* e, int64_t n, float lr,
                                        float momentum, float residual_scale, bool nesterov, float* m_new, float* a) {
  HC_GRID_LOOP(i, n) MomentumErrorFeedAt(g[i], m[i], e[i], lr, momentum, residual_scale, nesterov, &m_new[i], &a[i]);
}

__global__ void ErrorFeedKernel(const float* g, const float* e, int64_t n, float* a) {
  HC_GRID_LOOP(i, n) a[i] = g[i] + e[i];
}

}  // namespace
}  // namespace gpu
}  // namespace hvd_compress

extern "C" int hc_error_feed(const float* g, const float* e, int64_t n, float* a, hc_stream stream) {
  using namespace hvd_compress::gpu;  // NOLINT
  if (n == 0) return cudaSuccess;
  ErrorFeedKernel<<<Blocks(n), kThreads, 0, stream>>>(g, e, n, a);
  return Launched();
}

extern "C" int hc_momentum_error_feed(const float* g, const float* m, const float* e, int64_t n, float lr,
                                      float momentum, float residual_scale, int nesterov, float* m_new, float* a,
                                      hc_stream stream) {
  using namespace hvd_compress::gpu;  // NOLINT
  if (n == 0) return cudaSuccess;
  MomentumErrorFeedKernel<<<Blocks(n), kThreads, 0, stream>>>(g, m, e, n, lr, momentum, residual_scale,
                                                              nesterov != 0, m_new, a);
  return Launched();
}
