// TensorFlow's headers that the ops' sources include, precompiled once per build
// (setup.py: BuildTFOps.precompile_tensorflow_headers) and force-included into every
// CPU source, so each source's compile no longer parses them anew. A source still
// includes what it uses itself: it compiles with or without this header.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/util/work_sharder.h"
