// CPU kernel for MomentumErrorFeed (see feedback_ops.cc): reads g, m and e
// once and writes m_new and a (cores.h's MomentumErrorFeedAt); a takes over g's buffer when nothing
// else holds it (each element's g is read before its a is written).
// Built with -ffp-contract=off (setup.py, BUILD), so every product and sum is
// rounded as TensorFlow's separate ops round it.
#include "blocks.h"
#include "op_checks.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace hvd_compress {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;

class MomentumErrorFeedOp : public OpKernel {
 public:
  explicit MomentumErrorFeedOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("nesterov", &nesterov_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& g = ctx->input(0);
    const Tensor& m = ctx->input(1);
    const Tensor& e = ctx->input(2);
    const Tensor& lr = ctx->input(3);
    const Tensor& momentum = ctx->input(4);
    const Tensor& residual_scale = ctx->input(5);
    OP_REQUIRES_OK(ctx, checks::MomentumErrorFeedInputs(g, m, e, lr, momentum, residual_scale));
    Tensor* m_new = nullptr;
    Tensor* a = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, g.shape(), &m_new));
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 1, g.shape(), &a));
    const float* gp = g.flat<float>().data();
    const float* mp = m.flat<float>().data();
    const float* ep = e.flat<float>().data();
    float* m_out = m_new->flat<float>().data();
    float* a_out = a->flat<float>().data();
    const float rate = lr.scalar<float>()(), mu = momentum.scalar<float>()();
    const float scale = residual_scale.scalar<float>()();
    // One vectorized loop per rule, as AdamFrozenStep's (adam_kernels.cc): a may be g's buffer, read before written.
    ParallelFor(ctx, NumChunks(g.NumElements()), kChunk * 4, [&](int64_t first, int64_t last) {
      const int64_t end = std::min(last * kChunk, g.NumElements());
      if (nesterov_) {
#pragma GCC ivdep
        for (int64_t i = first * kChunk; i < end; ++i) {
          MomentumErrorFeedAt(gp[i], mp[i], ep[i], rate, mu, scale, true, &m_out[i], &a_out[i]);
        }
      } else {
#pragma GCC ivdep
        for (int64_t i = first * kChunk; i < end; ++i) {
          MomentumErrorFeedAt(gp[i], mp[i], ep[i], rate, mu, scale, false, &m_out[i], &a_out[i]);
        }
      }
    });
  }

 private:
  bool nesterov_;
};

REGISTER_KERNEL_BUILDER(Name("MomentumErrorFeed").Device(DEVICE_CPU), MomentumErrorFeedOp);

}  // namespace hvd_compress
