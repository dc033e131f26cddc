// TensorFlow GPU kernels of hvd_compress's ops: host C++ that validates an op's inputs as its CPU kernel
// (tf_ops/*_kernels.cc) does, allocates its outputs and device workspace with TensorFlow's allocator, and
// enqueues the CUDA kernels of tf_ops/gpu/*.cu (through the C launchers of gpu/launchers.h) on the op's
// stream. Compiled only into the CUDA build of the ops library (HVD_COMPRESS_GPU=1, setup.py), with
// GOOGLE_CUDA defined; the CPU build leaves tf_ops/*.cu.cc out, as BUILD does.
//
// The semantics (shapes, forwarding, errors) are the CPU kernels'; the arithmetic is cores.h's on both, so the
// results are the CPU's bits (tests/gpu/harness.py checks the launchers against the NumPy references).
//
// Values a check needs (block bounds, k, n, offsets, seeds, scalars) come in HostMemory, as ScatterDense's and
// the sketch ops' n already do on the CPU; a launcher that needs them on the device gets a copy (CopyToDevice:
// staged in pinned memory and copied on the op's stream, no wait). Indices, which the CPU checks one by one:
// the GPU kernels skip out-of-range indices, and the op reads back the first one (CheckIndicesOnDevice: one
// small copy that waits for the op's stream) to reject it with the CPU's error.
#if GOOGLE_CUDA

#include <cuda_runtime_api.h>

#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "blocks.h"
#include "op_checks.h"
#include "gpu/launchers.h"
#include "tensorflow/core/common_runtime/device/device_event_mgr.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "xla/stream_executor/stream.h"

namespace hvd_compress {
namespace {

using tensorflow::DEVICE_GPU;
using tensorflow::OpInputList;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpOutputList;
using tensorflow::TensorShape;
using BFloat16 = Eigen::bfloat16;
using Half = Eigen::half;

// ---------------------------------------------------------------------------
// What every kernel does: its stream, launcher errors, workspace, copies, index checks.

hc_stream StreamOf(OpKernelContext* ctx) {
  return static_cast<hc_stream>(ctx->op_device_context()->stream()->platform_specific_handle().stream);
}

// OK for cudaSuccess (0), else an error naming the op (type and node) and the launcher or copy that failed.
absl::Status CudaStatus(OpKernelContext* ctx, int error, const char* what) {
  if (error == 0) return absl::OkStatus();
  const auto code = static_cast<cudaError_t>(error);
  return Internal(ctx->op_kernel().type_string(), " (node ", ctx->op_kernel().name(),
                                      ") on the GPU: ", what, " failed with ", cudaGetErrorName(code), ": ",
                                      cudaGetErrorString(code));
}

// Calls launcher(args...) and fails the op, naming it and the launcher, unless it returns 0.
#define HC_LAUNCH(ctx, launcher, ...) OP_REQUIRES_OK(ctx, CudaStatus(ctx, launcher(__VA_ARGS__), #launcher))

// A tensor's buffer as T* (device memory unless the tensor is in HostMemory).
template <typename T>
T* Ptr(const Tensor& t) {
  return static_cast<T*>(t.data());
}

// A launcher's device workspace of `bytes` bytes, from TensorFlow's allocator. Freed when Compute returns, which
// is safe: TensorFlow's GPU allocator hands the memory on only to work enqueued later on the same stream.
absl::Status AllocateWorkspace(OpKernelContext* ctx, size_t bytes, Tensor* workspace) {
  return ctx->allocate_temp(tensorflow::DT_INT8, TensorShape({static_cast<int64_t>(bytes)}), workspace);
}

// *device: a device copy of `host` (an input in HostMemory), enqueued on the op's stream. Staged in pinned memory
// (so the copy is asynchronous) that lives until the stream has read it (the event manager holds it till then).
absl::Status CopyToDevice(OpKernelContext* ctx, const Tensor& host, Tensor* device) {
  tensorflow::AllocatorAttributes pinned;
  pinned.set_on_host(true);
  pinned.set_gpu_compatible(true);
  Tensor staged;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(host.dtype(), host.shape(), &staged, pinned));
  TF_RETURN_IF_ERROR(ctx->allocate_temp(host.dtype(), host.shape(), device));
  const size_t bytes = host.TotalBytes();
  if (bytes == 0) return absl::OkStatus();
  std::memcpy(staged.data(), host.data(), bytes);
  TF_RETURN_IF_ERROR(CudaStatus(
      ctx, cudaMemcpyAsync(device->data(), staged.data(), bytes, cudaMemcpyHostToDevice, StreamOf(ctx)),
      "copying a host input to the device"));
  ctx->device()->tensorflow_accelerator_device_info()->event_mgr->ThenExecute(
      ctx->op_device_context()->stream(), [staged]() {});
  return absl::OkStatus();
}

// dst[0, bytes) = src[0, bytes), both on the device, on the op's stream.
int CopyOnDevice(void* dst, const void* src, size_t bytes, hc_stream stream) {
  return bytes == 0 ? 0 : cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
}

// Before an in-place update of a float32 variable whose lock the caller holds: gives it a device buffer of its own
// where a read still holds the current one (blocks.h's OwnBuffer, on the device).
absl::Status OwnDeviceBuffer(OpKernelContext* ctx, tensorflow::Var* var) {
  Tensor* v = var->tensor();
  if (!var->copy_on_read_mode.load() && v->RefCountIsOne()) return absl::OkStatus();
  Tensor copy;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(tensorflow::DT_FLOAT, v->shape(), &copy));
  TF_RETURN_IF_ERROR(CudaStatus(ctx, CopyOnDevice(copy.data(), v->data(), v->TotalBytes(), StreamOf(ctx)),
                                "CopyOnDevice"));
  *v = copy;
  return absl::OkStatus();
}

int FirstOutOfRange(const int32_t* indices, int64_t k, int64_t n, int64_t* first, hc_stream stream) {
  return hc_first_out_of_range_i32(indices, k, n, first, stream);
}
int FirstOutOfRange(const int64_t* indices, int64_t k, int64_t n, int64_t* first, hc_stream stream) {
  return hc_first_out_of_range_i64(indices, k, n, first, stream);
}

// *first: the first i with indices[i] outside [0, n) (k when there is none), and *value that index, read back from
// the device: waits for the op's stream (the one host synchronisation of the ops that take indices).
template <typename Index>
absl::Status FindOutOfRange(OpKernelContext* ctx, const Tensor& indices, int64_t n, int64_t* first,
                            int64_t* value) {
  const int64_t k = indices.NumElements();
  *first = k;
  if (k == 0) return absl::OkStatus();
  const hc_stream stream = StreamOf(ctx);
  const Index* idx = Ptr<const Index>(indices);
  Tensor found;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(tensorflow::DT_INT64, TensorShape({}), &found));
  TF_RETURN_IF_ERROR(CudaStatus(ctx, FirstOutOfRange(idx, k, n, Ptr<int64_t>(found), stream), "FirstOutOfRange"));
  TF_RETURN_IF_ERROR(CudaStatus(
      ctx, cudaMemcpyAsync(first, found.data(), sizeof(int64_t), cudaMemcpyDeviceToHost, stream), "the index check"));
  TF_RETURN_IF_ERROR(CudaStatus(ctx, cudaStreamSynchronize(stream), "the index check"));
  if (*first < k) {  // the error's message names the index
    Index bad = 0;
    TF_RETURN_IF_ERROR(CudaStatus(
        ctx, cudaMemcpyAsync(&bad, idx + *first, sizeof(Index), cudaMemcpyDeviceToHost, stream), "the index check"));
    TF_RETURN_IF_ERROR(CudaStatus(ctx, cudaStreamSynchronize(stream), "the index check"));
    *value = bad;
  }
  return absl::OkStatus();
}

// CheckIndices (blocks.h), with the indices on the device: OK unless some index is outside [0, n).
template <typename Index>
absl::Status CheckIndicesOnDevice(OpKernelContext* ctx, const Tensor& indices, int64_t n) {
  int64_t first = 0, value = 0;
  TF_RETURN_IF_ERROR(FindOutOfRange<Index>(ctx, indices, n, &first, &value));
  if (first == indices.NumElements()) return absl::OkStatus();
  return InvalidArgument("indices[", first, "] = ", value, " is out of range [0, n=", n, ")");
}

// The parts of a list input or output, as the part-list launchers take them: device pointers and sizes, on the host.
template <typename Pointer>
struct Parts {
  std::vector<Pointer> pointers;
  std::vector<int64_t> sizes;

  void Add(const Tensor& t) {
    pointers.push_back(static_cast<Pointer>(t.data()));
    sizes.push_back(t.NumElements());
  }
  int64_t count() const { return static_cast<int64_t>(sizes.size()); }
};

// ---------------------------------------------------------------------------
// The launchers by element type (the C launchers' names carry it), for the kernels templated on T.

int SignPack(const float* x, int64_t n, const int64_t* bounds, int64_t num_blocks, uint8_t* bits, float* scales,
             float* residual, void* workspace, hc_stream stream) {
  return hc_sign_pack_f32(x, n, bounds, num_blocks, bits, scales, residual, workspace, stream);
}
int SignPack(const Half* x, int64_t n, const int64_t* bounds, int64_t num_blocks, uint8_t* bits, float* scales,
             float* /*no residual*/, void* workspace, hc_stream stream) {
  return hc_sign_pack_f16(x, n, bounds, num_blocks, bits, scales, workspace, stream);
}
int SignPack(const BFloat16* x, int64_t n, const int64_t* bounds, int64_t num_blocks, uint8_t* bits, float* scales,
             float* /*no residual*/, void* workspace, hc_stream stream) {
  return hc_sign_pack_bf16(x, n, bounds, num_blocks, bits, scales, workspace, stream);
}

int SignUnpackMean(const uint8_t* bits, const float* scales, const int64_t* bounds, int64_t num_blocks, int64_t n,
                   int64_t m, const float* plus, float* y, hc_stream stream) {
  return hc_sign_unpack_mean_f32(bits, scales, bounds, num_blocks, n, m, plus, y, stream);
}
int SignUnpackMean(const uint8_t* bits, const float* scales, const int64_t* bounds, int64_t num_blocks, int64_t n,
                   int64_t m, const float* plus, Half* y, hc_stream stream) {
  return hc_sign_unpack_mean_f16(bits, scales, bounds, num_blocks, n, m, plus, y, stream);
}
int SignUnpackMean(const uint8_t* bits, const float* scales, const int64_t* bounds, int64_t num_blocks, int64_t n,
                   int64_t m, const float* plus, BFloat16* y, hc_stream stream) {
  return hc_sign_unpack_mean_bf16(bits, scales, bounds, num_blocks, n, m, plus, y, stream);
}

int TopKAbs(const void* const* parts, const int64_t* sizes, int64_t num_parts, int64_t k, float* values,
            int32_t* indices, void* workspace, hc_stream stream) {
  return hc_top_k_abs_f32(parts, sizes, num_parts, k, values, indices, workspace, stream);
}
int TopKAbs(const void* const* parts, const int64_t* sizes, int64_t num_parts, int64_t k, Half* values,
            int32_t* indices, void* workspace, hc_stream stream) {
  return hc_top_k_abs_f16(parts, sizes, num_parts, k, values, indices, workspace, stream);
}
int TopKAbs(const void* const* parts, const int64_t* sizes, int64_t num_parts, int64_t k, BFloat16* values,
            int32_t* indices, void* workspace, hc_stream stream) {
  return hc_top_k_abs_bf16(parts, sizes, num_parts, k, values, indices, workspace, stream);
}

#define HC_SCATTER_DENSE(T, Index, launcher)                                                                    \
  int ScatterDense(const Index* indices, const T* values, int64_t k, int64_t n, T* y, void* workspace,        \
                   hc_stream stream) {                                                                        \
    return launcher(indices, values, k, n, y, workspace, stream);                                             \
  }
HC_SCATTER_DENSE(float, int32_t, hc_scatter_dense_f32_i32)
HC_SCATTER_DENSE(float, int64_t, hc_scatter_dense_f32_i64)
HC_SCATTER_DENSE(Half, int32_t, hc_scatter_dense_f16_i32)
HC_SCATTER_DENSE(Half, int64_t, hc_scatter_dense_f16_i64)
HC_SCATTER_DENSE(BFloat16, int32_t, hc_scatter_dense_bf16_i32)
HC_SCATTER_DENSE(BFloat16, int64_t, hc_scatter_dense_bf16_i64)
#undef HC_SCATTER_DENSE

int CountSketch(const float* x, int64_t n, int64_t seed, int64_t step, int64_t rows, int64_t cols, float* sketch,
                void* workspace, hc_stream stream) {
  return hc_count_sketch_f32(x, n, seed, step, rows, cols, sketch, workspace, stream);
}
int CountSketch(const Half* x, int64_t n, int64_t seed, int64_t step, int64_t rows, int64_t cols, float* sketch,
                void* workspace, hc_stream stream) {
  return hc_count_sketch_f16(x, n, seed, step, rows, cols, sketch, workspace, stream);
}
int CountSketch(const BFloat16* x, int64_t n, int64_t seed, int64_t step, int64_t rows, int64_t cols,
                float* sketch, void* workspace, hc_stream stream) {
  return hc_count_sketch_bf16(x, n, seed, step, rows, cols, sketch, workspace, stream);
}

// float16 from / to one part of HalfPack / HalfUnpack, by the part's dtype (float16 itself: a copy).
int HalfFrom(const Tensor& part, int64_t offset, int64_t n, Half* y, hc_stream stream) {
  switch (part.dtype()) {
    case tensorflow::DT_FLOAT: return hc_half_from_f32(Ptr<const float>(part) + offset, n, y, stream);
    case tensorflow::DT_BFLOAT16: return hc_half_from_bf16(Ptr<const BFloat16>(part) + offset, n, y, stream);
    default: return CopyOnDevice(y, Ptr<const Half>(part) + offset, n * sizeof(Half), stream);  // DT_HALF
  }
}
int HalfTo(const Half* x, int64_t n, const Tensor& part, int64_t offset, hc_stream stream) {
  switch (part.dtype()) {
    case tensorflow::DT_FLOAT: return hc_half_to_f32(x, n, Ptr<float>(part) + offset, stream);
    case tensorflow::DT_BFLOAT16: return hc_half_to_bf16(x, n, Ptr<BFloat16>(part) + offset, stream);
    default: return CopyOnDevice(Ptr<Half>(part) + offset, x, n * sizeof(Half), stream);  // DT_HALF
  }
}

// ---------------------------------------------------------------------------
// 1-bit sign (sign_ops.cc; CPU: sign_kernels.cc).

// BlockSignPack (kResidual false) and BlockSignCompress (float32, kResidual: the residual in x's buffer when
// nothing else holds it).
template <typename T, bool kResidual>
class BlockSignPackGpuOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& bounds = ctx->input(1);
    const int64_t n = x.NumElements();
    OP_REQUIRES_OK(ctx, ValidateBounds(bounds, n));
    const int64_t num_blocks = bounds.NumElements() - 1;
    Tensor *bits = nullptr, *scales = nullptr, *residual = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({(n + 7) / 8}), &bits));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({num_blocks}), &scales));
    if (kResidual) OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 2, x.shape(), &residual));
    if (n == 0) return;
    Tensor device_bounds, workspace;
    OP_REQUIRES_OK(ctx, CopyToDevice(ctx, bounds, &device_bounds));
    OP_REQUIRES_OK(ctx, AllocateWorkspace(ctx, hc_sign_pack_workspace_bytes(n, num_blocks), &workspace));
    HC_LAUNCH(ctx, SignPack, Ptr<const T>(x), n, Ptr<const int64_t>(device_bounds), num_blocks, Ptr<uint8_t>(*bits),
              Ptr<float>(*scales), kResidual ? Ptr<float>(*residual) : nullptr, workspace.data(), StreamOf(ctx));
  }
};

// BlockSignUnpack (kMean false: one payload, rank 1, the mean of one) and BlockSignUnpackMean.
template <typename T, bool kMean>
class BlockSignUnpackGpuOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& bits = ctx->input(0);
    const Tensor& scales = ctx->input(1);
    const Tensor& bounds = ctx->input(2);
    int64_t m = 0;
    OP_REQUIRES_OK(ctx, checks::SignPayloads(bits, scales, bounds, kMean ? 2 : 1, &m));
    const int64_t num_blocks = bounds.NumElements() - 1;
    const int64_t n = bounds.flat<int64_t>()(num_blocks);
    const int num_plus = ctx->num_inputs() - 3;
    OP_REQUIRES(ctx, num_plus <= 1 && (num_plus == 0 || ctx->input(3).NumElements() == n),
                InvalidArgument("plus must be at most one float32 tensor of ", n, " elements, got ", num_plus,
                                num_plus ? " of shape " + ctx->input(3).shape().DebugString() : ""));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &y));
    if (n == 0) return;
    Tensor device_bounds;
    OP_REQUIRES_OK(ctx, CopyToDevice(ctx, bounds, &device_bounds));
    HC_LAUNCH(ctx, SignUnpackMean, Ptr<const uint8_t>(bits), Ptr<const float>(scales),
              Ptr<const int64_t>(device_bounds), num_blocks, n, m,
              num_plus ? Ptr<const float>(ctx->input(3)) : nullptr, Ptr<T>(*y), StreamOf(ctx));
  }
};

// ResourceSubtractBlockSignMean: variable -= the decoded mean's elements [offset, offset + size), in place.
class ResourceSubtractBlockSignMeanGpuOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& bits = ctx->input(1);
    const Tensor& scales = ctx->input(2);
    const Tensor& bounds = ctx->input(3);
    const Tensor& offset_tensor = ctx->input(4);
    int64_t m = 0;
    OP_REQUIRES_OK(ctx, checks::SignPayloads(bits, scales, bounds, 2, &m));
    OP_REQUIRES(ctx, offset_tensor.dims() == 0,
                InvalidArgument("offset must be a scalar, got shape ", offset_tensor.shape().DebugString()));
    const int64_t num_blocks = bounds.NumElements() - 1;
    const int64_t n = bounds.flat<int64_t>()(num_blocks);
    const int64_t offset = offset_tensor.scalar<int64_t>()();

    tensorflow::core::RefCountPtr<tensorflow::Var> var;
    OP_REQUIRES_OK(ctx, tensorflow::LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), &var));
    tensorflow::mutex_lock lock(*var->mu());
    Tensor* v = var->tensor();
    OP_REQUIRES_OK(ctx, checks::SubtractTarget(*v, offset, n));
    const int64_t size = v->NumElements();
    const hc_stream stream = StreamOf(ctx);
    OP_REQUIRES_OK(ctx, OwnDeviceBuffer(ctx, var.get()));
    if (size == 0) return;
    Tensor device_bounds;
    OP_REQUIRES_OK(ctx, CopyToDevice(ctx, bounds, &device_bounds));
    HC_LAUNCH(ctx, hc_sign_subtract_mean, Ptr<const uint8_t>(bits), Ptr<const float>(scales),
              Ptr<const int64_t>(device_bounds), num_blocks, n, m, offset, size, Ptr<float>(*v), stream);
  }
};

#define REGISTER_SIGN_GPU_KERNELS(T)                                                                             \
  REGISTER_KERNEL_BUILDER(Name("BlockSignPack").Device(DEVICE_GPU).TypeConstraint<T>("T").HostMemory("bounds"), \
                          BlockSignPackGpuOp<T, false>);                                                       \
  REGISTER_KERNEL_BUILDER(                                                                                     \
      Name("BlockSignUnpack").Device(DEVICE_GPU).TypeConstraint<T>("T").HostMemory("bounds"),                   \
      BlockSignUnpackGpuOp<T, false>);                                                                         \
  REGISTER_KERNEL_BUILDER(                                                                                     \
      Name("BlockSignUnpackMean").Device(DEVICE_GPU).TypeConstraint<T>("T").HostMemory("bounds"),               \
      BlockSignUnpackGpuOp<T, true>);
REGISTER_SIGN_GPU_KERNELS(float);
REGISTER_SIGN_GPU_KERNELS(Half);
REGISTER_SIGN_GPU_KERNELS(BFloat16);
#undef REGISTER_SIGN_GPU_KERNELS
REGISTER_KERNEL_BUILDER(Name("BlockSignCompress").Device(DEVICE_GPU).HostMemory("bounds"),
                        BlockSignPackGpuOp<float, true>);
REGISTER_KERNEL_BUILDER(
    Name("ResourceSubtractBlockSignMean").Device(DEVICE_GPU).HostMemory("bounds").HostMemory("offset"),
    ResourceSubtractBlockSignMeanGpuOp);

// ---------------------------------------------------------------------------
// MomentumErrorFeed (feedback_ops.cc): a takes over g's buffer when nothing else holds it.

class MomentumErrorFeedGpuOp : public OpKernel {
 public:
  explicit MomentumErrorFeedGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
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
    Tensor *m_new = nullptr, *a = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, g.shape(), &m_new));
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 1, g.shape(), &a));
    if (g.NumElements() == 0) return;
    HC_LAUNCH(ctx, hc_momentum_error_feed, Ptr<const float>(g), Ptr<const float>(m), Ptr<const float>(e),
              g.NumElements(), lr.scalar<float>()(), momentum.scalar<float>()(), residual_scale.scalar<float>()(),
              nesterov_ ? 1 : 0, Ptr<float>(*m_new), Ptr<float>(*a), StreamOf(ctx));
  }

 private:
  bool nesterov_;
};

REGISTER_KERNEL_BUILDER(Name("MomentumErrorFeed")
                            .Device(DEVICE_GPU)
                            .HostMemory("lr")
                            .HostMemory("momentum")
                            .HostMemory("residual_scale"),
                        MomentumErrorFeedGpuOp);

// ---------------------------------------------------------------------------
// Adam with a frozen variance (adam_ops.cc; CPU: adam_kernels.cc): an output takes over an input's buffer when
// nothing else holds it.

class AdamMomentumFeedGpuOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, checks::SameShapesThenScalars(ctx, 4));
    const Tensor& g = ctx->input(0);
    Tensor* a = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0, 3}, 0, g.shape(), &a));
    HC_LAUNCH(ctx, hc_adam_momentum_feed, Ptr<const float>(g), Ptr<const float>(ctx->input(1)),
              Ptr<const float>(ctx->input(2)), Ptr<const float>(ctx->input(3)), g.NumElements(),
              ctx->input(4).scalar<float>()(), ctx->input(5).scalar<float>()(), ctx->input(6).scalar<float>()(),
              Ptr<float>(*a), StreamOf(ctx));
  }
};

class AdamFrozenStepGpuOp : public OpKernel {
 public:
  explicit AdamFrozenStepGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("momentum_exchanged", &momentum_exchanged_));
  }

  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, checks::SameShapesThenScalars(ctx, 3));
    const Tensor& mean = ctx->input(0);
    Tensor *m_new = nullptr, *delta = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({1}, 0, mean.shape(), &m_new));
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 1, mean.shape(), &delta));
    HC_LAUNCH(ctx, hc_adam_frozen_step, Ptr<const float>(mean), Ptr<const float>(ctx->input(1)),
              Ptr<const float>(ctx->input(2)), mean.NumElements(), ctx->input(3).scalar<float>()(),
              ctx->input(4).scalar<float>()(), ctx->input(5).scalar<float>()(), ctx->input(6).scalar<float>()(),
              momentum_exchanged_ ? 1 : 0, Ptr<float>(*m_new), Ptr<float>(*delta), StreamOf(ctx));
  }

 private:
  bool momentum_exchanged_;
};

class ResourceDecayAndSubtractGpuOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

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
    OP_REQUIRES_OK(ctx, OwnDeviceBuffer(ctx, var.get()));
    HC_LAUNCH(ctx, hc_decay_and_subtract, Ptr<float>(*v), Ptr<const float>(delta), v->NumElements(),
              decay.scalar<float>()(), StreamOf(ctx));
  }
};

REGISTER_KERNEL_BUILDER(Name("AdamMomentumFeed")
                            .Device(DEVICE_GPU)
                            .HostMemory("one_minus_beta_1")
                            .HostMemory("epsilon")
                            .HostMemory("bound"),
                        AdamMomentumFeedGpuOp);
REGISTER_KERNEL_BUILDER(Name("AdamFrozenStep")
                            .Device(DEVICE_GPU)
                            .HostMemory("alpha")
                            .HostMemory("one_minus_beta_1")
                            .HostMemory("epsilon")
                            .HostMemory("max_step"),
                        AdamFrozenStepGpuOp);
REGISTER_KERNEL_BUILDER(Name("ResourceDecayAndSubtract").Device(DEVICE_GPU).HostMemory("decay"),
                        ResourceDecayAndSubtractGpuOp);

// ---------------------------------------------------------------------------
// fp16 exchange (half_ops.cc; CPU: half_kernels.cc).

class HalfPackGpuOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    OpInputList xs;
    OP_REQUIRES_OK(ctx, ctx->input_list("xs", &xs));
    int64_t total = 0;
    for (int i = 0; i < xs.size(); ++i) total += xs[i].NumElements();
    Tensor* packed = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({total}), &packed));
    const hc_stream stream = StreamOf(ctx);
    Half* out = Ptr<Half>(*packed);
    for (int i = 0; i < xs.size(); out += xs[i].NumElements(), ++i) {
      if (xs[i].NumElements() > 0) HC_LAUNCH(ctx, HalfFrom, xs[i], 0, xs[i].NumElements(), out, stream);
    }
  }
};

// The float16 vectors `packed` (pieces of one vector) cut into vectors of `sizes`, each converted to its dtype.
class HalfUnpackGpuOp : public OpKernel {
 public:
  explicit HalfUnpackGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::vector<tensorflow::DataType> dtypes;
    OP_REQUIRES_OK(ctx, checks::HalfUnpackAttrs(ctx, &sizes_, &dtypes));
    where_ = std::make_unique<PartIndex>(sizes_);
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList packed;
    OP_REQUIRES_OK(ctx, ctx->input_list("packed", &packed));
    std::vector<int64_t> lengths;
    OP_REQUIRES_OK(ctx, checks::PackedVectors(packed, where_->total(), &lengths));
    const PartIndex flat_where(lengths);
    OpOutputList ys;
    OP_REQUIRES_OK(ctx, ctx->output_list("ys", &ys));
    const hc_stream stream = StreamOf(ctx);
    for (size_t i = 0; i < sizes_.size(); ++i) {
      Tensor* y = nullptr;
      OP_REQUIRES_OK(ctx, ys.allocate(i, TensorShape({sizes_[i]}), &y));
      // Output i is elements [start, start + size) of the concatenation: one conversion per packed piece it meets.
      const int64_t start = where_->start(i);
      int error = 0;
      flat_where.ForEachPartIn(start, start + sizes_[i], [&](int64_t piece, int64_t piece_offset, int64_t at,
                                                             int64_t length) {
        if (error == 0) error = HalfTo(Ptr<const Half>(packed[piece]) + piece_offset, length, *y, at - start, stream);
      });
      OP_REQUIRES_OK(ctx, CudaStatus(ctx, error, "HalfTo"));
    }
  }

 private:
  std::vector<int64_t> sizes_;
  std::unique_ptr<PartIndex> where_;
};

class HalfMeanGpuOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    OP_REQUIRES(ctx, x.dims() == 2, InvalidArgument("x must be [count, m], got ", x.shape().DebugString()));
    const int64_t count = x.dim_size(0), m = x.dim_size(1);
    OP_REQUIRES(ctx, count >= 1, InvalidArgument("x must have at least one row"));
    Tensor* mean = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m}), &mean));
    if (m == 0) return;
    HC_LAUNCH(ctx, hc_half_mean, x.data(), count, m, mean->data(), StreamOf(ctx));
  }
};

REGISTER_KERNEL_BUILDER(Name("HalfPack").Device(DEVICE_GPU), HalfPackGpuOp);
REGISTER_KERNEL_BUILDER(Name("HalfUnpack").Device(DEVICE_GPU), HalfUnpackGpuOp);
REGISTER_KERNEL_BUILDER(Name("HalfMean").Device(DEVICE_GPU), HalfMeanGpuOp);

// ---------------------------------------------------------------------------
// Top-k and scatter (topk_ops.cc; CPU: topk_kernels.cc).

template <typename T>
class TopKAbsGpuOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    OpInputList xs;
    OP_REQUIRES_OK(ctx, ctx->input_list("xs", &xs));
    const Tensor& k_tensor = ctx->input(xs.size());
    OP_REQUIRES(ctx, k_tensor.dims() == 0,
                InvalidArgument("k must be a scalar, got shape ", k_tensor.shape().DebugString()));
    Parts<const void*> parts;
    for (int i = 0; i < xs.size(); ++i) parts.Add(xs[i]);
    int64_t n = 0;
    for (int64_t size : parts.sizes) n += size;
    const int64_t k = k_tensor.scalar<int32_t>()();
    OP_REQUIRES(ctx, n <= std::numeric_limits<int32_t>::max(),
                InvalidArgument("top_k_abs returns int32 indices, so x may have at most 2^31-1 elements; got ", n,
                                ". Split the tensor into smaller buckets."));
    OP_REQUIRES(ctx, k >= 0 && k <= n,
                InvalidArgument("k must be in [0, number of elements of x = ", n, "], got k=", k,
                                ". Lower k (or the top-k ratio) for this tensor."));
    Tensor *values = nullptr, *indices = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({k}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({k}), &indices));
    if (k == 0) return;
    Tensor workspace;
    OP_REQUIRES_OK(ctx, AllocateWorkspace(ctx, hc_top_k_abs_workspace_bytes(parts.sizes.data(), parts.count()),
                                          &workspace));
    HC_LAUNCH(ctx, TopKAbs, parts.pointers.data(), parts.sizes.data(), parts.count(), k, Ptr<T>(*values),
              Ptr<int32_t>(*indices), workspace.data(), StreamOf(ctx));
  }
};

template <typename T, typename Index>
class ScatterDenseGpuOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& indices = ctx->input(0);
    const Tensor& values = ctx->input(1);
    const Tensor& n_tensor = ctx->input(2);
    OP_REQUIRES(ctx, n_tensor.dims() == 0,
                InvalidArgument("n must be a scalar, got shape ", n_tensor.shape().DebugString()));
    const int64_t n = n_tensor.scalar<int64_t>()();
    const int64_t k = indices.NumElements();
    OP_REQUIRES(ctx, n >= 0, InvalidArgument("n must be >= 0, got ", n));
    OP_REQUIRES(ctx, values.NumElements() == k,
                InvalidArgument("indices and values must have the same number of elements, got ", k, " and ",
                                values.NumElements()));
    OP_REQUIRES_OK(ctx, CheckIndicesOnDevice<Index>(ctx, indices, n));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &y));
    if (n == 0) return;
    Tensor workspace;
    OP_REQUIRES_OK(ctx, AllocateWorkspace(ctx, hc_scatter_dense_workspace_bytes(k, n), &workspace));
    HC_LAUNCH(ctx, ScatterDense, Ptr<const Index>(indices), Ptr<const T>(values), k, n, Ptr<T>(*y),
              workspace.data(), StreamOf(ctx));
  }
};

// ZeroAt: each part's buffer reused when nothing else holds it (else copied), then zeroed at `indices`.
class ZeroAtGpuOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    OpInputList xs;
    OP_REQUIRES_OK(ctx, ctx->input_list("xs", &xs));
    const Tensor& indices = ctx->input(xs.size());
    const hc_stream stream = StreamOf(ctx);
    Parts<float*> parts;
    for (int i = 0; i < xs.size(); ++i) {
      Tensor* y = nullptr;
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({i}, i, xs[i].shape(), &y));
      if (y->data() != xs[i].data()) HC_LAUNCH(ctx, CopyOnDevice, y->data(), xs[i].data(), xs[i].TotalBytes(), stream);
      parts.Add(*y);
    }
    int64_t total = 0;
    for (int64_t size : parts.sizes) total += size;
    OP_REQUIRES_OK(ctx, CheckIndicesOnDevice<int32_t>(ctx, indices, total));
    if (indices.NumElements() == 0) return;
    Tensor workspace;
    OP_REQUIRES_OK(ctx, AllocateWorkspace(ctx, hc_parts_workspace_bytes(parts.count()), &workspace));
    HC_LAUNCH(ctx, hc_zero_at, parts.pointers.data(), parts.sizes.data(), parts.count(), Ptr<const int32_t>(indices),
              indices.NumElements(), workspace.data(), stream);
  }
};

// GatherAt: the elements at `indices` of the concatenation of the parts.
class GatherAtGpuOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    OpInputList xs;
    OP_REQUIRES_OK(ctx, ctx->input_list("xs", &xs));
    const Tensor& indices = ctx->input(xs.size());
    Parts<const float*> parts;
    for (int i = 0; i < xs.size(); ++i) parts.Add(xs[i]);
    Tensor* values = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, indices.shape(), &values));
    int64_t total = 0;
    for (int64_t size : parts.sizes) total += size;
    OP_REQUIRES_OK(ctx, CheckIndicesOnDevice<int32_t>(ctx, indices, total));
    if (indices.NumElements() == 0) return;
    Tensor workspace;
    OP_REQUIRES_OK(ctx, AllocateWorkspace(ctx, hc_parts_workspace_bytes(parts.count()), &workspace));
    HC_LAUNCH(ctx, hc_gather_at, parts.pointers.data(), parts.sizes.data(), parts.count(),
              Ptr<const int32_t>(indices), indices.NumElements(), Ptr<float>(*values), workspace.data(),
              StreamOf(ctx));
  }
};

// ResourceSubtractSparseMean: every index checked against the bucket's extent only; the CPU kernel also checks
// that they increase (the exchange's indices are made increasing on every device).
class ResourceSubtractSparseMeanGpuOp : public OpKernel {
 public:
  explicit ResourceSubtractSparseMeanGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
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
    OP_REQUIRES_OK(ctx, OwnDeviceBuffer(ctx, var.get()));
    HC_LAUNCH(ctx, hc_subtract_sparse_mean, Ptr<float>(*v), v->NumElements(), Ptr<const int32_t>(indices),
              Ptr<const float>(values), indices.NumElements(), ctx->input(3).scalar<int64_t>()(), count_,
              StreamOf(ctx));
  }

 private:
  int64_t count_;
};

// ScatterMean: parts of `sizes`, zero but at each index the sum of its values (in input order) divided by count.
class ScatterMeanGpuOp : public OpKernel {
 public:
  explicit ScatterMeanGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, checks::ScatterMeanAttrs(ctx, &sizes_, &count_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& indices = ctx->input(0);
    const Tensor& values = ctx->input(1);
    const int64_t k = indices.NumElements();
    OP_REQUIRES(ctx, values.NumElements() == k,
                InvalidArgument("indices and values must have the same number of elements, got ", k, " and ",
                                values.NumElements()));
    OpOutputList ys;
    OP_REQUIRES_OK(ctx, ctx->output_list("ys", &ys));
    Parts<float*> parts;
    for (size_t i = 0; i < sizes_.size(); ++i) {
      Tensor* y = nullptr;
      OP_REQUIRES_OK(ctx, ys.allocate(i, TensorShape({sizes_[i]}), &y));
      parts.Add(*y);
    }
    int64_t total = 0;
    for (int64_t size : sizes_) total += size;
    OP_REQUIRES_OK(ctx, CheckIndicesOnDevice<int32_t>(ctx, indices, total));
    Tensor workspace;
    OP_REQUIRES_OK(ctx, AllocateWorkspace(ctx, hc_scatter_mean_workspace_bytes(k, parts.sizes.data(), parts.count()),
                                          &workspace));
    HC_LAUNCH(ctx, hc_scatter_mean, Ptr<const int32_t>(indices), Ptr<const float>(values), k, parts.pointers.data(),
              parts.sizes.data(), parts.count(), count_, workspace.data(), StreamOf(ctx));
  }

 private:
  std::vector<int64_t> sizes_;
  int64_t count_;
};

REGISTER_KERNEL_BUILDER(Name("ZeroAt").Device(DEVICE_GPU), ZeroAtGpuOp);
REGISTER_KERNEL_BUILDER(Name("GatherAt").Device(DEVICE_GPU), GatherAtGpuOp);
REGISTER_KERNEL_BUILDER(Name("ScatterMean").Device(DEVICE_GPU), ScatterMeanGpuOp);
REGISTER_KERNEL_BUILDER(Name("ResourceSubtractSparseMean").Device(DEVICE_GPU).HostMemory("offset"),
                        ResourceSubtractSparseMeanGpuOp);

#define REGISTER_TOPK_GPU_KERNELS(T)                                                                           \
  REGISTER_KERNEL_BUILDER(Name("TopKAbs").Device(DEVICE_GPU).TypeConstraint<T>("T").HostMemory("k"),            \
                          TopKAbsGpuOp<T>);                                                                   \
  REGISTER_KERNEL_BUILDER(                                                                                    \
      Name("ScatterDense").Device(DEVICE_GPU).TypeConstraint<T>("T").TypeConstraint<int32_t>("Tidx").HostMemory( \
          "n"),                                                                                               \
      ScatterDenseGpuOp<T, int32_t>);                                                                         \
  REGISTER_KERNEL_BUILDER(                                                                                    \
      Name("ScatterDense").Device(DEVICE_GPU).TypeConstraint<T>("T").TypeConstraint<int64_t>("Tidx").HostMemory( \
          "n"),                                                                                               \
      ScatterDenseGpuOp<T, int64_t>);
REGISTER_TOPK_GPU_KERNELS(float);
REGISTER_TOPK_GPU_KERNELS(Half);
REGISTER_TOPK_GPU_KERNELS(BFloat16);
#undef REGISTER_TOPK_GPU_KERNELS

// ---------------------------------------------------------------------------
// Count sketch (sketch_ops.cc; CPU: sketch_kernels.cc). The GPU kernels need n < 2^32 and cols < 2^32.

constexpr int64_t kSketchLimit = int64_t{1} << 32;

absl::Status CheckSketchSizes(int64_t n, int64_t cols) {
  if (n < kSketchLimit && cols < kSketchLimit) return absl::OkStatus();
  return InvalidArgument("the GPU count sketch kernels need n < 2^32 and cols < 2^32, got n=", n, " and cols=",
                         cols, "; place the op on the CPU");
}

absl::Status ScalarInputs(OpKernelContext* ctx, int first, int last, const char* names) {
  for (int i = first; i <= last; ++i) {
    if (ctx->input(i).dims() != 0) return InvalidArgument(names, " must be scalars");
  }
  return absl::OkStatus();
}

template <typename T>
class CountSketchGpuOp : public OpKernel {
 public:
  explicit CountSketchGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rows", &rows_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cols", &cols_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("count_loads", &count_loads_));
  }

  // The parts of x are copied into one vector on the device (the CPU kernel reads them where they lie).
  void Compute(OpKernelContext* ctx) override {
    OpInputList xs;
    OP_REQUIRES_OK(ctx, ctx->input_list("xs", &xs));
    int64_t n = 0;
    for (int i = 0; i < xs.size(); ++i) n += xs[i].NumElements();
    OP_REQUIRES_OK(ctx, ScalarInputs(ctx, xs.size(), xs.size() + 1, "seed and step"));
    OP_REQUIRES_OK(ctx, CheckSketchSizes(n, cols_));
    Tensor *sketch = nullptr, *loads = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({rows_, cols_}), &sketch));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, count_loads_ ? TensorShape({rows_, cols_}) : TensorShape({0, 0}),
                                             &loads));
    if (count_loads_) {  // (the GPU selection reads none; a hash pass, small beside the sketch's sort, so that a CPU
                         // selection of this sketch can)
      HC_LAUNCH(ctx, hc_count_sketch_loads, n, ctx->input(xs.size()).scalar<int64_t>()(),
                ctx->input(xs.size() + 1).scalar<int64_t>()(), rows_, cols_, Ptr<int32_t>(*loads), StreamOf(ctx));
    }
    Tensor joined;
    const Tensor* x = &xs[0];
    if (xs.size() > 1) {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(xs[0].dtype(), TensorShape({n}), &joined));
      char* at = static_cast<char*>(joined.data());
      for (int i = 0; i < xs.size(); ++i) {
        HC_LAUNCH(ctx, CopyOnDevice, at, xs[i].data(), xs[i].TotalBytes(), StreamOf(ctx));
        at += xs[i].TotalBytes();
      }
      x = &joined;
    }
    Tensor workspace;
    OP_REQUIRES_OK(ctx, AllocateWorkspace(ctx, hc_count_sketch_workspace_bytes(n, cols_), &workspace));
    HC_LAUNCH(ctx, CountSketch, Ptr<const T>(*x), n, ctx->input(xs.size()).scalar<int64_t>()(),
              ctx->input(xs.size() + 1).scalar<int64_t>()(), rows_, cols_, Ptr<float>(*sketch), workspace.data(),
              StreamOf(ctx));
  }

 private:
  int64_t rows_, cols_;
  bool count_loads_;
};

class CountSketchQueryGpuOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& sketch = ctx->input(0);
    OP_REQUIRES(ctx, sketch.dims() == 2 && sketch.dim_size(0) >= 1 && sketch.dim_size(1) >= 1,
                InvalidArgument("sketch must be a non-empty matrix [rows, cols], got ",
                                sketch.shape().DebugString()));
    OP_REQUIRES_OK(ctx, ScalarInputs(ctx, 1, 3, "n, seed and step"));
    const int64_t rows = sketch.dim_size(0), cols = sketch.dim_size(1);
    const int64_t n = ctx->input(1).scalar<int64_t>()();
    OP_REQUIRES(ctx, n >= 0, InvalidArgument("n must be >= 0, got ", n));
    OP_REQUIRES_OK(ctx, CheckSketchSizes(n, cols));
    Tensor* estimate = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &estimate));
    HC_LAUNCH(ctx, hc_count_sketch_query, Ptr<const float>(sketch), rows, cols, n, ctx->input(2).scalar<int64_t>()(),
              ctx->input(3).scalar<int64_t>()(), Ptr<float>(*estimate), StreamOf(ctx));
  }
};

class CountSketchBucketsGpuOp : public OpKernel {
 public:
  explicit CountSketchBucketsGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rows", &rows_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cols", &cols_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& indices = ctx->input(0);
    OP_REQUIRES(ctx, indices.dims() == 1, InvalidArgument("indices must be a vector"));
    OP_REQUIRES_OK(ctx, ScalarInputs(ctx, 1, 3, "n, seed and step"));
    const int64_t n = ctx->input(1).scalar<int64_t>()();
    OP_REQUIRES_OK(ctx, CheckSketchSizes(n, cols_));
    int64_t first = 0, value = 0;
    OP_REQUIRES_OK(ctx, FindOutOfRange<int64_t>(ctx, indices, n, &first, &value));
    OP_REQUIRES(ctx, first == indices.NumElements(),
                InvalidArgument("indices must be in [0, n = ", n, "), got ", value));
    Tensor* buckets = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({rows_, indices.NumElements()}), &buckets));
    HC_LAUNCH(ctx, hc_count_sketch_buckets, Ptr<const int64_t>(indices), indices.NumElements(), n,
              ctx->input(2).scalar<int64_t>()(), ctx->input(3).scalar<int64_t>()(), rows_, cols_,
              Ptr<int64_t>(*buckets), StreamOf(ctx));
  }

 private:
  int64_t rows_, cols_;
};

// CountSketchTopK: the query of the one row into a temporary, its top-k, and x gathered there (the CPU kernel's
// selection over cells saves the n estimates' memory traffic, which the device's bandwidth makes cheap here; so
// it reads no loads).
class CountSketchTopKGpuOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& sketch = ctx->input(0);
    int64_t n = 0, k = 0;
    OP_REQUIRES_OK(ctx, checks::SketchTopKInputs(ctx, &n, &k));
    OpInputList xs;
    OP_REQUIRES_OK(ctx, ctx->input_list("xs", &xs));
    Parts<const float*> parts;
    for (int i = 0; i < xs.size(); ++i) parts.Add(xs[i]);
    const int64_t seed = ctx->input(xs.size() + 3).scalar<int64_t>()();
    const int64_t step = ctx->input(xs.size() + 4).scalar<int64_t>()();
    OP_REQUIRES_OK(ctx, CheckSketchSizes(n, sketch.dim_size(1)));
    Tensor *values = nullptr, *indices = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({k}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({k}), &indices));
    if (k == 0) return;
    Tensor estimate, selected, workspace, gather_workspace;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_FLOAT, TensorShape({n}), &estimate));
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_FLOAT, TensorShape({k}), &selected));
    HC_LAUNCH(ctx, hc_count_sketch_query, Ptr<const float>(sketch), 1, sketch.dim_size(1), n, seed, step,
              Ptr<float>(estimate), StreamOf(ctx));
    const void* estimates[] = {estimate.data()};
    OP_REQUIRES_OK(ctx, AllocateWorkspace(ctx, hc_top_k_abs_workspace_bytes(&n, 1), &workspace));
    HC_LAUNCH(ctx, TopKAbs, estimates, &n, 1, k, Ptr<float>(selected), Ptr<int32_t>(*indices), workspace.data(),
              StreamOf(ctx));
    OP_REQUIRES_OK(ctx, AllocateWorkspace(ctx, hc_parts_workspace_bytes(parts.count()), &gather_workspace));
    HC_LAUNCH(ctx, hc_gather_at, parts.pointers.data(), parts.sizes.data(), parts.count(),
              Ptr<const int32_t>(*indices), k, Ptr<float>(*values), gather_workspace.data(), StreamOf(ctx));
  }
};

#define REGISTER_SKETCH_GPU_KERNEL(T)                                                                          \
  REGISTER_KERNEL_BUILDER(                                                                                    \
      Name("CountSketch").Device(DEVICE_GPU).HostMemory("seed").HostMemory("step").TypeConstraint<T>("T"),    \
      CountSketchGpuOp<T>);
REGISTER_SKETCH_GPU_KERNEL(float);
REGISTER_SKETCH_GPU_KERNEL(Half);
REGISTER_SKETCH_GPU_KERNEL(BFloat16);
#undef REGISTER_SKETCH_GPU_KERNEL
REGISTER_KERNEL_BUILDER(
    Name("CountSketchQuery").Device(DEVICE_GPU).HostMemory("n").HostMemory("seed").HostMemory("step"),
    CountSketchQueryGpuOp);
REGISTER_KERNEL_BUILDER(
    Name("CountSketchTopK").Device(DEVICE_GPU).HostMemory("k").HostMemory("seed").HostMemory("step"),
    CountSketchTopKGpuOp);
REGISTER_KERNEL_BUILDER(
    Name("CountSketchBuckets").Device(DEVICE_GPU).HostMemory("n").HostMemory("seed").HostMemory("step"),
    CountSketchBucketsGpuOp);

// ---------------------------------------------------------------------------
// Low-bit quantization (quantize_ops.cc; CPU: quantize_kernels.cc).

absl::Status QuantizeBitsAttr(OpKernelConstruction* ctx, int* bits) {
  int64_t value;
  TF_RETURN_IF_ERROR(ctx->GetAttr("bits", &value));
  if (value != 2 && value != 4 && value != 8) return InvalidArgument("bits must be 2, 4 or 8, got ", value);
  *bits = static_cast<int>(value);
  return absl::OkStatus();
}

// BlockQuantizeCompress: one part without a plus is coded where it lies; otherwise the parts' x_k + plus_k
// (hc_error_feed) or x_k are gathered into one buffer, coded there in place and the residuals copied out.
class BlockQuantizeCompressGpuOp : public OpKernel {
 public:
  explicit BlockQuantizeCompressGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, QuantizeBitsAttr(ctx, &bits_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("stochastic", &stochastic_));
  }

  void Compute(OpKernelContext* ctx) override {
    tensorflow::OpInputList xs, pluses;
    OP_REQUIRES_OK(ctx, ctx->input_list("xs", &xs));
    OP_REQUIRES_OK(ctx, ctx->input_list("pluses", &pluses));
    const Tensor& bounds = ctx->input(2 * xs.size());
    const Tensor& seed = ctx->input(2 * xs.size() + 1);
    std::vector<int64_t> sizes;
    for (int k = 0; k < xs.size(); ++k) sizes.push_back(xs[k].NumElements());
    const PartIndex where(sizes);
    const int64_t n = where.total();
    OP_REQUIRES_OK(ctx, ValidateBounds(bounds, n));
    OP_REQUIRES(ctx, seed.dims() == 1 && seed.NumElements() == 2,
                InvalidArgument("seed must be an int64 vector [key, counter], got shape ",
                                seed.shape().DebugString()));
    const int64_t num_blocks = bounds.NumElements() - 1;
    const int64_t* host_bounds = bounds.flat<int64_t>().data();
    bool any_plus = false;
    for (int k = 0; k < xs.size(); ++k) {
      OP_REQUIRES(ctx, pluses[k].NumElements() == sizes[k] || pluses[k].NumElements() == 0,
                  InvalidArgument("pluses[", k, "] must have the ", sizes[k], " elements of xs[", k,
                                  "], or none, got shape ", pluses[k].shape().DebugString()));
      OP_REQUIRES(ctx, std::binary_search(host_bounds, host_bounds + num_blocks + 1, where.start(k)),
                  InvalidArgument("xs[", k, "] starts at element ", where.start(k),
                                  ", inside a block: every part must start at one of the bounds"));
      any_plus = any_plus || pluses[k].NumElements() > 0;
    }
    Tensor *packed = nullptr, *scales = nullptr, *offsets = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({QuantizePackedBytes(n, bits_)}), &packed));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({num_blocks}), &scales));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({num_blocks}), &offsets));
    std::vector<Tensor*> residuals(xs.size());
    for (int k = 0; k < xs.size(); ++k) {
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({k}, 3 + k, xs[k].shape(), &residuals[k]));
    }
    if (n == 0) return;
    const auto stream = StreamOf(ctx);
    const bool in_place = xs.size() == 1 && !any_plus;
    Tensor gathered;
    if (!in_place) {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_FLOAT, TensorShape({n}), &gathered));
      for (int k = 0; k < xs.size(); ++k) {
        float* to = Ptr<float>(gathered) + where.start(k);
        if (pluses[k].NumElements() > 0) {
          HC_LAUNCH(ctx, hc_error_feed, Ptr<const float>(xs[k]), Ptr<const float>(pluses[k]), sizes[k], to, stream);
        } else if (sizes[k] > 0) {
          HC_LAUNCH(ctx, CopyOnDevice, to, xs[k].data(), xs[k].TotalBytes(), stream);
        }
      }
    }
    const float* x = in_place ? Ptr<const float>(xs[0]) : Ptr<const float>(gathered);
    float* residual = in_place ? Ptr<float>(*residuals[0]) : Ptr<float>(gathered);
    Tensor device_bounds, workspace;
    OP_REQUIRES_OK(ctx, CopyToDevice(ctx, bounds, &device_bounds));
    // 16-byte alignment, as the launcher needs: TensorFlow's allocators align to at least 64 bytes.
    OP_REQUIRES_OK(ctx, AllocateWorkspace(ctx, hc_quantize_compress_workspace_bytes(num_blocks), &workspace));
    const auto key_counter = seed.flat<int64_t>();
    HC_LAUNCH(ctx, hc_quantize_compress, x, Ptr<const int64_t>(device_bounds), num_blocks, n, bits_,
              stochastic_ ? 1 : 0, key_counter(0), key_counter(1), Ptr<uint8_t>(*packed), Ptr<float>(*scales),
              Ptr<float>(*offsets), residual, workspace.data(), stream);
    if (in_place) return;
    for (int k = 0; k < xs.size(); ++k) {
      if (sizes[k] == 0) continue;
      HC_LAUNCH(ctx, CopyOnDevice, residuals[k]->data(), Ptr<const float>(gathered) + where.start(k),
                residuals[k]->TotalBytes(), stream);
    }
  }

 private:
  int bits_;
  bool stochastic_;
};

class BlockQuantizeDecodeMeanGpuOp : public OpKernel {
 public:
  explicit BlockQuantizeDecodeMeanGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, QuantizeBitsAttr(ctx, &bits_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& packed = ctx->input(0);
    const Tensor& scales = ctx->input(1);
    const Tensor& offsets = ctx->input(2);
    const Tensor& bounds = ctx->input(3);
    const Tensor& plus = ctx->input(4);
    int64_t n, m, num_blocks;
    OP_REQUIRES_OK(ctx, checks::QuantizePayloads(packed, scales, offsets, bounds, plus, bits_, &n, &m, &num_blocks));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &y));
    if (n == 0) return;
    Tensor device_bounds;
    OP_REQUIRES_OK(ctx, CopyToDevice(ctx, bounds, &device_bounds));
    HC_LAUNCH(ctx, hc_quantize_decode_mean, Ptr<const uint8_t>(packed), Ptr<const float>(scales),
              Ptr<const float>(offsets), Ptr<const int64_t>(device_bounds), num_blocks, n, m, bits_,
              plus.NumElements() > 0 ? Ptr<const float>(plus) : nullptr, Ptr<float>(*y), StreamOf(ctx));
  }

 private:
  int bits_;
};

// BlockQuantizeRecodeMean: the decoded mean (+ plus) into the residual's buffer, then coded there in place (the
// compress launcher takes residual == x). Two launches, the same bits as the CPU's one pass.
class BlockQuantizeRecodeMeanGpuOp : public OpKernel {
 public:
  explicit BlockQuantizeRecodeMeanGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, QuantizeBitsAttr(ctx, &bits_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("stochastic", &stochastic_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& packed = ctx->input(0);
    const Tensor& scales = ctx->input(1);
    const Tensor& offsets = ctx->input(2);
    const Tensor& bounds = ctx->input(3);
    const Tensor& plus = ctx->input(4);
    const Tensor& seed = ctx->input(5);
    int64_t n, m, num_blocks;
    OP_REQUIRES_OK(ctx, checks::QuantizePayloads(packed, scales, offsets, bounds, plus, bits_, &n, &m, &num_blocks));
    OP_REQUIRES(ctx, seed.dims() == 1 && seed.NumElements() == 2,
                InvalidArgument("seed must be an int64 vector [key, counter], got shape ",
                                seed.shape().DebugString()));
    Tensor *recoded = nullptr, *recoded_scales = nullptr, *recoded_offsets = nullptr, *residual = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({QuantizePackedBytes(n, bits_)}), &recoded));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({num_blocks}), &recoded_scales));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({num_blocks}), &recoded_offsets));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({n}), &residual));
    if (n == 0) return;
    Tensor device_bounds, workspace;
    OP_REQUIRES_OK(ctx, CopyToDevice(ctx, bounds, &device_bounds));
    OP_REQUIRES_OK(ctx, AllocateWorkspace(ctx, hc_quantize_compress_workspace_bytes(num_blocks), &workspace));
    HC_LAUNCH(ctx, hc_quantize_decode_mean, Ptr<const uint8_t>(packed), Ptr<const float>(scales),
              Ptr<const float>(offsets), Ptr<const int64_t>(device_bounds), num_blocks, n, m, bits_,
              plus.NumElements() > 0 ? Ptr<const float>(plus) : nullptr, Ptr<float>(*residual), StreamOf(ctx));
    const auto key_counter = seed.flat<int64_t>();
    HC_LAUNCH(ctx, hc_quantize_compress, Ptr<const float>(*residual), Ptr<const int64_t>(device_bounds), num_blocks,
              n, bits_, stochastic_ ? 1 : 0, key_counter(0), key_counter(1), Ptr<uint8_t>(*recoded),
              Ptr<float>(*recoded_scales), Ptr<float>(*recoded_offsets), Ptr<float>(*residual), workspace.data(),
              StreamOf(ctx));
  }

 private:
  int bits_;
  bool stochastic_;
};

REGISTER_KERNEL_BUILDER(Name("BlockQuantizeCompress").Device(DEVICE_GPU).HostMemory("bounds").HostMemory("seed"),
                        BlockQuantizeCompressGpuOp);
REGISTER_KERNEL_BUILDER(Name("BlockQuantizeDecodeMean").Device(DEVICE_GPU).HostMemory("bounds"),
                        BlockQuantizeDecodeMeanGpuOp);
REGISTER_KERNEL_BUILDER(Name("BlockQuantizeRecodeMean").Device(DEVICE_GPU).HostMemory("bounds").HostMemory("seed"),
                        BlockQuantizeRecodeMeanGpuOp);

// ---------------------------------------------------------------------------
// Stochastic Gradient Push's share (pushsum_ops.cc; CPU: pushsum_kernels.cc). The weight stays on the device.

class PushSumShareGpuOp : public OpKernel {
 public:
  explicit PushSumShareGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("parts", &parts_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList values, before;
    const Tensor* weight = nullptr;
    OP_REQUIRES_OK(ctx, checks::PushSumShareInputs(ctx, &values, &before, &weight));
    Parts<const float*> z, b;
    for (int i = 0; i < values.size(); ++i) z.Add(values[i]);
    for (int i = 0; i < before.size(); ++i) b.Add(before[i]);
    const int64_t total = PartIndex(z.sizes).total();
    Tensor* share = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({total + 1}), &share));
    HC_LAUNCH(ctx, hc_push_sum_share, z.pointers.data(), before.size() > 0 ? b.pointers.data() : nullptr,
              z.sizes.data(), z.count(), Ptr<const float>(*weight), parts_, Ptr<float>(*share), StreamOf(ctx));
  }

 private:
  int64_t parts_;
};

REGISTER_KERNEL_BUILDER(Name("PushSumShare").Device(DEVICE_GPU), PushSumShareGpuOp);

#undef HC_LAUNCH

}  // namespace
}  // namespace hvd_compress

#endif  // GOOGLE_CUDA
