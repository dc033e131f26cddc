// Op registration for Stochastic Gradient Push's share (hvd_compress/gossip.py, PushSum): a rank's PushSum
// mass split into `parts` equal shares, computed in one pass over the model where TensorFlow's elementwise ops,
// concatenation and division took four or five.
#include "op_checks.h"
#include "shape_fns.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace hvd_compress {

using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("PushSumShare")
    .Input("values: N * float")
    .Input("before: M * float")
    .Input("weight: float")
    .Output("share: float")
    .Attr("N: int >= 1")
    .Attr("M: int >= 0")
    .Attr("parts: int >= 2")
    .SetShapeFn([](InferenceContext* c) {
      int n = 0, m = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      TF_RETURN_IF_ERROR(c->GetAttr("M", &m));
      TF_RETURN_IF_ERROR(checks::PushSumBeforeCount(n, m));
      ShapeHandle unused;
      for (int i = 0; i < m; ++i) TF_RETURN_IF_ERROR(c->Merge(c->input(i), c->input(n + i), &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(n + m), 0, &unused));
      const int64_t total = TotalNumElements(c, 0, n);
      c->set_output(0, c->Vector(total == InferenceContext::kUnknownDim ? total : total + 1));
      return absl::OkStatus();
    })
    .Doc(R"doc(
One of `parts` equal shares of a rank's PushSum mass (x, w): the float32 vector
[x / parts, w / parts] of sum(sizes of values) + 1 elements, x the numerator
over values, flattened and concatenated in order:
  M == 0:  x = values * w                (SGP without overlap, where w is 1)
  M == N:  x = values - (1 - w) * before
with values the variables after the wrapped optimizer's step, before the same
variables before it (of the same shapes), w = weight (a scalar) and
parts = the out-peers + 1. Each product, difference and quotient rounded to
float32 in this order, as the same TensorFlow ops would round them (no fused
multiply-add; a division by parts, not a product by its reciprocal).
)doc");

}  // namespace hvd_compress
