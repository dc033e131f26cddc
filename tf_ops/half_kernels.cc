// CPU kernels for HalfPack, HalfMean and HalfUnpack: float32 <-> float16 with
// F16C (8 values an instruction, round to nearest even) where the compiler
// targets it, Eigen's scalar conversion (the same rounding) elsewhere. Work is
// cut into fixed chunks (blocks.h), so the bits never depend on the threads.
#include <cstring>
#include <memory>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "blocks.h"
#include "op_checks.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace hvd_compress {

using tensorflow::bfloat16;
using tensorflow::DEVICE_CPU;
using tensorflow::OpInputList;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpOutputList;
using tensorflow::TensorShape;
using Half = Eigen::half;

namespace {

void FloatToHalf(const float* x, Half* y, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), h);
  }
#endif
  for (; i < n; ++i) y[i] = Half(x[i]);
}

void HalfToFloat(const Half* x, float* y, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
  }
#endif
  for (; i < n; ++i) y[i] = static_cast<float>(x[i]);
}

// Converts n values of one dtype to another through float32 (exact for the
// 16-bit inputs), a chunk of float32 at a time.
template <typename From, typename To>
void Convert(const From* x, To* y, int64_t n) {
  if constexpr (std::is_same_v<From, To>) {
    std::memcpy(y, x, n * sizeof(To));
  } else if constexpr (std::is_same_v<From, float> && std::is_same_v<To, Half>) {
    FloatToHalf(x, y, n);
  } else if constexpr (std::is_same_v<From, Half> && std::is_same_v<To, float>) {
    HalfToFloat(x, y, n);
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = To(static_cast<float>(x[i]));
  }
}

// Converts between the parts (each of dtype dtypes[i]) and the flat float16
// buffer, itself in pieces (flats[j] holds flat_where's piece j), chunk by chunk
// on TF's thread pool. to_half: parts -> flat.
void ConvertParts(OpKernelContext* ctx, const PartIndex& where,
                  const std::vector<tensorflow::DataType>& dtypes, const std::vector<void*>& parts,
                  const PartIndex& flat_where, const std::vector<Half*>& flats, bool to_half) {
  const int64_t total = where.total();
  ParallelFor(ctx, NumChunks(total), kChunk * 2, [&](int64_t first, int64_t last) {
    where.ForEachPartIn(first * kChunk, std::min(total, last * kChunk),
                        [&](int64_t part, int64_t offset, int64_t at, int64_t length) {
      flat_where.ForEachPartIn(at, at + length, [&](int64_t piece, int64_t piece_offset, int64_t piece_at, int64_t n) {
        Half* h = flats[piece] + piece_offset;
        const int64_t o = offset + (piece_at - at);  // the same element's offset in the part
        switch (dtypes[part]) {
          case tensorflow::DT_FLOAT: {
            float* p = static_cast<float*>(parts[part]) + o;
            to_half ? Convert(p, h, n) : Convert(h, p, n);
            break;
          }
          case tensorflow::DT_HALF: {
            Half* p = static_cast<Half*>(parts[part]) + o;
            to_half ? Convert(p, h, n) : Convert(h, p, n);
            break;
          }
          default: {  // DT_BFLOAT16 (the ops' type constraints allow no other)
            bfloat16* p = static_cast<bfloat16*>(parts[part]) + o;
            to_half ? Convert(p, h, n) : Convert(h, p, n);
          }
        }
      });
    });
  });
}

}  // namespace

class HalfPackOp : public OpKernel {
 public:
  explicit HalfPackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OpInputList xs;
    OP_REQUIRES_OK(ctx, ctx->input_list("xs", &xs));
    std::vector<int64_t> sizes;
    std::vector<tensorflow::DataType> dtypes;
    std::vector<void*> parts;
    for (int i = 0; i < xs.size(); ++i) {
      sizes.push_back(xs[i].NumElements());
      dtypes.push_back(xs[i].dtype());
      parts.push_back(const_cast<char*>(xs[i].tensor_data().data()));
    }
    const PartIndex where(sizes);
    Tensor* packed = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({where.total()}), &packed));
    ConvertParts(ctx, where, dtypes, parts, PartIndex({where.total()}), {packed->flat<Half>().data()},
                 /*to_half=*/true);
  }
};

class HalfUnpackOp : public OpKernel {
 public:
  explicit HalfUnpackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, checks::HalfUnpackAttrs(ctx, &sizes_, &dtypes_));
    where_ = std::make_unique<PartIndex>(sizes_);
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList packed;
    OP_REQUIRES_OK(ctx, ctx->input_list("packed", &packed));
    std::vector<int64_t> lengths;
    OP_REQUIRES_OK(ctx, checks::PackedVectors(packed, where_->total(), &lengths));
    std::vector<Half*> flats;
    for (int j = 0; j < packed.size(); ++j) {
      flats.push_back(const_cast<Half*>(packed[j].flat<Half>().data()));
    }
    const PartIndex flat_where(lengths);
    OpOutputList ys;
    OP_REQUIRES_OK(ctx, ctx->output_list("ys", &ys));
    std::vector<void*> parts;
    for (size_t i = 0; i < sizes_.size(); ++i) {
      Tensor* y = nullptr;
      OP_REQUIRES_OK(ctx, ys.allocate(i, TensorShape({sizes_[i]}), &y));
      parts.push_back(const_cast<char*>(y->tensor_data().data()));
    }
    ConvertParts(ctx, *where_, dtypes_, parts, flat_where, flats, /*to_half=*/false);
  }

 private:
  std::vector<int64_t> sizes_;
  std::unique_ptr<PartIndex> where_;
  std::vector<tensorflow::DataType> dtypes_;
};

class HalfMeanOp : public OpKernel {
 public:
  explicit HalfMeanOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    OP_REQUIRES(ctx, x.dims() == 2, InvalidArgument("x must be [count, m], got ", x.shape().DebugString()));
    const int64_t count = x.dim_size(0), m = x.dim_size(1);
    OP_REQUIRES(ctx, count >= 1, InvalidArgument("x must have at least one row"));
    Tensor* mean = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m}), &mean));
    const Half* rows = x.flat<Half>().data();
    Half* out = mean->flat<Half>().data();
    const float divisor = static_cast<float>(count);
    ParallelFor(ctx, NumChunks(m), kChunk * (count + 1), [&](int64_t first, int64_t last) {
      std::vector<float> sum(kChunk), row(kChunk);
      for (int64_t chunk = first; chunk < last; ++chunk) {
        const int64_t begin = chunk * kChunk, length = std::min(m, begin + kChunk) - begin;
        HalfToFloat(rows + begin, sum.data(), length);
        for (int64_t r = 1; r < count; ++r) {  // cores.h's RowMean, a chunk at a time
          HalfToFloat(rows + r * m + begin, row.data(), length);
          for (int64_t i = 0; i < length; ++i) sum[i] += row[i];
        }
        for (int64_t i = 0; i < length; ++i) sum[i] /= divisor;
        FloatToHalf(sum.data(), out + begin, length);
      }
    });
  }
};

REGISTER_KERNEL_BUILDER(Name("HalfPack").Device(DEVICE_CPU), HalfPackOp);
REGISTER_KERNEL_BUILDER(Name("HalfUnpack").Device(DEVICE_CPU), HalfUnpackOp);
REGISTER_KERNEL_BUILDER(Name("HalfMean").Device(DEVICE_CPU), HalfMeanOp);

}  // namespace hvd_compress
