"""The GPU kernels of tf_ops/gpu/ as a shared library for the standalone harness: built with nvcc (`build`) and
called through ctypes (`Kernels`), with argument types read from tf_ops/gpu/launchers.h, the one declaration of
the launchers. Needs no TensorFlow: the GPU machine has CUDA, CuPy and NumPy only."""
import ctypes
import os
import pathlib
import re
import shutil
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted((REPO / "tf_ops" / "gpu").glob("*.cu"))
LAUNCHERS = REPO / "tf_ops" / "gpu" / "launchers.h"
LIBRARY = REPO / "build" / "gpu" / "libhc_gpu_kernels.so"
#: -fmad=false: no fused multiply-adds, so products and sums round as the CPU kernels' (g++ -ffp-contract=off).
NVCC_FLAGS = ["-std=c++17", "-fmad=false", "-Xcompiler", "-fPIC", "-shared"]
#: Ampere and Hopper machine code, and Hopper PTX for later GPUs.
ARCHS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=[sm_90,compute_90]"]

C_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "size_t": ctypes.c_size_t, "float": ctypes.c_float,
           "hc_stream": ctypes.c_void_p}


def nvcc():
    """nvcc's path (PATH, or $CUDA_HOME/bin), or None."""
    found = shutil.which("nvcc")
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not found and home and (pathlib.Path(home) / "bin" / "nvcc").exists():
        found = str(pathlib.Path(home) / "bin" / "nvcc")
    return found


def build(out=LIBRARY, archs=None, host_optimization="-O3"):
    """Compiles tf_ops/gpu/*.cu into the shared library `out` (rebuilt when a source or header is newer), for
    `archs` (nvcc's -gencode options; ARCHS by default). host_optimization: nvcc's -O, which applies to the host
    code only (the launchers); the device code is optimized either way."""
    out = pathlib.Path(out)
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("nvcc not found: put the CUDA toolkit's bin on PATH or set CUDA_HOME.")
    inputs = SOURCES + list((REPO / "tf_ops" / "gpu").glob("*.h")) + list((REPO / "tf_ops" / "gpu").glob("*.cuh")) \
        + list((REPO / "tf_ops").glob("*.h"))  # cores.h, sketch_hash.h, ...
    if out.exists() and out.stat().st_mtime > max(p.stat().st_mtime for p in inputs):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([compiler, *NVCC_FLAGS, host_optimization, *(archs or ARCHS), *map(str, SOURCES), "-o", str(out)],
                   check=True)
    return out


def declarations():
    """{name: (result type, [argument types], index of the hc_stream argument or None)} of every launcher in
    launchers.h."""
    text = re.sub(r"//[^\n]*", "", LAUNCHERS.read_text())
    found = {}
    for result, name, args in re.findall(r"\b(int|size_t)\s+(hc_\w+)\s*\(([^)]*)\)\s*;", text):
        types, stream_at = [], None
        for at, arg in enumerate(a.strip() for a in args.split(",")):
            kind = arg.rsplit(None, 1)[0].replace("const ", "")
            stream_at = at if kind == "hc_stream" else stream_at
            types.append(ctypes.c_void_p if "*" in arg else C_TYPES[kind])
        found[name] = (C_TYPES[result], types, stream_at)
    return found


class Kernels:
    """The library's launchers by name: `kernels.hc_sign_pack_f32(...)` takes CuPy arrays (device pointers),
    NumPy arrays (host pointers), ints and floats, and raises on a CUDA error. A stream given as None is CuPy's
    current stream (`current_stream`), as TensorFlow passes its own."""

    def __init__(self, path, current_stream=lambda: None):
        self.lib = ctypes.CDLL(str(path))
        self.signatures = declarations()
        self.current_stream = current_stream

    def __getattr__(self, name):
        result, types, stream_at = self.signatures[name]
        function = getattr(self.lib, name)
        function.restype, function.argtypes = result, types

        def call(*args):
            if len(args) != len(types):
                raise TypeError(f"{name} takes {len(types)} arguments, got {len(args)}")
            if stream_at is not None and args[stream_at] is None:
                args = args[:stream_at] + (self.current_stream(),) + args[stream_at + 1:]
            value = function(*(pointer(a) if t is ctypes.c_void_p else a for a, t in zip(args, types)))
            if result is ctypes.c_int and value != 0:
                raise RuntimeError(f"{name} failed: CUDA error {value}")
            return value
        return call


def pointer(a):
    """A device (CuPy) or host (NumPy) array's address; None stays NULL."""
    if a is None:
        return None
    if hasattr(a, "data") and hasattr(a.data, "ptr"):
        return a.data.ptr
    if hasattr(a, "ctypes"):
        return a.ctypes.data
    return a
