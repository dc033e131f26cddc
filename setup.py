"""Builds hvd_compress and its TensorFlow custom ops.

    pip install --no-build-isolation .        # or -e . for development

`--no-build-isolation` is required: the ops are compiled against the
TensorFlow that is installed in the current environment, with the flags that
TensorFlow itself reports (tf.sysconfig), so they always match its ABI. The
library is named after that TensorFlow (hvd_compress/_tf_ops-tf<version>.so),
so environments with different TensorFlows can share one checkout, and it
reports the version it was compiled against (the HvdCompressBuildInfo op), so
hvd_compress/ops.py refuses to load one built for another version.
"""
import os
import pathlib
import platform
import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = pathlib.Path(__file__).parent.resolve()
OPS_LIBRARY = "hvd_compress._tf_ops"


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
        self.build_temp = os.path.join(self.build_temp, f"tf{version}")
        super().build_extension(ext)


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
