// Op registrations for the 16-bit exchange (Compression.fp16 in
// hvd_compress.DistributedOptimizer; hvd_compress/exchange.py, HalfAllreduce).
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "shape_fns.h"

namespace hvd_compress {

using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("HalfPack")
    .Input("xs: T")
    .Output("packed: half")
    .Attr("T: list({float, half, bfloat16})")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(TotalNumElements(c, 0, c->num_inputs())));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The tensors xs, flattened and concatenated in order, rounded to float16 (round
to nearest even, as NumPy's astype; beyond +-65504 becomes +-Inf, NaN stays
NaN): one fused buffer, written once.
)doc");

REGISTER_OP("HalfMean")
    .Input("x: half")
    .Output("mean: half")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      c->set_output(0, c->Vector(c->Dim(x, 1)));
      return absl::OkStatus();
    })
    .Doc(R"doc(
x: [count, m] float16. The mean over rows, summed in float32 in row order,
divided by count in float32, rounded to float16 once.
)doc");

REGISTER_OP("HalfUnpack")
    .Input("packed: N * half")
    .Attr("N: int >= 1")
    .Output("ys: T")
    .Attr("sizes: list(int) >= 1")
    .Attr("T: list({float, half, bfloat16}) >= 1")
    .SetShapeFn(VectorsOfSizes)
    .Doc(R"doc(
Inverse of HalfPack: the float16 vectors `packed`, taken as one vector of
sum(sizes) values in order (e.g. the pieces a collective brought back), cut into
vectors of `sizes` elements, each converted to its dtype in T (float16 to float32 is exact;
to bfloat16 rounds to nearest even).
)doc");

}  // namespace hvd_compress
