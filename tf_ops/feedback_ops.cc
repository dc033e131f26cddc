// Op registration for the worker's error feedback with momentum in front of the
// compressor (dist-EF-SGD, Zheng et al. 2019; sketched SGD, Ivkin et al. 2019):
// one pass where TensorFlow's elementwise ops took six.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace hvd_compress {

using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("MomentumErrorFeed")
    .Input("g: float")
    .Input("m: float")
    .Input("e: float")
    .Input("lr: float")
    .Input("momentum: float")
    .Input("residual_scale: float")
    .Output("m_new: float")
    .Output("a: float")
    .Attr("nesterov: bool")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle shape, unused;
      TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(1), &shape));
      TF_RETURN_IF_ERROR(c->Merge(shape, c->input(2), &shape));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(5), 0, &unused));
      c->set_output(0, shape);
      c->set_output(1, shape);
      return absl::OkStatus();
    })
    .Doc(R"doc(
m_new = momentum * m + g; p = momentum * m_new + g if nesterov else m_new;
a = lr * p + residual_scale * e (residual_scale = lr / the previous step's lr:
the residual, kept in learning-rate-scaled units, follows a rate change). Each
product and sum rounded to float32 in this order, as the same TensorFlow ops
would (no fused multiply-add), elementwise in one pass; a scale of 1 leaves e
exact.
)doc");

}  // namespace hvd_compress
