// The GPU kernels' launchers, in C so that both TensorFlow's GPU op kernels and the standalone
// harness (tests/gpu/harness.py, through ctypes) call the same code. Pointers are device memory
// unless named *_host. Each launcher enqueues on `stream` and returns a cudaError_t as int (0: success).
// Element types: "f32" float, "f16" IEEE half, "bf16" bfloat16.
#ifndef HVD_COMPRESS_TF_OPS_GPU_LAUNCHERS_H_
#define HVD_COMPRESS_TF_OPS_GPU_LAUNCHERS_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st* hc_stream;

// ---- 1-bit sign (sign_kernels.cu): BlockSignPack, BlockSignCompress, BlockSignUnpack(Mean),
// ResourceSubtractBlockSignMean. bounds_host: the num_blocks + 1 block bounds on the host; the
// pack needs a device workspace of hc_sign_pack_workspace_bytes(...) bytes.
size_t hc_sign_pack_workspace_bytes(const int64_t* bounds_host, int64_t num_blocks);
// bits[(n + 7) / 8], scales[num_blocks]; residual (f32 only, may be NULL, may be x): x - C(x).
int hc_sign_pack_f32(const float* x, const int64_t* bounds_host, int64_t num_blocks, uint8_t* bits, float* scales,
                     float* residual, void* workspace, hc_stream stream);
int hc_sign_pack_f16(const void* x, const int64_t* bounds_host, int64_t num_blocks, uint8_t* bits, float* scales,
                     void* workspace, hc_stream stream);
int hc_sign_pack_bf16(const void* x, const int64_t* bounds_host, int64_t num_blocks, uint8_t* bits, float* scales,
                      void* workspace, hc_stream stream);
// y[i] = mean over m payloads (bits [m, (n + 7) / 8], scales [m, num_blocks]) (+ plus[i] when plus is not NULL).
int hc_sign_unpack_mean_f32(const uint8_t* bits, const float* scales, const int64_t* bounds, int64_t num_blocks,
                            int64_t n, int64_t m, const float* plus, float* y, hc_stream stream);
int hc_sign_unpack_mean_f16(const uint8_t* bits, const float* scales, const int64_t* bounds, int64_t num_blocks,
                            int64_t n, int64_t m, const float* plus, void* y, hc_stream stream);
int hc_sign_unpack_mean_bf16(const uint8_t* bits, const float* scales, const int64_t* bounds, int64_t num_blocks,
                             int64_t n, int64_t m, const float* plus, void* y, hc_stream stream);
// variable[i - offset] -= the mean, for i in [offset, offset + size).
int hc_sign_subtract_mean(const uint8_t* bits, const float* scales, const int64_t* bounds, int64_t num_blocks,
                          int64_t n, int64_t m, int64_t offset, int64_t size, float* variable, hc_stream stream);

// ---- Momentum with error feedback (feedback_kernels.cu): MomentumErrorFeed. a may be g.
int hc_momentum_error_feed(const float* g, const float* m, const float* e, int64_t n, float lr, float momentum,
                           float residual_scale, int nesterov, float* m_new, float* a, hc_stream stream);

// ---- fp16 (half_kernels.cu): HalfPack / HalfUnpack of one part, HalfMean.
int hc_half_from_f32(const float* x, int64_t n, void* y, hc_stream stream);
int hc_half_from_bf16(const void* x, int64_t n, void* y, hc_stream stream);
int hc_half_to_f32(const void* x, int64_t n, float* y, hc_stream stream);
int hc_half_to_bf16(const void* x, int64_t n, void* y, hc_stream stream);
// mean[m] of rows x[count, m] (float16).
int hc_half_mean(const void* x, int64_t count, int64_t m, void* mean, hc_stream stream);

// ---- top-k and scatter (topk_kernels.cu): TopKAbs, ScatterDense, ScatterMean, GatherAt, ZeroAt.

// ---- count sketch (sketch_kernels.cu): CountSketch, CountSketchBuckets, CountSketchQuery.

// ---- low-bit quantization (quantize_kernels.cu): BlockQuantizeCompress, BlockQuantizeDecodeMean.

#ifdef __cplusplus
}
#endif

#endif  // HVD_COMPRESS_TF_OPS_GPU_LAUNCHERS_H_
