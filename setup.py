"""Builds hvd_compress and its TensorFlow custom ops.

    pip install --no-build-isolation .        # or -e . for development

`--no-build-isolation` is required: the ops are compiled against the
TensorFlow that is installed in the current environment, with the flags that
TensorFlow itself reports (tf.sysconfig), so they always match its ABI. The
library is named after that TensorFlow (hvd_compress/_tf_ops-tf<version>.so),
so environments with different TensorFlows can share one checkout, and it
reports the version it was compiled against (the HvdCompressBuildInfo op), so
hvd_compress/ops.py refuses to load one built for another version.

With HVD_COMPRESS_GPU=1 in the environment the same library also holds the ops'
GPU kernels: tf_ops/gpu/*.cu compiled with nvcc (found through CUDA_HOME or
PATH) and tf_ops/*.cu.cc (TensorFlow's GPU op kernels) with -DGOOGLE_CUDA=1,
linked with the CUDA runtime (static). Without it the build is CPU only.
"""
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = pathlib.Path(__file__).parent.resolve()
OPS_LIBRARY = "hvd_compress._tf_ops"
GPU_BUILD = os.environ.get("HVD_COMPRESS_GPU", "0") == "1"
CUDA_SOURCES = sorted((HERE / "tf_ops" / "gpu").glob("*.cu"))
CUDA_HEADERS = [*(HERE / "tf_ops" / "gpu").glob("*.h"), *(HERE / "tf_ops" / "gpu").glob("*.cuh"),
                *(HERE / "tf_ops").glob("*.h")]
GPU_OP_KERNELS = sorted((HERE / "tf_ops").glob("*.cu.cc"))  # host C++: TensorFlow's GPU kernels
# -fmad=false: no fused multiply-adds (the CPU build's -ffp-contract=off). Ampere and Hopper machine code,
# and Hopper PTX for later GPUs (as tests/gpu/kernels.py).
NVCC_FLAGS = ["-std=c++17", "-O3", "-fmad=false", "-Xcompiler", "-fPIC",
              "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=[sm_90,compute_90]"]


def tensorflow_build_config():
    """Compile and link flags and version of the installed TensorFlow."""
    try:
        import tensorflow as tf
    except ImportError as exc:
        raise SystemExit(
            "hvd_compress builds its ops against the installed TensorFlow, but "
            "`import tensorflow` failed. Install TensorFlow first (requirements.txt) and "
            "run `pip install --no-build-isolation .` so the build can see it."
        ) from exc
    return tf.__version__, tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()


def cuda_toolkit():
    """(nvcc, the CUDA root holding include/ and lib64/ or lib/): $CUDA_HOME, else nvcc on PATH and the root it
    reports (nvcc -dryrun's TOP: PATH may hold a wrapper script)."""
    home = os.environ.get("CUDA_HOME")
    nvcc = str(pathlib.Path(home) / "bin" / "nvcc") if home else shutil.which("nvcc")
    if not nvcc or not os.access(nvcc, os.X_OK):
        raise SystemExit(
            "HVD_COMPRESS_GPU=1 builds the ops' CUDA kernels, but nvcc was not found "
            f"({f'no {nvcc}' if home else 'not on PATH, and CUDA_HOME is not set'}). Install the CUDA "
            "toolkit and set CUDA_HOME (or put its bin/ on PATH), or build without HVD_COMPRESS_GPU for the CPU ops.")
    if home:
        return nvcc, pathlib.Path(home)
    dryrun = subprocess.run([nvcc, "-dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                            capture_output=True, text=True)
    top = re.search(r"^#\$ TOP=(.+)$", dryrun.stdout + dryrun.stderr, re.MULTILINE)
    return nvcc, pathlib.Path(top.group(1).strip()).resolve() if top else pathlib.Path(nvcc).resolve().parents[1]


def nvcc_compile(nvcc, sources, out_dir, depends, force=False):
    """Compiles each .cu source with nvcc into out_dir (unless force is off and its object is newer than it and
    `depends`); returns the objects."""
    objects = []
    for source in sources:
        obj = pathlib.Path(out_dir) / (source.name + ".o")
        newest = max(p.stat().st_mtime for p in [source, *depends])
        if force or not obj.exists() or obj.stat().st_mtime < newest:
            obj.parent.mkdir(parents=True, exist_ok=True)
            command = [nvcc, *NVCC_FLAGS, "-c", str(source), "-o", str(obj)]
            print(" ".join(command), flush=True)
            subprocess.run(command, check=True)
        objects.append(str(obj))
    return objects


class BuildTFOps(build_ext):
    """Compiles tf_ops/*.cc into hvd_compress/_tf_ops-tf<version>.so (no Python ABI tag), with
    objects in a build directory of that TensorFlow's own."""

    def get_ext_filename(self, fullname):
        filename = super().get_ext_filename(fullname)
        if fullname.split(".")[-1] == OPS_LIBRARY.split(".")[-1]:
            version = tensorflow_build_config()[0]
            return filename[: -len(sysconfig.get_config_var("EXT_SUFFIX"))] + f"-tf{version}.so"
        return filename

    def build_extension(self, ext):
        version, compile_flags, link_flags = tensorflow_build_config()
        # AVX + F16C: required by TensorFlow's own x86 wheels and used by Horovod's build.
        simd = ["-mavx", "-mf16c"] if platform.machine() in ("x86_64", "AMD64") else []
        # -ffp-contract=off: no fused multiply-adds, so kernels round as TensorFlow's own ops do.
        ext.extra_compile_args = ["-std=c++17", "-O3", "-ffp-contract=off", "-fvisibility=hidden", *simd,
                                  *compile_flags,
                                  f'-DHVD_COMPRESS_TF_VERSION="{version}"']
        ext.extra_link_args = link_flags
        flavor = "cuda" if GPU_BUILD else "cpu"
        # The CPU and the CUDA build write the same library, from objects of their own: switching rebuilds it
        # (build_ext compares file times only).
        stamp = pathlib.Path(self.build_temp) / f"tf{version}-library-flavor"
        self.force = self.force or not stamp.exists() or stamp.read_text() != flavor
        self.build_temp = os.path.join(self.build_temp, f"tf{version}" + ("-cuda" if GPU_BUILD else ""))
        if GPU_BUILD:
            self.add_gpu_kernels(ext)
        super().build_extension(ext)
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(flavor)

    def add_gpu_kernels(self, ext):
        """HVD_COMPRESS_GPU=1: the CUDA kernels (nvcc) and TensorFlow's GPU op kernels (-DGOOGLE_CUDA=1, the
        CPU sources' flags otherwise) as extra objects, and the CUDA runtime of that nvcc, linked statically and
        kept private to the library (--exclude-libs), beside the CPU kernels."""
        nvcc, cuda = cuda_toolkit()
        lib = next((cuda / d for d in ("lib64", "lib") if (cuda / d / "libcudart_static.a").exists()), None)
        if lib is None:
            raise SystemExit(f"HVD_COMPRESS_GPU=1: no libcudart_static.a in {cuda}/lib64 or {cuda}/lib "
                             f"(the CUDA root of {nvcc}); set CUDA_HOME to the toolkit's root.")
        gpu_temp = os.path.join(self.build_temp, "cuda")
        cuda_objects = nvcc_compile(nvcc, CUDA_SOURCES, gpu_temp, CUDA_HEADERS, force=self.force)
        kernel_objects = self.compiler.compile(
            [str(p.relative_to(HERE)) for p in GPU_OP_KERNELS], output_dir=gpu_temp,
            extra_postargs=[*ext.extra_compile_args, "-DGOOGLE_CUDA=1", f"-I{cuda / 'include'}"],
            depends=ext.depends + [str(p) for p in CUDA_HEADERS])
        # The static runtime goes with the objects, before TensorFlow's link flags: libtensorflow_framework exports
        # stubs of the CUDA runtime API (for its own CUDA 12 runtime), which would otherwise take every cuda* call.
        ext.extra_objects = [*cuda_objects, *kernel_objects, str(lib / "libcudart_static.a")]
        ext.depends = [*ext.depends, *map(str, CUDA_SOURCES + CUDA_HEADERS + GPU_OP_KERNELS)]
        ext.extra_link_args = ["-Wl,--exclude-libs,libcudart_static.a", *ext.extra_link_args, "-ldl", "-lrt",
                               "-lpthread"]


setup(
    name="hvd_compress",
    version="0.1.0",
    description="Communication-efficient data-parallel training for Horovod + TensorFlow/Keras",
    long_description=(HERE / "README.md").read_text() if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["hvd_compress", "hvd_compress.*"]),
    ext_modules=[
        Extension(
            OPS_LIBRARY,
            sources=sorted(str(p.relative_to(HERE)) for p in (HERE / "tf_ops").glob("*.cc")
                           if not p.name.endswith(".cu.cc")),
            depends=[str(p.relative_to(HERE)) for p in (HERE / "tf_ops").glob("*.h")],
            language="c++",
        )
    ],
    cmdclass={"build_ext": BuildTFOps},
    install_requires=["numpy", "absl-py"],
    zip_safe=False,
)
