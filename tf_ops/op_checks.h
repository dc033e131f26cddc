// Checks of the ops' inputs and attributes, shared by the CPU kernels (tf_ops/*_kernels.cc) and
// TensorFlow's GPU kernels (gpu_kernels.cu.cc), so both refuse the same inputs with the same words.
#ifndef HVD_COMPRESS_TF_OPS_OP_CHECKS_H_
#define HVD_COMPRESS_TF_OPS_OP_CHECKS_H_

#include <cstdint>
#include <limits>
#include <vector>

#include "blocks.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace hvd_compress {
namespace checks {


// The 1-bit sign ops' payloads: m >= 1 stacked payloads (payload_rank 2; one with payload_rank 1)
// against bounds, which give n and the number of blocks; sets *m.
inline absl::Status SignPayloads(const Tensor& bits, const Tensor& scales, const Tensor& bounds, int payload_rank,
                                 int64_t* m) {
  if (bounds.dims() != 1 || bounds.NumElements() == 0) {
    return InvalidArgument("bounds must be a non-empty vector, got shape ", bounds.shape().DebugString());
  }
  const int64_t num_blocks = bounds.NumElements() - 1;
  const int64_t n = bounds.flat<int64_t>()(num_blocks);
  TF_RETURN_IF_ERROR(ValidateBounds(bounds, n));
  if (bits.dims() != payload_rank || scales.dims() != payload_rank) {
    return InvalidArgument("bits and scales must have rank ", payload_rank, ", got shapes ",
                           bits.shape().DebugString(), " and ", scales.shape().DebugString());
  }
  *m = payload_rank == 2 ? bits.dim_size(0) : 1;
  const int64_t num_bytes = (n + 7) / 8;
  if (bits.NumElements() != *m * num_bytes || scales.NumElements() != *m * num_blocks ||
      (payload_rank == 2 && scales.dim_size(0) != *m)) {
    return InvalidArgument("payload does not match bounds: expected bits [", *m, ", ", num_bytes, "] and scales [",
                           *m, ", ", num_blocks, "] for n=", n, " and ", num_blocks, " blocks, got ",
                           bits.shape().DebugString(), " and ", scales.shape().DebugString());
  }
  if (*m == 0) return InvalidArgument("block_sign_unpack_mean needs at least one payload");
  return absl::OkStatus();
}

// The variable an op updates in place: initialized float32.
inline absl::Status FloatVariable(const Tensor& v) {
  if (!v.IsInitialized() || v.dtype() != tensorflow::DT_FLOAT) {
    return InvalidArgument("variable must be an initialized float32 variable, got ",
                           tensorflow::DataTypeString(v.dtype()));
  }
  return absl::OkStatus();
}

// ResourceSubtractSparseMean's inputs after the variable: as many indices as values, a scalar offset.
inline absl::Status SparseMeanInputs(tensorflow::OpKernelContext* ctx) {
  const Tensor &indices = ctx->input(1), &values = ctx->input(2);
  if (indices.NumElements() != values.NumElements() || ctx->input(3).dims() != 0) {
    return InvalidArgument("indices and values must have the same number of elements (got ", indices.NumElements(),
                           " and ", values.NumElements(), ") and offset must be a scalar");
  }
  return absl::OkStatus();
}

// CountSketchTopK's inputs: a one-row sketch, its cells' loads ([1, cols], or empty), the parts of x (n <= 2^31 - 1
// elements in all), scalar k in [0, n], seed and step; sets *n and *k.
inline absl::Status SketchTopKInputs(tensorflow::OpKernelContext* ctx, int64_t* n, int64_t* k) {
  const Tensor& sketch = ctx->input(0);
  if (sketch.dims() != 2 || sketch.dim_size(0) != 1 || sketch.dim_size(1) < 1) {
    return InvalidArgument("sketch must be one row, [1, cols] (the estimate of more rows is a median: "
                           "count_sketch_query, then top_k_abs), got ", sketch.shape().DebugString());
  }
  const Tensor& loads = ctx->input(1);
  if (loads.NumElements() != 0 && (loads.dims() != 2 || loads.dim_size(0) != 1 ||
                                   loads.dim_size(1) != sketch.dim_size(1))) {
    return InvalidArgument("loads must be the sketch's cells' loads, [1, cols = ", sketch.dim_size(1),
                           "] (count_sketch(..., count_loads=True) of the same n, seed and step), or empty; got ",
                           loads.shape().DebugString());
  }
  const int k_input = ctx->num_inputs() - 3;  // after the parts of x
  for (int i = k_input; i < ctx->num_inputs(); ++i) {
    if (ctx->input(i).dims() != 0) return InvalidArgument("k, seed and step must be scalars");
  }
  *n = 0;
  for (int i = 2; i < k_input; ++i) *n += ctx->input(i).NumElements();  // after the sketch and its loads
  *k = ctx->input(k_input).scalar<int32_t>()();
  if (*n > std::numeric_limits<int32_t>::max()) {
    return InvalidArgument("count_sketch_top_k returns int32 indices, so x may have at most 2^31-1 elements; got ",
                           *n, ". Split the tensor into smaller buckets.");
  }
  if (*k < 0 || *k > *n) {
    return InvalidArgument("k must be in [0, number of elements of x = ", *n, "], got k=", *k, ".");
  }
  return absl::OkStatus();
}

// ResourceSubtractBlockSignMean's variable `v`: initialized float32, its elements from `offset` within the
// payloads' n.
inline absl::Status SubtractTarget(const Tensor& v, int64_t offset, int64_t n) {
  TF_RETURN_IF_ERROR(FloatVariable(v));
  if (offset < 0 || offset + v.NumElements() > n) {
    return InvalidArgument("the variable's ", v.NumElements(), " elements from offset ", offset,
                           " do not fit in the payloads' n=", n);
  }
  return absl::OkStatus();
}

// MomentumErrorFeed's inputs: g, m and e of one shape; lr, momentum and residual_scale scalars.
inline absl::Status MomentumErrorFeedInputs(const Tensor& g, const Tensor& m, const Tensor& e, const Tensor& lr,
                                            const Tensor& momentum, const Tensor& residual_scale) {
  if (g.shape() != m.shape() || g.shape() != e.shape()) {
    return InvalidArgument("g, m and e must have one shape, got ", g.shape().DebugString(), ", ",
                           m.shape().DebugString(), " and ", e.shape().DebugString());
  }
  if (lr.dims() != 0 || momentum.dims() != 0 || residual_scale.dims() != 0) {
    return InvalidArgument("lr, momentum and residual_scale must be scalars, got shapes ", lr.shape().DebugString(),
                           ", ", momentum.shape().DebugString(), " and ", residual_scale.shape().DebugString());
  }
  return absl::OkStatus();
}

// The Adam ops' inputs: `count` tensors of one shape, then scalars from input `count` on.
inline absl::Status SameShapesThenScalars(tensorflow::OpKernelContext* ctx, int count) {
  for (int i = 1; i < count; ++i) {
    if (ctx->input(i).shape() != ctx->input(0).shape()) {
      return InvalidArgument("input ", i, " has shape ", ctx->input(i).shape().DebugString(), ", and input 0 ",
                             ctx->input(0).shape().DebugString(), ": the tensors must have one shape");
    }
  }
  for (int i = count; i < ctx->num_inputs(); ++i) {
    if (ctx->input(i).dims() != 0) {
      return InvalidArgument("input ", i, " must be a scalar, got shape ", ctx->input(i).shape().DebugString());
    }
  }
  return absl::OkStatus();
}

// HalfUnpack's attributes: one dtype per size, sizes >= 0.
inline absl::Status HalfUnpackAttrs(tensorflow::OpKernelConstruction* ctx, std::vector<int64_t>* sizes,
                                    std::vector<tensorflow::DataType>* dtypes) {
  TF_RETURN_IF_ERROR(ctx->GetAttr("sizes", sizes));
  TF_RETURN_IF_ERROR(ctx->GetAttr("T", dtypes));
  if (sizes->size() != dtypes->size()) {
    return InvalidArgument("HalfUnpack needs one dtype per size: got ", sizes->size(), " sizes and ", dtypes->size(),
                           " dtypes");
  }
  for (int64_t s : *sizes) {
    if (s < 0) return InvalidArgument("sizes must be >= 0, got ", s);
  }
  return absl::OkStatus();
}

// HalfUnpack's `packed`: vectors of `total` elements in all; their lengths into *lengths.
inline absl::Status PackedVectors(const tensorflow::OpInputList& packed, int64_t total, std::vector<int64_t>* lengths) {
  int64_t sum = 0;
  for (int j = 0; j < packed.size(); ++j) {
    if (packed[j].dims() != 1) {
      return InvalidArgument("packed[", j, "] must be a vector, got shape ", packed[j].shape().DebugString());
    }
    lengths->push_back(packed[j].NumElements());
    sum += packed[j].NumElements();
  }
  if (sum != total) {
    return InvalidArgument("packed must hold sum(sizes) = ", total, " float16 values in all, got ", sum);
  }
  return absl::OkStatus();
}

// ScatterMean's attributes: one size (>= 0) per output, count >= 1.
inline absl::Status ScatterMeanAttrs(tensorflow::OpKernelConstruction* ctx, std::vector<int64_t>* sizes,
                                     int64_t* count) {
  TF_RETURN_IF_ERROR(ctx->GetAttr("sizes", sizes));
  TF_RETURN_IF_ERROR(ctx->GetAttr("count", count));
  if (*count < 1) return InvalidArgument("count must be >= 1, got ", *count);
  int n_outputs = 0;
  TF_RETURN_IF_ERROR(ctx->GetAttr("N", &n_outputs));
  if (n_outputs != static_cast<int>(sizes->size())) {
    return InvalidArgument("ScatterMean needs one size per output: N=", n_outputs, ", ", sizes->size(), " sizes");
  }
  for (int64_t s : *sizes) {
    if (s < 0) return InvalidArgument("sizes must be >= 0, got ", s);
  }
  return absl::OkStatus();
}

// PushSumShare's `before`: none (M == 0) or one tensor per value (M == N).
inline absl::Status PushSumBeforeCount(int n, int m) {
  if (m != 0 && m != n) {
    return InvalidArgument("PushSumShare takes no `before` or one per value: got ", m, " for ", n, " values");
  }
  return absl::OkStatus();
}

// PushSumShare's inputs, read from ctx and checked: `before` none or one per value, each of its value's shape;
// weight a scalar.
inline absl::Status PushSumShareInputs(tensorflow::OpKernelContext* ctx, tensorflow::OpInputList* values_out,
                                       tensorflow::OpInputList* before_out, const Tensor** weight_out) {
  TF_RETURN_IF_ERROR(ctx->input_list("values", values_out));
  TF_RETURN_IF_ERROR(ctx->input_list("before", before_out));
  TF_RETURN_IF_ERROR(ctx->input("weight", weight_out));
  const tensorflow::OpInputList& values = *values_out;
  const tensorflow::OpInputList& before = *before_out;
  const Tensor& weight = **weight_out;
  TF_RETURN_IF_ERROR(PushSumBeforeCount(values.size(), before.size()));
  for (int i = 0; i < before.size(); ++i) {
    if (before[i].shape() != values[i].shape()) {
      return InvalidArgument("before[", i, "] must have the shape of values[", i, "], ",
                             values[i].shape().DebugString(), ", got ", before[i].shape().DebugString());
    }
  }
  if (weight.dims() != 0) return InvalidArgument("weight must be a scalar, got shape ", weight.shape().DebugString());
  return absl::OkStatus();
}

// BlockQuantizeDecodeMean's payloads: m >= 1 stacked payloads, packed
// uint8 [m, ceil(n * bits / 8)], scales and offsets float32 [m, B], against bounds (n = bounds[B]); plus float32 [n]
// or empty. Sets *n, *m and *num_blocks.
inline absl::Status QuantizePayloads(const Tensor& packed, const Tensor& scales, const Tensor& offsets,
                                     const Tensor& bounds, const Tensor& plus, int bits, int64_t* n, int64_t* m,
                                     int64_t* num_blocks) {
  if (bounds.dims() != 1 || bounds.NumElements() == 0) {
    return InvalidArgument("bounds must be a non-empty vector, got shape ", bounds.shape().DebugString());
  }
  *num_blocks = bounds.NumElements() - 1;
  *n = bounds.flat<int64_t>()(*num_blocks);
  TF_RETURN_IF_ERROR(ValidateBounds(bounds, *n));
  const int64_t num_bytes = QuantizePackedBytes(*n, bits);
  if (packed.dims() != 2 || scales.dims() != 2 || offsets.dims() != 2) {
    return InvalidArgument("packed, scales and offsets must have rank 2 ([m, ...]), got shapes ",
                           packed.shape().DebugString(), ", ", scales.shape().DebugString(), " and ",
                           offsets.shape().DebugString());
  }
  *m = packed.dim_size(0);
  if (packed.dim_size(1) != num_bytes || scales.dim_size(0) != *m || scales.dim_size(1) != *num_blocks ||
      offsets.shape() != scales.shape()) {
    return InvalidArgument("payload does not match bounds: expected packed [", *m, ", ", num_bytes,
                           "] and scales and offsets [", *m, ", ", *num_blocks, "] for n=", *n, ", ", *num_blocks,
                           " blocks and bits=", bits, ", got ", packed.shape().DebugString(), ", ",
                           scales.shape().DebugString(), " and ", offsets.shape().DebugString());
  }
  if (*m == 0) return InvalidArgument("block_quantize_decode_mean needs at least one payload");
  if (plus.NumElements() != *n && plus.NumElements() != 0) {
    return InvalidArgument("plus must have n=", *n, " elements, or none, got shape ", plus.shape().DebugString());
  }
  return absl::OkStatus();
}

}  // namespace checks
}  // namespace hvd_compress

#endif  // HVD_COMPRESS_TF_OPS_OP_CHECKS_H_
