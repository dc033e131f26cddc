// CPU kernel for PushSumShare (see pushsum_ops.cc): reads the values (and the values before the step) where
// they lie and writes the share once, chunk by chunk on TF's thread pool; elementwise, so the bits do not
// depend on the threads. Built with -ffp-contract=off (setup.py, BUILD), so every product, difference and
// quotient is rounded as TensorFlow's separate ops round it.
#include <vector>

#include "blocks.h"
#include "op_checks.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace hvd_compress {

using tensorflow::DEVICE_CPU;
using tensorflow::OpInputList;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::TensorShape;

class PushSumShareOp : public OpKernel {
 public:
  explicit PushSumShareOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("parts", &parts_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList values, before;
    const Tensor* weight = nullptr;
    OP_REQUIRES_OK(ctx, checks::PushSumShareInputs(ctx, &values, &before, &weight));
    std::vector<int64_t> sizes;
    for (int i = 0; i < values.size(); ++i) sizes.push_back(values[i].NumElements());
    const PartIndex where(sizes);
    const int64_t total = where.total();
    Tensor* share = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({total + 1}), &share));
    float* out = share->flat<float>().data();
    const float w = weight->scalar<float>()(), parts = static_cast<float>(parts_);
    const float one_minus_w = 1.0f - w;  // M == N: x = z - (1 - w) b, 1 - w rounded first
    ParallelFor(ctx, NumChunks(total), kChunk * 4, [&](int64_t first, int64_t last) {
      where.ForEachPartIn(first * kChunk, std::min(total, last * kChunk),
                          [&](int64_t part, int64_t offset, int64_t at, int64_t length) {
        const float* z = values[part].flat<float>().data() + offset;
        float* y = out + at;
        if (before.size() == 0) {
          for (int64_t i = 0; i < length; ++i) y[i] = (z[i] * w) / parts;
        } else {
          const float* b = before[part].flat<float>().data() + offset;
          for (int64_t i = 0; i < length; ++i) y[i] = (z[i] - one_minus_w * b[i]) / parts;
        }
      });
    });
    out[total] = w / parts;
  }

 private:
  int64_t parts_;
};

REGISTER_KERNEL_BUILDER(Name("PushSumShare").Device(DEVICE_CPU), PushSumShareOp);

}  // namespace hvd_compress
