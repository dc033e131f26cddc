// CPU kernels for TopKAbs and ScatterDense.
//
// TopKAbs is a two-level radix select on the 31-bit key of |x| (AbsKey in
// blocks.h): a histogram of the high 16 bits finds the bin that holds the k-th
// largest key, a histogram of the low 16 bits inside that bin gives the exact
// threshold, and a last pass writes every key above it plus the first ties in
// index order. Three reads of x, O(n) work, multi-threaded over fixed
// segments so the result never depends on the thread count.
#include <algorithm>
#include <limits>
#include <vector>

#include "blocks.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace hvd_compress {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;

namespace {

constexpr int kHighBins = 1 << 15;  // key >> 16 (the key's top bit is clear)
constexpr int kLowBins = 1 << 16;   // key & 0xffff
constexpr int64_t kMaxSegments = 64;
constexpr int64_t kMinSegment = 1 << 16;

// Finds the bin holding the `rank`-th largest element (1-based) given merged
// counts; returns the bin and sets *above to the count in higher bins.
int64_t BinOfRank(const std::vector<int64_t>& counts, int64_t rank,
                  int64_t* above) {
  *above = 0;
  for (int64_t bin = static_cast<int64_t>(counts.size()) - 1; bin >= 0; --bin) {
    if (*above + counts[bin] >= rank) return bin;
    *above += counts[bin];
  }
  return 0;  // unreachable when rank <= total count
}

}  // namespace

template <typename T>
class TopKAbsOp : public OpKernel {
 public:
  explicit TopKAbsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x_tensor = ctx->input(0);
    const Tensor& k_tensor = ctx->input(1);
    OP_REQUIRES(ctx, k_tensor.dims() == 0,
                InvalidArgument("k must be a scalar, got shape ",
                                k_tensor.shape().DebugString()));
    const int64_t n = x_tensor.NumElements();
    const int64_t k = k_tensor.scalar<int32_t>()();
    OP_REQUIRES(ctx, n <= std::numeric_limits<int32_t>::max(),
                InvalidArgument("top_k_abs returns int32 indices, so x may have "
                                "at most 2^31-1 elements; got ", n,
                                ". Split the tensor into smaller buckets."));
    OP_REQUIRES(ctx, k >= 0 && k <= n,
                InvalidArgument("k must be in [0, number of elements of x = ", n,
                                "], got k=", k,
                                ". Lower k (or the top-k ratio) for this tensor."));
    Tensor* values_tensor = nullptr;
    Tensor* indices_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({k}), &values_tensor));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({k}), &indices_tensor));
    if (k == 0) return;
    const T* x = x_tensor.flat<T>().data();
    T* values = values_tensor->flat<T>().data();
    int32_t* indices = indices_tensor->flat<int32_t>().data();

    const int64_t num_segments =
        std::min(kMaxSegments, std::max<int64_t>(1, n / kMinSegment));
    const int64_t segment = (n + num_segments - 1) / num_segments;
    auto seg_begin = [&](int64_t s) { return std::min(n, s * segment); };

    // Pass 1: histogram of the high 16 bits, one histogram per segment.
    std::vector<std::vector<uint32_t>> high(num_segments);
    ParallelFor(ctx, num_segments, segment * 3, [&](int64_t first, int64_t last) {
      for (int64_t s = first; s < last; ++s) {
        high[s].assign(kHighBins, 0);
        for (int64_t i = seg_begin(s); i < seg_begin(s + 1); ++i) {
          ++high[s][AbsKey(x[i]) >> 16];
        }
      }
    });
    std::vector<int64_t> total(kHighBins, 0);
    for (const auto& h : high) {
      for (int b = 0; b < kHighBins; ++b) total[b] += h[b];
    }
    int64_t above_high = 0;
    const uint32_t high_bin = BinOfRank(total, k, &above_high);

    // Pass 2: histogram of the low 16 bits inside that high bin.
    std::vector<std::vector<uint32_t>> low(num_segments);
    ParallelFor(ctx, num_segments, segment * 3, [&](int64_t first, int64_t last) {
      for (int64_t s = first; s < last; ++s) {
        low[s].assign(kLowBins, 0);
        for (int64_t i = seg_begin(s); i < seg_begin(s + 1); ++i) {
          const uint32_t key = AbsKey(x[i]);
          if ((key >> 16) == high_bin) ++low[s][key & 0xffff];
        }
      }
    });
    std::vector<int64_t> total_low(kLowBins, 0);
    for (const auto& h : low) {
      for (int b = 0; b < kLowBins; ++b) total_low[b] += h[b];
    }
    int64_t above_low = 0;
    const uint32_t low_bin = BinOfRank(total_low, k - above_high, &above_low);
    const uint32_t threshold = (high_bin << 16) | low_bin;
    const int64_t ties_to_take = k - above_high - above_low;

    // Output offsets: each segment writes its keys > threshold and the ties
    // that fall to it (the first ties_to_take ties in index order).
    std::vector<int64_t> offset(num_segments + 1, 0), ties_taken(num_segments);
    int64_t ties_before = 0;
    for (int64_t s = 0; s < num_segments; ++s) {
      int64_t greater = 0;
      for (int b = high_bin + 1; b < kHighBins; ++b) greater += high[s][b];
      for (int b = low_bin + 1; b < kLowBins; ++b) greater += low[s][b];
      const int64_t ties = low[s][low_bin];
      ties_taken[s] = std::clamp<int64_t>(ties_to_take - ties_before, 0, ties);
      ties_before += ties;
      offset[s + 1] = offset[s] + greater + ties_taken[s];
    }

    // Pass 3: write the selection in increasing index order.
    ParallelFor(ctx, num_segments, segment * 3, [&](int64_t first, int64_t last) {
      for (int64_t s = first; s < last; ++s) {
        int64_t out = offset[s], ties_left = ties_taken[s];
        for (int64_t i = seg_begin(s); i < seg_begin(s + 1) && out < offset[s + 1]; ++i) {
          const uint32_t key = AbsKey(x[i]);
          if (key > threshold || (key == threshold && ties_left-- > 0)) {
            values[out] = x[i];
            indices[out] = static_cast<int32_t>(i);
            ++out;
          }
        }
      }
    });
  }
};

template <typename T, typename Index>
class ScatterDenseOp : public OpKernel {
 public:
  explicit ScatterDenseOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& indices_tensor = ctx->input(0);
    const Tensor& values_tensor = ctx->input(1);
    const Tensor& n_tensor = ctx->input(2);
    OP_REQUIRES(ctx, n_tensor.dims() == 0,
                InvalidArgument("n must be a scalar, got shape ",
                                n_tensor.shape().DebugString()));
    const int64_t n = n_tensor.scalar<int64_t>()();
    const int64_t k = indices_tensor.NumElements();
    OP_REQUIRES(ctx, n >= 0, InvalidArgument("n must be >= 0, got ", n));
    OP_REQUIRES(ctx, values_tensor.NumElements() == k,
                InvalidArgument("indices and values must have the same number "
                                "of elements, got ", k, " and ",
                                values_tensor.NumElements()));
    const Index* idx = indices_tensor.flat<Index>().data();
    for (int64_t i = 0; i < k; ++i) {
      OP_REQUIRES(ctx, idx[i] >= 0 && idx[i] < n,
                  InvalidArgument("indices[", i, "] = ", idx[i],
                                  " is out of range [0, n=", n, ")"));
    }
    Tensor* y_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &y_tensor));
    if (n == 0) return;
    const T* values = values_tensor.flat<T>().data();
    T* y = y_tensor->flat<T>().data();

    // Each partition of the output scans all indices and adds, in input
    // order, those that land in it: no races, deterministic sums.
    const auto& workers = *ctx->device()->tensorflow_cpu_worker_threads();
    const int64_t partitions = std::max<int64_t>(
        1, std::min<int64_t>(workers.num_threads, n / kChunk));
    ParallelFor(ctx, partitions, n + k, [&](int64_t first, int64_t last) {
      for (int64_t p = first; p < last; ++p) {
        const int64_t lo = n * p / partitions, hi = n * (p + 1) / partitions;
        std::vector<float> acc(hi - lo, 0.0f);
        for (int64_t i = 0; i < k; ++i) {
          if (idx[i] >= lo && idx[i] < hi) {
            acc[idx[i] - lo] += static_cast<float>(values[i]);
          }
        }
        for (int64_t j = lo; j < hi; ++j) y[j] = static_cast<T>(acc[j - lo]);
      }
    });
  }
};

#define REGISTER_TOPK_KERNELS(T)                                         \
  REGISTER_KERNEL_BUILDER(                                               \
      Name("TopKAbs").Device(DEVICE_CPU).TypeConstraint<T>("T"),         \
      TopKAbsOp<T>);                                                     \
  REGISTER_KERNEL_BUILDER(Name("ScatterDense")                           \
                              .Device(DEVICE_CPU)                        \
                              .TypeConstraint<T>("T")                    \
                              .TypeConstraint<int32_t>("Tidx")           \
                              .HostMemory("n"),                          \
                          ScatterDenseOp<T, int32_t>);                   \
  REGISTER_KERNEL_BUILDER(Name("ScatterDense")                           \
                              .Device(DEVICE_CPU)                        \
                              .TypeConstraint<T>("T")                    \
                              .TypeConstraint<int64_t>("Tidx")           \
                              .HostMemory("n"),                          \
                          ScatterDenseOp<T, int64_t>);

REGISTER_TOPK_KERNELS(float);
REGISTER_TOPK_KERNELS(Eigen::half);
REGISTER_TOPK_KERNELS(Eigen::bfloat16);
#undef REGISTER_TOPK_KERNELS

}  // namespace hvd_compress
