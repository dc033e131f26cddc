// CPU kernels for AdamMomentumFeed and AdamFrozenStep (see adam_ops.cc; the arithmetic is cores.h's
// AdamMomentumFeedAt and AdamFrozenStepAt). Each reads its inputs once and writes its outputs once, over fixed chunks
// shared among TensorFlow's intra-op threads; an output takes over an input's buffer when nothing else holds it
// (each element is read before it is written). Built with -ffp-contract=off (setup.py, BUILD), so every product and
// sum is rounded as TensorFlow's separate ops round it.
#include "blocks.h"
#include "op_checks.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"

namespace hvd_compress {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;

namespace {

// Runs body(first, end) over [0, n) in kChunk pieces on the intra-op threads.
template <typename Body>
void ForEachChunk(OpKernelContext* ctx, int64_t n, const Body& body) {
  ParallelFor(ctx, NumChunks(n), kChunk * 4, [&](int64_t first, int64_t last) {
    body(first * kChunk, std::min(last * kChunk, n));
  });
}

}  // namespace

class AdamMomentumFeedOp : public OpKernel {
 public:
  explicit AdamMomentumFeedOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, checks::SameShapesThenScalars(ctx, 4));
    const Tensor& g = ctx->input(0);
    Tensor* a = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0, 3}, 0, g.shape(), &a));
    const float* gp = g.flat<float>().data();
    const float* mp = ctx->input(1).flat<float>().data();
    const float* vp = ctx->input(2).flat<float>().data();
    const float* ep = ctx->input(3).flat<float>().data();
    const float one_minus_beta_1 = ctx->input(4).scalar<float>()(), epsilon = ctx->input(5).scalar<float>()();
    const float bound = ctx->input(6).scalar<float>()();
    float* out = a->flat<float>().data();
    ForEachChunk(ctx, g.NumElements(), [&](int64_t begin, int64_t end) {
#pragma GCC ivdep  // a may be g's or e's buffer: each element is read before it is written (AdamFrozenStepOp)
      for (int64_t i = begin; i < end; ++i) {
        out[i] = AdamMomentumFeedAt(gp[i], mp[i], vp[i], ep[i], one_minus_beta_1, epsilon, bound);
      }
    });
  }
};

class AdamFrozenStepOp : public OpKernel {
 public:
  explicit AdamFrozenStepOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("momentum_exchanged", &momentum_exchanged_));
  }

  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, checks::SameShapesThenScalars(ctx, 3));
    const Tensor& mean = ctx->input(0);
    Tensor* m_new = nullptr;
    Tensor* delta = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({1}, 0, mean.shape(), &m_new));
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 1, mean.shape(), &delta));
    const float* dp = mean.flat<float>().data();
    const float* mp = ctx->input(1).flat<float>().data();
    const float* vp = ctx->input(2).flat<float>().data();
    const float alpha = ctx->input(3).scalar<float>()();
    const float one_minus_beta_1 = ctx->input(4).scalar<float>()(), epsilon = ctx->input(5).scalar<float>()();
    const float max_step = ctx->input(6).scalar<float>()();
    float* m_out = m_new->flat<float>().data();
    float* delta_out = delta->flat<float>().data();
    // One loop per rule, each vectorized: GCC neither unswitches the rule's branch nor vectorizes the loop that
    // holds it, and its check for aliasing would send the in-place case (an output in its input's buffer) to the
    // scalar loop. Each element is read before it is written, so vectors that ignore that aliasing (ivdep) are
    // right; the square root and the division run 8 at a time with the same IEEE roundings as one at a time.
    ForEachChunk(ctx, mean.NumElements(), [&](int64_t begin, int64_t end) {
      if (momentum_exchanged_) {
#pragma GCC ivdep
        for (int64_t i = begin; i < end; ++i) {
          AdamFrozenStepAt(dp[i], mp[i], vp[i], alpha, one_minus_beta_1, epsilon, max_step, true, &m_out[i],
                           &delta_out[i]);
        }
      } else {
#pragma GCC ivdep
        for (int64_t i = begin; i < end; ++i) {
          AdamFrozenStepAt(dp[i], mp[i], vp[i], alpha, one_minus_beta_1, epsilon, max_step, false, &m_out[i],
                           &delta_out[i]);
        }
      }
    });
  }

 private:
  bool momentum_exchanged_;
};

// ResourceDecayAndSubtract: variable = (variable - variable * decay) - delta, in place (see adam_ops.cc).
class ResourceDecayAndSubtractOp : public OpKernel {
 public:
  explicit ResourceDecayAndSubtractOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& delta = ctx->input(1);
    const Tensor& decay = ctx->input(2);
    OP_REQUIRES(ctx, decay.dims() == 0,
                InvalidArgument("decay must be a scalar, got shape ", decay.shape().DebugString()));
    tensorflow::core::RefCountPtr<tensorflow::Var> var;
    OP_REQUIRES_OK(ctx, tensorflow::LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), &var));
    tensorflow::mutex_lock lock(*var->mu());
    Tensor* v = var->tensor();
    OP_REQUIRES_OK(ctx, checks::FloatVariable(*v));
    OP_REQUIRES(ctx, delta.NumElements() == v->NumElements(),
                InvalidArgument("delta has ", delta.NumElements(), " elements and the variable ", v->NumElements()));
    const int64_t size = v->NumElements();
    OP_REQUIRES_OK(ctx, OwnBuffer(ctx, var.get()));
    float* x = v->flat<float>().data();
    const float* dp = delta.flat<float>().data();
    const float rate = decay.scalar<float>()();
    ForEachChunk(ctx, size, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) x[i] = DecayAndSubtractAt(x[i], dp[i], rate);
    });
  }
};

REGISTER_KERNEL_BUILDER(Name("ResourceDecayAndSubtract").Device(DEVICE_CPU), ResourceDecayAndSubtractOp);
REGISTER_KERNEL_BUILDER(Name("AdamMomentumFeed").Device(DEVICE_CPU), AdamMomentumFeedOp);
REGISTER_KERNEL_BUILDER(Name("AdamFrozenStep").Device(DEVICE_CPU), AdamFrozenStepOp);

}  // namespace hvd_compress
