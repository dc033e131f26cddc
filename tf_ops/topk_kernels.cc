// CPU kernels for TopKAbs, ScatterDense, ZeroAt, GatherAt and ScatterMean.
//
// TopKAbs selects on the 31-bit key of |x| (AbsKey in cores.h). Its result is
// defined exactly (the k largest keys, ties to the lower index, in index
// order), so the way it is found never changes it:
//  - Usually from a sample. A fixed sample of 1/256 of the elements (the
//    first 16 of every 4093 of the concatenation: not a power of two, so it
//    does not line up with the rows of a matrix) gives a key t that slightly
//    more than k keys should reach. One pass counts, per piece, the keys above
//    t and equal to it. If t is the k-th largest key (or exactly k keys lie
//    above it), one more pass writes the selection. If more than k (but at
//    most max(2k, n/32)) keys lie above t, one pass copies those out and the
//    exact select below runs on them alone. Two reads of x.
//  - Otherwise (small inputs, large k, a sample that missed, many ties): an
//    exact two-level radix select. A histogram of the high 16 bits finds the
//    bin that holds the k-th largest key, a histogram of the low 16 bits
//    inside that bin gives the exact threshold, and a last pass writes every
//    key above it plus the first ties in index order. Three reads of x.
// Both are multi-threaded over pieces whose bounds depend on the sizes alone.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "blocks.h"
#include "op_checks.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"

namespace hvd_compress {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::TensorShape;

namespace {

constexpr int64_t kMaxSegments = 64;
constexpr int64_t kMinSegment = 1 << 16;
// The sample: the elements whose index in the concatenation is below
// kSampleRun modulo kSampleStride.
constexpr int64_t kSampleRun = 16;
constexpr int64_t kSampleStride = 4093;
constexpr int64_t kMinSampled = 1 << 20;  // below this, the radix select alone

// Elements per piece for n elements: at most kMaxSegments pieces of at least
// kMinSegment (one piece when n is smaller).
int64_t SegmentFor(int64_t n) {
  const int64_t segments = std::min(kMaxSegments, std::max<int64_t>(1, n / kMinSegment));
  return std::max<int64_t>(1, (n + segments - 1) / segments);
}

}  // namespace

// A run of elements of one input (or of a copy): the work unit of TopKAbs.
template <typename T>
struct Piece {
  const T* data;
  const int32_t* indices;  // each element's index, or null: begin + i
  int64_t begin;           // read only when indices is null
  int64_t length;

  int32_t IndexOf(int64_t i) const {
    return indices != nullptr ? indices[i] : static_cast<int32_t>(begin + i);
  }
};

// Appends to `pieces` the run of n elements at data (their indices at
// `indices`, or begin, begin + 1, ... when null) cut into pieces of at most
// `segment` elements.
template <typename T>
void CutRun(const T* data, const int32_t* indices, int64_t begin, int64_t n, int64_t segment,
            std::vector<Piece<T>>* pieces) {
  for (int64_t at = 0; at < n; at += segment) {
    pieces->push_back({data + at, indices == nullptr ? nullptr : indices + at, begin + at,
                       std::min(segment, n - at)});
  }
}

// Cuts the inputs (concatenated in order) into pieces of at most `segment`
// elements that never cross an input's end.
template <typename T>
std::vector<Piece<T>> CutPieces(const tensorflow::OpInputList& xs, int64_t segment) {
  std::vector<Piece<T>> pieces;
  int64_t begin = 0;
  for (int i = 0; i < xs.size(); ++i) {
    CutRun(xs[i].flat<T>().data(), nullptr, begin, xs[i].NumElements(), segment, &pieces);
    begin += xs[i].NumElements();
  }
  return pieces;
}

// Writes, in index order, every element of `pieces` with a key above
// `threshold` and the first `ties_to_take` with a key equal to it; piece s
// holds greater[s] of the first kind and ties[s] of the second.
template <typename T>
void WriteSelection(OpKernelContext* ctx, const std::vector<Piece<T>>& pieces, uint32_t threshold,
                    const std::vector<int64_t>& greater, const std::vector<int64_t>& ties,
                    int64_t ties_to_take, T* values, int32_t* indices) {
  const int64_t num_pieces = static_cast<int64_t>(pieces.size());
  std::vector<int64_t> offset(num_pieces + 1, 0), ties_taken(num_pieces);
  int64_t ties_before = 0;
  for (int64_t s = 0; s < num_pieces; ++s) {
    ties_taken[s] = TiesTaken(ties_to_take, ties_before, ties[s]);  // cores.h, as the GPU kernel
    ties_before += ties[s];
    offset[s + 1] = offset[s] + greater[s] + ties_taken[s];
  }
  ParallelFor(ctx, num_pieces, pieces[0].length * 2, [&](int64_t first, int64_t last) {
    for (int64_t s = first; s < last; ++s) {
      const Piece<T>& piece = pieces[s];
      int64_t out = offset[s], ties_left = ties_taken[s];
      for (int64_t i = 0; i < piece.length && out < offset[s + 1]; ++i) {
        const uint32_t key = AbsKey(piece.data[i]);
        if (key > threshold || (key == threshold && ties_left-- > 0)) {
          values[out] = piece.data[i];
          indices[out] = piece.IndexOf(i);
          ++out;
        }
      }
    }
  });
}

// The exact radix select of the k largest keys of `pieces` (k >= 1).
template <typename T>
void RadixSelect(OpKernelContext* ctx, const std::vector<Piece<T>>& pieces, int64_t k,
                 T* values, int32_t* indices) {
  const int64_t num_pieces = static_cast<int64_t>(pieces.size());
  const int64_t cost = pieces[0].length * 3;

  // Pass 1: histogram of the high 16 bits, one histogram per piece.
  std::vector<std::vector<uint32_t>> high(num_pieces);
  ParallelFor(ctx, num_pieces, cost, [&](int64_t first, int64_t last) {
    for (int64_t s = first; s < last; ++s) {
      high[s].assign(kHighBins, 0);
      for (int64_t i = 0; i < pieces[s].length; ++i) {
        ++high[s][AbsKey(pieces[s].data[i]) >> 16];
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
  std::vector<std::vector<uint32_t>> low(num_pieces);
  ParallelFor(ctx, num_pieces, cost, [&](int64_t first, int64_t last) {
    for (int64_t s = first; s < last; ++s) {
      low[s].assign(kLowBins, 0);
      for (int64_t i = 0; i < pieces[s].length; ++i) {
        const uint32_t key = AbsKey(pieces[s].data[i]);
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

  // Pass 3: the keys above the threshold and the first ties.
  std::vector<int64_t> greater(num_pieces), ties(num_pieces);
  for (int64_t s = 0; s < num_pieces; ++s) {
    greater[s] = 0;
    for (int b = high_bin + 1; b < kHighBins; ++b) greater[s] += high[s][b];
    for (int b = low_bin + 1; b < kLowBins; ++b) greater[s] += low[s][b];
    ties[s] = low[s][low_bin];
  }
  WriteSelection(ctx, pieces, (high_bin << 16) | low_bin, greater, ties,
                 k - above_high - above_low, values, indices);
}

// A key that, judging by a fixed sample of the pieces, a few more than k of
// the n keys reach: the sample's expected count above the k-th largest key
// plus four standard deviations.
template <typename T>
uint32_t SampleThreshold(const std::vector<Piece<T>>& pieces, int64_t n, int64_t k) {
  std::vector<uint32_t> sample;
  for (const Piece<T>& piece : pieces) {
    const int64_t end = piece.begin + piece.length;
    for (int64_t run = piece.begin / kSampleStride * kSampleStride; run < end; run += kSampleStride) {
      for (int64_t i = std::max(run, piece.begin); i < std::min(run + kSampleRun, end); ++i) {
        sample.push_back(AbsKey(piece.data[i - piece.begin]));
      }
    }
  }
  const double expected = static_cast<double>(k) * sample.size() / n;
  const int64_t rank = std::clamp<int64_t>(
      static_cast<int64_t>(expected + 4 * std::sqrt(expected) + 4), 1, sample.size());
  std::nth_element(sample.begin(), sample.begin() + rank - 1, sample.end(), std::greater<uint32_t>());
  return sample[rank - 1];
}

// The sampled select (see the top of the file); false, having written
// nothing, when it does not apply.
template <typename T>
bool SampledSelect(OpKernelContext* ctx, const std::vector<Piece<T>>& pieces, int64_t n, int64_t k,
                   T* values, int32_t* indices) {
  if (n < kMinSampled || k > n / 8) return false;
  const uint32_t threshold = SampleThreshold(pieces, n, k);
  const int64_t num_pieces = static_cast<int64_t>(pieces.size());
  std::vector<int64_t> greater(num_pieces), equal(num_pieces);
  ParallelFor(ctx, num_pieces, pieces[0].length, [&](int64_t first, int64_t last) {
    for (int64_t s = first; s < last; ++s) {
      // Keys are below 2^31, so signed compares and int32 counts per block vectorize.
      const int32_t t = static_cast<int32_t>(threshold);
      greater[s] = equal[s] = 0;
      for (int64_t block = 0; block < pieces[s].length; block += kChunk) {
        const int64_t end = std::min(pieces[s].length, block + kChunk);
        int32_t above = 0, at = 0;
        for (int64_t i = block; i < end; ++i) {
          const int32_t key = static_cast<int32_t>(AbsKey(pieces[s].data[i]));
          above += key > t;
          at += key == t;
        }
        greater[s] += above;
        equal[s] += at;
      }
    }
  });
  int64_t total_greater = 0, total_equal = 0;
  for (int64_t s = 0; s < num_pieces; ++s) {
    total_greater += greater[s];
    total_equal += equal[s];
  }
  // The threshold is the k-th key (ties to the lower index), or exactly k keys lie above it.
  if (total_greater <= k && total_greater + total_equal >= k) {
    WriteSelection(ctx, pieces, threshold, greater, equal, k - total_greater, values, indices);
    return true;
  }
  if (total_greater < k || total_greater > std::max(2 * k, n / 32)) return false;
  std::vector<T> kept_values(total_greater);
  std::vector<int32_t> kept_indices(total_greater);
  WriteSelection(ctx, pieces, threshold, greater, std::vector<int64_t>(num_pieces, 0), 0,
                 kept_values.data(), kept_indices.data());
  std::vector<Piece<T>> kept;
  CutRun(kept_values.data(), kept_indices.data(), 0, total_greater, SegmentFor(total_greater), &kept);
  RadixSelect(ctx, kept, k, values, indices);
  return true;
}

template <typename T>
class TopKAbsOp : public OpKernel {
 public:
  explicit TopKAbsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    tensorflow::OpInputList xs;
    OP_REQUIRES_OK(ctx, ctx->input_list("xs", &xs));
    const Tensor& k_tensor = ctx->input(xs.size());
    OP_REQUIRES(ctx, k_tensor.dims() == 0,
                InvalidArgument("k must be a scalar, got shape ",
                                k_tensor.shape().DebugString()));
    int64_t n = 0;
    for (int i = 0; i < xs.size(); ++i) n += xs[i].NumElements();
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
    T* values = values_tensor->flat<T>().data();
    int32_t* indices = indices_tensor->flat<int32_t>().data();
    const std::vector<Piece<T>> pieces = CutPieces<T>(xs, SegmentFor(n));
    if (!SampledSelect(ctx, pieces, n, k, values, indices)) {
      RadixSelect(ctx, pieces, k, values, indices);
    }
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
    OP_REQUIRES_OK(ctx, CheckIndices(idx, k, n));
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
        if constexpr (std::is_same_v<T, float>) {  // summed in place
          std::fill(y + lo, y + hi, 0.0f);
          for (int64_t i = 0; i < k; ++i) {
            if (idx[i] >= lo && idx[i] < hi) y[idx[i]] += values[i];
          }
        } else {  // 16-bit values: summed in float32, rounded once
          std::vector<float> acc(hi - lo, 0.0f);
          for (int64_t i = 0; i < k; ++i) {
            if (idx[i] >= lo && idx[i] < hi) {
              acc[idx[i] - lo] += static_cast<float>(values[i]);
            }
          }
          for (int64_t j = lo; j < hi; ++j) y[j] = static_cast<T>(acc[j - lo]);
        }
      }
    });
  }
};

// ZeroAt: the parts with the elements at `indices` (of their concatenation)
// set to zero; each part's buffer is reused when nothing else holds it.
class ZeroAtOp : public OpKernel {
 public:
  explicit ZeroAtOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    tensorflow::OpInputList xs;
    OP_REQUIRES_OK(ctx, ctx->input_list("xs", &xs));
    const Tensor& indices = ctx->input(xs.size());
    std::vector<int64_t> sizes;
    std::vector<float*> parts;
    for (int i = 0; i < xs.size(); ++i) {
      sizes.push_back(xs[i].NumElements());
      Tensor* y = nullptr;
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({i}, i, xs[i].shape(), &y));
      if (y->tensor_data().data() != xs[i].tensor_data().data()) {
        std::memcpy(const_cast<char*>(y->tensor_data().data()), xs[i].tensor_data().data(),
                    xs[i].TotalBytes());
      }
      parts.push_back(y->flat<float>().data());
    }
    OP_REQUIRES_OK(ctx, ForEachIndexInParts(indices, PartIndex(sizes), [&](int64_t, int64_t part, int64_t at) {
      parts[part][at] = 0.0f;
    }));
  }
};

// GatherAt: the elements at `indices` of the concatenation of the parts.
class GatherAtOp : public OpKernel {
 public:
  explicit GatherAtOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    tensorflow::OpInputList xs;
    OP_REQUIRES_OK(ctx, ctx->input_list("xs", &xs));
    const Tensor& indices = ctx->input(xs.size());
    std::vector<int64_t> sizes;
    std::vector<const float*> parts;
    for (int i = 0; i < xs.size(); ++i) {
      sizes.push_back(xs[i].NumElements());
      parts.push_back(xs[i].flat<float>().data());
    }
    Tensor* values = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, indices.shape(), &values));
    float* out = values->flat<float>().data();
    OP_REQUIRES_OK(ctx, ForEachIndexInParts(indices, PartIndex(sizes), [&](int64_t i, int64_t part, int64_t at) {
      out[i] = parts[part][at];
    }));
  }
};

// ScatterMean: dense parts of `sizes` holding, at every index of their
// concatenation, the sum of the values given for it (in input order) divided
// by count; zero elsewhere. No dense tensor is made for any single payload.
class ScatterMeanOp : public OpKernel {
 public:
  explicit ScatterMeanOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, checks::ScatterMeanAttrs(ctx, &sizes_, &count_));
    where_ = std::make_unique<PartIndex>(sizes_);
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& indices = ctx->input(0);
    const Tensor& values = ctx->input(1);
    const int64_t k = indices.NumElements();
    OP_REQUIRES(ctx, values.NumElements() == k,
                InvalidArgument("indices and values must have the same number of elements, got ", k,
                                " and ", values.NumElements()));
    const PartIndex& where = *where_;
    const int32_t* idx = indices.flat<int32_t>().data();
    const float* v = values.flat<float>().data();
    tensorflow::OpOutputList ys;
    OP_REQUIRES_OK(ctx, ctx->output_list("ys", &ys));
    std::vector<float*> parts;
    for (size_t i = 0; i < sizes_.size(); ++i) {
      Tensor* y = nullptr;
      OP_REQUIRES_OK(ctx, ys.allocate(i, TensorShape({sizes_[i]}), &y));
      parts.push_back(y->flat<float>().data());
    }
    ParallelFor(ctx, static_cast<int64_t>(parts.size()), kChunk, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) std::fill(parts[i], parts[i] + sizes_[i], 0.0f);
    });
    // Sums, then one division per index that received a value (the first time it is met).
    std::vector<bool> divided(where.total(), false);
    OP_REQUIRES_OK(ctx, ForEachIndexInParts(indices, where, [&](int64_t i, int64_t part, int64_t at) {
      parts[part][at] += v[i];
    }));
    const float divisor = static_cast<float>(count_);
    OP_REQUIRES_OK(ctx, ForEachIndexInParts(indices, where, [&](int64_t i, int64_t part, int64_t at) {
      if (!divided[idx[i]]) parts[part][at] /= divisor;
      divided[idx[i]] = true;
    }));
  }

 private:
  std::vector<int64_t> sizes_;
  std::unique_ptr<PartIndex> where_;
  int64_t count_;
};

// ResourceSubtractSparseMean (topk_ops.cc): the variable's range of the increasing indices found by binary search,
// checked, then each of its elements less value / count (ScatterMean's division, then the subtraction).
class ResourceSubtractSparseMeanOp : public OpKernel {
 public:
  explicit ResourceSubtractSparseMeanOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("count", &count_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& indices = ctx->input(1);
    const Tensor& values = ctx->input(2);
    OP_REQUIRES_OK(ctx, checks::SparseMeanInputs(ctx));
    tensorflow::core::RefCountPtr<tensorflow::Var> var;
    OP_REQUIRES_OK(ctx, tensorflow::LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), &var));
    tensorflow::mutex_lock lock(*var->mu());
    Tensor* v = var->tensor();
    OP_REQUIRES_OK(ctx, checks::FloatVariable(*v));
    const int64_t offset = ctx->input(3).scalar<int64_t>()(), size = v->NumElements();
    const int32_t* idx = indices.flat<int32_t>().data();
    const int64_t m = indices.NumElements();
    const int32_t* lo = std::lower_bound(idx, idx + m, offset, [](int32_t a, int64_t b) { return a < b; });
    const int32_t* hi = std::lower_bound(lo, idx + m, offset + size, [](int32_t a, int64_t b) { return a < b; });
    for (const int32_t* p = lo + 1; p < hi; ++p) {
      OP_REQUIRES(ctx, *(p - 1) < *p,
                  InvalidArgument("indices must increase (each index once), got ", *(p - 1), " before ", *p));
    }
    OP_REQUIRES_OK(ctx, OwnBuffer(ctx, var.get()));
    float* x = v->flat<float>().data();
    const float* vals = values.flat<float>().data() + (lo - idx);
    const float divisor = static_cast<float>(count_);
    for (const int32_t* p = lo; p < hi; ++p) x[*p - offset] -= vals[p - lo] / divisor;
  }

 private:
  int64_t count_;
};

REGISTER_KERNEL_BUILDER(Name("ResourceSubtractSparseMean").Device(DEVICE_CPU).HostMemory("offset"),
                        ResourceSubtractSparseMeanOp);
REGISTER_KERNEL_BUILDER(Name("ZeroAt").Device(DEVICE_CPU), ZeroAtOp);
REGISTER_KERNEL_BUILDER(Name("GatherAt").Device(DEVICE_CPU), GatherAtOp);
REGISTER_KERNEL_BUILDER(Name("ScatterMean").Device(DEVICE_CPU), ScatterMeanOp);

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
