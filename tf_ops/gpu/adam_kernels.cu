// GPU kernels of AdamMomentumFeed, AdamFrozenStep and ResourceDecayAndSubtract (adam_ops.cc): one thread per
// element, cores.h's AdamMomentumFeedAt, AdamFrozenStepAt and DecayAndSubtractAt (built with -fmad=false, so each
// product and sum is rounded as on the CPU; sqrtf is IEEE's). Each element is read before it is written, so an
// output may be one of the inputs.
#include "common.cuh"
#include "launchers.h"

namespace hvd_compress {
namespace gpu {
namespace {

__global__ void AdamMomentumFeedKernel(const float* g, const float* m, const float* v, const float* e, int64_t n,
                                       float one_minus_beta_1, float epsilon, float bound, float* a) {
  HC_GRID_LOOP(i, n) a[i] = AdamMomentumFeedAt(g[i], m[i], v[i], e[i], one_minus_beta_1, epsilon, bound);
}

__global__ void AdamFrozenStepKernel(const float* mean, const float* m, const float* v, int64_t n, float alpha,
                                     float one_minus_beta_1, float epsilon, float max_step, bool momentum_exchanged,
                                     float* m_new, float* delta) {
  HC_GRID_LOOP(i, n) {
    AdamFrozenStepAt(mean[i], m[i], v[i], alpha, one_minus_beta_1, epsilon, max_step, momentum_exchanged, &m_new[i],
                     &delta[i]);
  }
}

__global__ void DecayAndSubtractKernel(float* x, const float* delta, int64_t n, float decay) {
  HC_GRID_LOOP(i, n) x[i] = DecayAndSubtractAt(x[i], delta[i], decay);
}

}  // namespace
}  // namespace gpu
}  // namespace hvd_compress

extern "C" int hc_adam_momentum_feed(const float* g, const float* m, const float* v, const float* e, int64_t n,
                                     float one_minus_beta_1, float epsilon, float bound, float* a, hc_stream stream) {
  using namespace hvd_compress::gpu;  // NOLINT
  if (n == 0) return cudaSuccess;
  AdamMomentumFeedKernel<<<Blocks(n), kThreads, 0, stream>>>(g, m, v, e, n, one_minus_beta_1, epsilon, bound, a);
  return Launched();
}

extern "C" int hc_adam_frozen_step(const float* mean, const float* m, const float* v, int64_t n, float alpha,
                                   float one_minus_beta_1, float epsilon, float max_step, int momentum_exchanged,
                                   float* m_new, float* delta, hc_stream stream) {
  using namespace hvd_compress::gpu;  // NOLINT
  if (n == 0) return cudaSuccess;
  AdamFrozenStepKernel<<<Blocks(n), kThreads, 0, stream>>>(mean, m, v, n, alpha, one_minus_beta_1, epsilon, max_step,
                                                           momentum_exchanged != 0, m_new, delta);
  return Launched();
}

extern "C" int hc_decay_and_subtract(float* x, const float* delta, int64_t n, float decay, hc_stream stream) {
  using namespace hvd_compress::gpu;  // NOLINT
  if (n == 0) return cudaSuccess;
  DecayAndSubtractKernel<<<Blocks(n), kThreads, 0, stream>>>(x, delta, n, decay);
  return Launched();
}
