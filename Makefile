# hvd_compress: `make demo` sets everything up and runs the main job; `make test` runs the tests.
# STACK=current (TensorFlow 2.21, Keras 3, tf_keras; .venv) or STACK=tf2.18 (.venv-tf2.18).
# GPU=1: the current stack with Horovod built with NCCL and CUDA as well (.venv-gpu; compiles without a GPU).
STACK ?= current
GPU ?= 0
VENV ?= $(if $(filter tf2.18,$(STACK)),.venv-tf2.18,$(if $(filter 1,$(GPU)),.venv-gpu,.venv))
NP ?= 2
PY := $(VENV)/bin/python
HOROVODRUN := $(VENV)/bin/horovodrun
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: setup demo text transformer test test-full bench wire tta gpu-kernels gpu-harness clean

setup:
	HVD_COMPRESS_STACK=$(STACK) HVD_COMPRESS_GPU=$(GPU) HVD_COMPRESS_VENV=$(VENV) ./scripts/setup.sh

demo: setup
	PYTHONPATH=examples $(HOROVODRUN) -np $(NP) -H localhost:$(NP) --gloo \
		$(PY) examples/keras_digits.py --compression onebit

# A character-level model with an Embedding under mixed_float16: onebit two-way, then Horovod's fp16.
text: setup
	for method in onebit horovod_fp16; do PYTHONPATH=examples $(HOROVODRUN) -np $(NP) -H localhost:$(NP) --gloo \
		$(PY) examples/keras_text.py --method $$method; done

# A causal transformer under AdamW and mixed_float16: 1-bit Adam, then Horovod's fp16.
transformer: setup
	for method in onebit horovod_fp16; do PYTHONPATH=examples $(HOROVODRUN) -np $(NP) -H localhost:$(NP) --gloo \
		$(PY) examples/keras_transformer.py --method $$method; done

test: setup
	$(PY) -m pytest

# The full matrix: also the cases marked `full` (another Keras, world size or layout of a test the default run has).
test-full: setup
	$(PY) -m pytest --full

bench: setup
	$(PY) benchmarks/ops_throughput.py
	$(PY) benchmarks/bytes_per_step.py
	$(PY) benchmarks/straggler.py
	$(PY) benchmarks/accordion.py
	$(PY) benchmarks/convergence.py
	$(PY) benchmarks/convergence.py --task=transformer
	$(PY) benchmarks/overhead.py

# Shaped links between network namespaces (needs root): tables at 100 Mbit/s, 1 and 10 Gbit/s.
wire: setup
	$(PY) benchmarks/wire.py

# The same shaped links (needs root): seconds to a sustained test accuracy per method, at 1 and 10 Gbit/s
# (the transformer under AdamW; --task=digits: the wide MLP under SGD).
tta: setup
	$(PY) benchmarks/time_to_accuracy.py

# The GPU kernels (tf_ops/gpu/) as a standalone library, with nvcc; on a machine with a CUDA GPU and CuPy,
# the harness checks them against the NumPy references and times them (docs/gpu.md).
gpu-kernels:
	$(PY) -c "import sys; sys.path.insert(0, 'tests/gpu'); import kernels; print(kernels.build())"

gpu-harness:
	python3 tests/gpu/harness.py

clean:
	rm -rf build hvd_compress/_tf_ops*.so
