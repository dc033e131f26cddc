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

The sources compile side by side, one job per core, each only when its object is
older than it, a header of tf_ops/ or the flags; TensorFlow's headers are
precompiled once (tf_ops/tensorflow_headers.h) and included as system headers, so
their own warnings stay out of the log and ours (-Wall) show.
"""
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = pathlib.Path(__file__).parent.resolve()
OPS_LIBRARY = "hvd_compress._tf_ops"
#: Where the ops' objects live, whichever command builds them (pip's editable install or build_ext --inplace).
OPS_BUILD_DIR = HERE / "build" / "ops"
#: TensorFlow's headers that the ops include, compiled once per build into a precompiled header.
TENSORFLOW_HEADERS = HERE / "tf_ops" / "tensorflow_headers.h"
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


def system_includes(flags):
    """TensorFlow's compile flags with its include directories as system ones (-isystem): the hundreds of
    -Wdeprecated-declarations its own headers raise are not ours to read, and warnings in our sources still show."""
    out = []
    for flag in flags:
        out += ["-isystem", flag[2:]] if flag.startswith("-I") else [flag]
    return out


def run_compiler(command, what):
    """Runs one compiler command; prints it with its output (one block, whatever runs beside it); on failure
    stops the build with the command, so the log's last lines say what failed."""
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print("$ " + " ".join(command) + ("\n" + done.stdout if done.stdout else ""), flush=True)
    if done.returncode:
        sys.exit(f"!! compiling {what} failed (exit {done.returncode}):\n$ {' '.join(command)}")


def stale(target, inputs):
    """True when `target` is missing or older than any of `inputs`."""
    target = pathlib.Path(target)
    return not target.exists() or target.stat().st_mtime < max(pathlib.Path(p).stat().st_mtime for p in inputs)


def flags_stamp(directory, flags):
    """A file in `directory` holding `flags`, rewritten (so newer than every object) only when they change."""
    stamp = pathlib.Path(directory) / "flags"
    text = "\n".join(flags)
    if not stamp.exists() or stamp.read_text() != text:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(text)
    return stamp


def nvcc_compile(nvcc, sources, out_dir, depends, force=False):
    """Compiles each .cu source with nvcc into out_dir (unless force is off and its object is newer than it and
    `depends`); returns the objects."""
    objects = []
    for source in sources:
        obj = pathlib.Path(out_dir) / (source.name + ".o")
        newest = max(p.stat().st_mtime for p in [source, *depends])
        if force or not obj.exists() or obj.stat().st_mtime < newest:
            obj.parent.mkdir(parents=True, exist_ok=True)
            run_compiler([nvcc, *NVCC_FLAGS, "-c", str(source), "-o", str(obj)], source.name)
        objects.append(str(obj))
    return objects


class BuildTFOps(build_ext):
    """Compiles tf_ops/*.cc into hvd_compress/_tf_ops-tf<version>.so (no Python ABI tag), with
    objects in a build directory of that TensorFlow's own (under build/ops, for every command that builds)."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = str(OPS_BUILD_DIR)
        self.parallel = None  # one extension: its sources run side by side instead (compile_in_parallel)

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
        # -fno-math-errno: sqrtf never sets errno, so the loops that take square roots vectorize (the results are
        # the same: IEEE square roots either way).
        # -g0: no debug information (Python's own flags ask for it; it doubles the compile and the library).
        ext.extra_compile_args = ["-std=c++17", "-O3", "-g0", "-ffp-contract=off", "-fno-math-errno",
                                  "-fvisibility=hidden", *simd,
                                  *system_includes(compile_flags),
                                  f'-DHVD_COMPRESS_TF_VERSION="{version}"']
        ext.extra_link_args = link_flags
        flavor = "cuda" if GPU_BUILD else "cpu"
        # The CPU and the CUDA build write the same library, from objects of their own: switching rebuilds it
        # (build_ext compares file times only).
        stamp = pathlib.Path(self.build_temp) / f"tf{version}-library-flavor"
        self.force = self.force or not stamp.exists() or stamp.read_text() != flavor
        self.build_temp = os.path.join(self.build_temp, f"tf{version}" + ("-cuda" if GPU_BUILD else ""))
        self.compiler.compile = self.compile_in_parallel
        flags = str(flags_stamp(self.build_temp, [*self.cxx(), *ext.extra_compile_args]))
        ext.depends = [*ext.depends, flags]
        if GPU_BUILD:
            self.add_gpu_kernels(ext)
        precompiled = self.precompile_tensorflow_headers(ext.extra_compile_args, flags)
        ext.extra_compile_args = [*ext.extra_compile_args, "-include", precompiled[: -len(".gch")]]
        ext.depends = [*ext.depends, precompiled]
        super().build_extension(ext)
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(flavor)

    def cxx(self):
        """The C++ compiler's command as build_ext calls it for a shared library's sources (with Python's flags)."""
        return getattr(self.compiler, "compiler_so_cxx", self.compiler.compiler_so)

    def precompile_tensorflow_headers(self, compile_args, flags_stamp):
        """tf_ops/tensorflow_headers.h compiled with the sources' flags into <build>/pch/tensorflow_headers.h.gch
        (when stale); the .gch's path. gcc takes it for `-include <build>/pch/tensorflow_headers.h`, which halves
        each source's compile (the headers are most of it), and reads the header itself where the flags differ."""
        header = pathlib.Path(self.build_temp) / "pch" / TENSORFLOW_HEADERS.name
        precompiled = header.with_name(header.name + ".gch")
        if self.force or stale(precompiled, [TENSORFLOW_HEADERS, flags_stamp]):
            header.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(TENSORFLOW_HEADERS, header)
            run_compiler([*self.cxx(), *compile_args, "-x", "c++-header", str(header),
                          "-o", str(precompiled)], TENSORFLOW_HEADERS.name)
        return str(precompiled)

    def compile_in_parallel(self, sources, output_dir=None, macros=None, include_dirs=None, debug=False,
                            extra_preargs=None, extra_postargs=None, depends=None):
        """The compiler's compile(), but each source only when its object is older than it or than any of
        `depends` (our headers, the flags' stamp, the precompiled header), and the sources side by side, one
        job per core. Returns every object, as compile() does."""
        compiler = self.compiler
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
        todo = [obj for obj in objects if self.force or stale(obj, [build[obj][0], *(depends or [])])]

        def compile_one(obj):
            source = build[obj][0]
            run_compiler([*self.cxx(), *cc_args, source, "-o", obj, *extra_postargs], source)

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(compile_one, todo))
        return objects

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
