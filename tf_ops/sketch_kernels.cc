// CPU kernels for CountSketch and CountSketchQuery. A sketch row is summed in
// increasing coordinate order by one thread (rows in parallel), so the result
// is the same for any thread count and equals np.add.at in the reference.
#include <algorithm>
#include <cmath>
#include <vector>

#include "blocks.h"
#include "sketch_hash.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace hvd_compress {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;

template <typename T>
class CountSketchOp : public OpKernel {
 public:
  explicit CountSketchOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rows", &rows_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cols", &cols_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("seed", &seed_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x_tensor = ctx->input(0);
    const int64_t n = x_tensor.NumElements();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({rows_, cols_}), &out));
    const T* x = x_tensor.flat<T>().data();
    float* sketch = out->flat<float>().data();
    std::fill(sketch, sketch + rows_ * cols_, 0.0f);
    ParallelFor(ctx, rows_, n * 8 + cols_, [&](int64_t first, int64_t last) {
      for (int64_t j = first; j < last; ++j) {
        const uint64_t key = RowKey(seed_, j);
        float* row = sketch + j * cols_;
        for (int64_t i = 0; i < n; ++i) {
          const BucketSign h = SketchHash(key, i, cols_);
          row[h.bucket] += h.sign * static_cast<float>(x[i]);
        }
      }
    });
  }

 private:
  int64_t rows_, cols_, seed_;
};

inline bool SortsBefore(float a, float b) {
  return a < b || (!std::isnan(a) && std::isnan(b));
}

class CountSketchQueryOp : public OpKernel {
 public:
  explicit CountSketchQueryOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("seed", &seed_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& sketch_tensor = ctx->input(0);
    const Tensor& n_tensor = ctx->input(1);
    OP_REQUIRES(ctx, sketch_tensor.dims() == 2 && sketch_tensor.dim_size(0) >= 1 &&
                         sketch_tensor.dim_size(1) >= 1,
                InvalidArgument("sketch must be a non-empty matrix [rows, cols], got ",
                                sketch_tensor.shape().DebugString()));
    OP_REQUIRES(ctx, n_tensor.dims() == 0, InvalidArgument("n must be a scalar"));
    const int64_t rows = sketch_tensor.dim_size(0), cols = sketch_tensor.dim_size(1);
    const int64_t n = n_tensor.scalar<int64_t>()();
    OP_REQUIRES(ctx, n >= 0, InvalidArgument("n must be >= 0, got ", n));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &out));
    const float* sketch = sketch_tensor.flat<float>().data();
    float* estimate = out->flat<float>().data();
    std::vector<uint64_t> keys(rows);
    for (int64_t j = 0; j < rows; ++j) keys[j] = RowKey(seed_, j);
    ParallelFor(ctx, NumChunks(n), kChunk * rows * 12, [&](int64_t first, int64_t last) {
      std::vector<float> values(rows);
      for (int64_t i = first * kChunk; i < std::min(n, last * kChunk); ++i) {
        for (int64_t j = 0; j < rows; ++j) {
          const BucketSign h = SketchHash(keys[j], i, cols);
          values[j] = h.sign * sketch[j * cols + h.bucket];
        }
        // Median by insertion sort (a handful of rows); NaN sorts last, so a
        // NaN in most rows makes the estimate NaN.
        for (int64_t a = 1; a < rows; ++a) {
          const float v = values[a];
          int64_t b = a;
          for (; b > 0 && SortsBefore(v, values[b - 1]); --b) values[b] = values[b - 1];
          values[b] = v;
        }
        estimate[i] = rows % 2 ? values[rows / 2]
                               : (values[rows / 2 - 1] + values[rows / 2]) / 2.0f;
      }
    });
  }

 private:
  int64_t seed_;
};

#define REGISTER_SKETCH_KERNEL(T) \
  REGISTER_KERNEL_BUILDER(        \
      Name("CountSketch").Device(DEVICE_CPU).TypeConstraint<T>("T"), CountSketchOp<T>);
REGISTER_SKETCH_KERNEL(float);
REGISTER_SKETCH_KERNEL(Eigen::half);
REGISTER_SKETCH_KERNEL(Eigen::bfloat16);
#undef REGISTER_SKETCH_KERNEL

REGISTER_KERNEL_BUILDER(Name("CountSketchQuery").Device(DEVICE_CPU).HostMemory("n"),
                        CountSketchQueryOp);

}  // namespace hvd_compress
