"""The GPU kernels of tf_ops/gpu/: compiled with nvcc wherever it is installed (this machine, CI), and run against
the NumPy references where a CUDA GPU and CuPy are (tests/gpu/harness.py; skipped elsewhere, with the command)."""
import ctypes
import subprocess
import sys

import pytest

import kernels

HARNESS = kernels.REPO / "tests" / "gpu" / "harness.py"


def gpu_available():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.skipif(kernels.nvcc() is None, reason="no nvcc here: the GPU kernels are not compiled "
                    "(put the CUDA toolkit's bin on PATH or set CUDA_HOME)")
def test_the_gpu_kernels_compile_with_nvcc_and_export_every_launcher(tmp_path):
    # One architecture and unoptimized host code: whether every source compiles and every launcher links does
    # not depend on either, and each costs compile time (kernels.build()'s default, the harness's library, is
    # ARCHS at -O3).
    library = kernels.build(tmp_path / "libhc_gpu_kernels.so", archs=["-gencode", "arch=compute_90,code=sm_90"],
                            host_optimization="-O0")
    loaded = ctypes.CDLL(str(library))  # the CUDA runtime is linked in: loads without a GPU
    declared = kernels.declarations()
    assert len(declared) >= 14, sorted(declared)
    missing = [name for name in declared if not hasattr(loaded, name)]
    assert not missing, f"declared in launchers.h but not defined: {missing}"


@pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU (or no CuPy) here: on a GPU machine run "
                    "`python tests/gpu/harness.py`; docs/gpu.md has the last run's table")
def test_the_gpu_kernels_match_numpy_on_this_gpu(tmp_path):
    subprocess.run([sys.executable, str(HARNESS), f"--out={tmp_path / 'gpu_kernels.json'}", "--n=4194304",
                    "--repeats=3"], check=True, timeout=900)
