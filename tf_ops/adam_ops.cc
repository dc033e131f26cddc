// Op registration for the worker's and the receiving side of Adam with its variance frozen after the warm-up
// (Tang et al. 2021, 1-bit Adam; hvd_compress/adam.py): one pass each where TensorFlow's elementwise ops took five
// to eight.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace hvd_compress {

using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

namespace {

// `count` inputs of one shape, the rest scalars; `outputs` outputs of that shape.
absl::Status SameShapes(InferenceContext* c, int count, int outputs) {
  ShapeHandle shape = c->input(0), unused;
  for (int i = 1; i < count; ++i) TF_RETURN_IF_ERROR(c->Merge(shape, c->input(i), &shape));
  for (int i = count; i < c->num_inputs(); ++i) TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
  for (int i = 0; i < outputs; ++i) c->set_output(i, shape);
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("AdamMomentumFeed")
    .Input("g: float")
    .Input("m: float")
    .Input("v: float")
    .Input("e: float")
    .Input("one_minus_beta_1: float")
    .Input("epsilon: float")
    .Input("bound: float")
    .Output("a: float")
    .SetShapeFn([](InferenceContext* c) { return SameShapes(c, 4, 1); })
    .Doc(R"doc(
The worker's side of 1-bit Adam after its warm-up:
a = clamp((m + (g - m) * one_minus_beta_1) / (sqrt(v) + epsilon), -bound, bound) + e, this rank's Adam momentum over
the frozen d = sqrt(v) + epsilon, no larger than bound, plus its residual (NaN stays NaN). Each operation rounded to
float32 in this order, as the same TensorFlow ops would (no fused multiply-add), elementwise in one pass.
)doc");

REGISTER_OP("AdamFrozenStep")
    .Input("mean: float")
    .Input("m: float")
    .Input("v: float")
    .Input("alpha: float")
    .Input("one_minus_beta_1: float")
    .Input("epsilon: float")
    .Input("max_step: float")
    .Output("m_new: float")
    .Output("delta: float")
    .Attr("momentum_exchanged: bool")
    .SetShapeFn([](InferenceContext* c) { return SameShapes(c, 3, 2); })
    .Doc(R"doc(
The receiving side of Adam with the variance v frozen, from the exchanged mean, with d = sqrt(v) + epsilon:
momentum_exchanged (1-bit Adam, the mean is of m / d): m_new = mean * d, delta = mean * alpha; else (the mean is a
gradient): m_new = m + (mean - m) * one_minus_beta_1, delta = (m_new * alpha) / d; then delta is clamped to
[-max_step, max_step] (NaN stays NaN). delta is what the variable loses.
Rounded as the same TensorFlow ops would, elementwise in one pass.
)doc");

REGISTER_OP("ResourceDecayAndSubtract")
    .Input("variable: resource")
    .Input("delta: float")
    .Input("decay: float")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The step of a variable whose update rule hvd_compress applies: variable = (variable - variable * decay) - delta, in
place, for a float32 variable and a delta of as many elements (decay: AdamW's weight decay times the learning rate,
0 for none). The bits of Keras's decoupled weight decay (x - x * (wd lr), as TensorFlow computes x - x * wd * lr)
and an assign_sub of delta, in one pass over the variable instead of five streams. Copies the variable's buffer
first only where a read still holds it.
)doc");

}  // namespace hvd_compress
