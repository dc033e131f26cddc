// Op registrations and shape functions for the blockwise low-bit quantizer
// (Compression.quantize): each block of a flat float32 vector is coded with
// `bits` bits per element on a uniform grid from its min to its max.
//
// Format (bit-exact between the kernels in quantize_kernels.cc and the NumPy
// reference block_quantize_* in tests/np_reference.py):
//   * x: float32[n]; blocks given by bounds int64 [0 = b_0 < ... < b_B = n] (as
//     the sign ops, from hvd_compress.ops.layout_bounds); bits in {2, 4, 8};
//     L = 2^bits - 1 levels above 0.
//   * Per block: lo = min(x_b), hi = max(x_b) in float32, each then + 0.0f (a
//     zero bound is +0, whichever zero the min or max met first). When the
//     block holds a NaN or an Inf, or hi - lo overflows to Inf: the block is
//     non-finite, scale = offset = NaN and every q = 0, so it decodes to NaN.
//     Else offset = lo, scale = float32(hi - lo) / float32(L) and
//     inv = float32(L) / float32(hi - lo) (inv = 0 when hi == lo: scale = 0 and
//     every q = 0, the block decodes to lo exactly).
//   * Code of x[i] in block b: v = (x[i] - offset) * inv (float32);
//     deterministic: f = floor(v + 0.5f); stochastic: f = floor(v + u_i) with
//     u_i in [0, 1) below; then q = f clamped to [0, L], NaN -> 0 (as
//     q = min(max(f, 0), L) with max(NaN, 0) = 0).
//   * Decode: xhat = offset + float32(q) * scale (two float32 roundings, no FMA).
//   * Packing: element i occupies bits [i*bits, (i+1)*bits) of a uint8 vector
//     of ceil(n*bits/8) bytes, LSB first (byte (i*bits)/8, shift (i*bits)%8);
//     unused high bits of the last byte are 0. No element straddles bytes, and
//     elements from a multiple of 8 on start at a whole byte, so the payload of
//     a shard cut at a multiple of 8 elements is a slice of the packed bytes.
//   * Stochastic draws, counter-based and stateless: for seed = (key, counter)
//     int64[2] and the global index i of the element in x,
//       K = splitmix64((uint64(key) * 0x9E3779B97F4A7C15) ^ (uint64(counter) * 0xC2B2AE3D27D4EB4F))
//       j = 8 floor(i / 16) + i mod 8   (two elements share a hash, 16 bits each)
//       h = mix32(lo32(j) ^ lo32(K)) ^ hi32(K) ^ hi32(j)
//       u_i = (i mod 16 < 8 ? h >> 16 : h & 0xffff) * 2^-16   (exact in float32, in [0, 1))
//     with splitmix64(z): z += 0x9E3779B97F4A7C15;
//       z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9;
//       z = (z ^ (z >> 27)) * 0x94D049BB133111EB; return z ^ (z >> 31)
//     (uint64, wrapping) and mix32(x) (lowbias32): x ^= x >> 16; x *= 0x7feb352d;
//       x ^= x >> 15; x *= 0x846ca68b; return x ^ (x >> 16)
//     (uint32, wrapping). E[q * scale + offset] = x within the block's range.
//
// TensorFlow runs CPU kernels with denormals flushed to zero, so results may
// differ from the NumPy reference where an input or intermediate is subnormal.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "status.h"

namespace hvd_compress {

using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

namespace {

absl::Status QuantizeBits(InferenceContext* c, int64_t* bits) {
  TF_RETURN_IF_ERROR(c->GetAttr("bits", bits));
  if (*bits != 2 && *bits != 4 && *bits != 8) {
    return InvalidArgument("bits must be 2, 4 or 8, got ", *bits);
  }
  return absl::OkStatus();
}

// B from bounds [B + 1].
absl::Status QuantizeNumBlocks(InferenceContext* c, int bounds_input, DimensionHandle* blocks) {
  ShapeHandle bounds;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(bounds_input), 1, &bounds));
  return c->Subtract(c->Dim(bounds, 0), 1, blocks);
}

// n = bounds[-1] when bounds is a constant known at graph-building time.
DimensionHandle QuantizeNumElements(InferenceContext* c, int bounds_input) {
  const tensorflow::Tensor* bounds = c->input_tensor(bounds_input);
  if (bounds == nullptr || bounds->NumElements() == 0) return c->UnknownDim();
  return c->MakeDim(bounds->flat<int64_t>()(bounds->NumElements() - 1));
}

// xs (N parts of n elements in all), pluses (N), bounds [B + 1], seed [2]: packed [ceil(n * bits / 8)], scales and
// offsets [B], residuals like xs.
absl::Status CompressShape(InferenceContext* c) {
  int64_t bits, parts;
  TF_RETURN_IF_ERROR(QuantizeBits(c, &bits));
  TF_RETURN_IF_ERROR(c->GetAttr("N", &parts));
  const int bounds_input = static_cast<int>(2 * parts);
  DimensionHandle blocks, n = c->MakeDim(0), n_bits, n_bits_plus_7, num_bytes;
  TF_RETURN_IF_ERROR(QuantizeNumBlocks(c, bounds_input, &blocks));
  ShapeHandle seed;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(bounds_input + 1), 1, &seed));
  DimensionHandle unused;
  TF_RETURN_IF_ERROR(c->WithValue(c->Dim(seed, 0), 2, &unused));
  for (int k = 0; k < parts; ++k) TF_RETURN_IF_ERROR(c->Add(n, c->NumElements(c->input(k)), &n));
  TF_RETURN_IF_ERROR(c->Multiply(n, bits, &n_bits));
  TF_RETURN_IF_ERROR(c->Add(n_bits, 7, &n_bits_plus_7));
  TF_RETURN_IF_ERROR(c->Divide(n_bits_plus_7, 8, /*evenly_divisible=*/false, &num_bytes));
  c->set_output(0, c->Vector(num_bytes));
  c->set_output(1, c->Vector(blocks));
  c->set_output(2, c->Vector(blocks));
  for (int k = 0; k < parts; ++k) c->set_output(3 + k, c->input(k));
  return absl::OkStatus();
}

// packed [m, nbytes], scales and offsets [m, B], plus [n] or [0]: y [n].
absl::Status DecodeMeanShape(InferenceContext* c) {
  int64_t bits;
  TF_RETURN_IF_ERROR(QuantizeBits(c, &bits));
  DimensionHandle blocks, m;
  TF_RETURN_IF_ERROR(QuantizeNumBlocks(c, 3, &blocks));
  ShapeHandle packed, scales, offsets;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &packed));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &scales));
  TF_RETURN_IF_ERROR(c->Merge(c->input(2), scales, &offsets));
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(offsets, 1), blocks, &blocks));
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(packed, 0), c->Dim(offsets, 0), &m));
  const DimensionHandle n = QuantizeNumElements(c, 3);
  if (c->ValueKnown(n)) {
    DimensionHandle unused;
    TF_RETURN_IF_ERROR(c->Merge(c->Dim(packed, 1), c->MakeDim((c->Value(n) * bits + 7) / 8), &unused));
  }
  c->set_output(0, c->Vector(n));
  return absl::OkStatus();
}

// packed [m, nbytes], scales and offsets [m, B], plus [n] or [0], seed [2]: a payload of n elements and its
// residual [n].
absl::Status RecodeMeanShape(InferenceContext* c) {
  TF_RETURN_IF_ERROR(DecodeMeanShape(c));
  const ShapeHandle mean = c->output(0);
  ShapeHandle seed;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(5), 1, &seed));
  DimensionHandle unused, blocks, n_bits, n_bits_plus_7, num_bytes;
  TF_RETURN_IF_ERROR(c->WithValue(c->Dim(seed, 0), 2, &unused));
  int64_t bits;
  TF_RETURN_IF_ERROR(QuantizeBits(c, &bits));
  TF_RETURN_IF_ERROR(QuantizeNumBlocks(c, 3, &blocks));
  TF_RETURN_IF_ERROR(c->Multiply(c->Dim(mean, 0), bits, &n_bits));
  TF_RETURN_IF_ERROR(c->Add(n_bits, 7, &n_bits_plus_7));
  TF_RETURN_IF_ERROR(c->Divide(n_bits_plus_7, 8, /*evenly_divisible=*/false, &num_bytes));
  c->set_output(0, c->Vector(num_bytes));
  c->set_output(1, c->Vector(blocks));
  c->set_output(2, c->Vector(blocks));
  c->set_output(3, mean);
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("BlockQuantizeCompress")
    .Input("xs: N * float")
    .Input("pluses: N * float")
    .Input("bounds: int64")
    .Input("seed: int64")
    .Output("packed: uint8")
    .Output("scales: float")
    .Output("offsets: float")
    .Output("residuals: N * float")
    .Attr("N: int >= 1")
    .Attr("bits: int")
    .Attr("stochastic: bool = false")
    .SetShapeFn(CompressShape)
    .Doc(R"doc(
Blockwise bits-bit quantization of x, the concatenation of the N parts
x_k + plus_k (each flattened; an empty plus_k adds nothing: error feedback's
g + e summed on the way), and the error-feedback residual x - decode(packed) in
the same pass, one per part (in x_k's or plus_k's buffer when nothing else holds
it). Format: see tf_ops/quantize_ops.cc.

pluses: N float32 tensors, each with x_k's elements or none.
bounds: int64[B + 1], [0 = b_0 < ... < b_B = n]; every part starts at a bound.
seed: int64[2], (key, counter) of the stochastic draws (read only when
  stochastic; u_i depends on the seed and the element's index in x only).
packed: uint8[ceil(n * bits / 8)], code i at bits [i*bits, (i+1)*bits), LSB first.
scales: float32[B], (hi - lo) / L per block (NaN for a non-finite block).
offsets: float32[B], lo per block (NaN for a non-finite block).
residuals: N float32 tensors like xs, x - (offsets[b] + float(q_i) * scales[b]).
)doc");

REGISTER_OP("BlockQuantizeDecodeMean")
    .Input("packed: uint8")
    .Input("scales: float")
    .Input("offsets: float")
    .Input("bounds: int64")
    .Input("plus: float")
    .Output("y: float")
    .Attr("bits: int")
    .SetShapeFn(DecodeMeanShape)
    .Doc(R"doc(
Mean of m stacked BlockQuantizeCompress payloads, decoded in one pass without
materializing m dense tensors: packed uint8[m, ceil(n*bits/8)], scales and
offsets float32[m, B], n = bounds[-1]. In float32, per element i of block b:
acc = 0; for r = 0..m-1 in order: acc = acc + (offsets[r,b] + float(q_ri) * scales[r,b]);
y[i] = acc / m, then y[i] + plus[i] when plus has n elements (an empty plus
adds nothing). m = 1 is the plain decode.
)doc");

REGISTER_OP("BlockQuantizeRecodeMean")
    .Input("packed: uint8")
    .Input("scales: float")
    .Input("offsets: float")
    .Input("bounds: int64")
    .Input("plus: float")
    .Input("seed: int64")
    .Output("recoded: uint8")
    .Output("recoded_scales: float")
    .Output("recoded_offsets: float")
    .Output("residual: float")
    .Attr("bits: int")
    .Attr("stochastic: bool = false")
    .SetShapeFn(RecodeMeanShape)
    .Doc(R"doc(
BlockQuantizeCompress(BlockQuantizeDecodeMean(packed, scales, offsets, bounds,
plus), bounds, seed) in one pass, the same bits: the mean of m payloads (+ plus)
coded again in the same blocks, with its residual (in plus's buffer when
nothing else holds it), without writing the mean and reading it back. The
server of a two-way exchange: A = mean_i Q_i + e_s; D = Q(A); e_s = A - D.
)doc");

}  // namespace hvd_compress
