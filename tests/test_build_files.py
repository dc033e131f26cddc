"""The Bazel BUILD and setup.py build the same op sources."""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_bazel_build_takes_every_op_source_setup_py_builds():
    """Both take tf_ops/*.cc and *.h (the CPU ones): Bazel by its glob, setup.py by its own."""
    build = (ROOT / "BUILD").read_text()
    assert 'srcs = glob(["tf_ops/*.cc", "tf_ops/*.h"], exclude = ["tf_ops/*.cu.cc"])' in build
    setup = (ROOT / "setup.py").read_text()
    assert '(HERE / "tf_ops").glob("*.cc")' in setup and '(HERE / "tf_ops").glob("*.h")' in setup
    assert 'load("//tensorflow:tensorflow.bzl", "tf_custom_op_library")' in build
    assert 'name = "_tf_ops.so"' in build


def test_setup_builds_the_library_the_package_loads():
    import tensorflow as tf
    from hvd_compress import ops

    assert ops.LIBRARY_PATH.name == f"_tf_ops-tf{tf.__version__}.so"  # one per TensorFlow
    assert ops.LIBRARY_PATH.exists()
    assert '"hvd_compress._tf_ops"' in (ROOT / "setup.py").read_text()


def test_horovod_is_built_with_this_checkouts_patch():
    """scripts/setup.sh stamps the SHA-256 of the patches it applied, in order, beside the Horovod it built (and
    rebuilds when they change): the CPU build's patch, and the GPU build's on top where Horovod has NCCL (make setup
    GPU=1); with the patch, Gloo posts receives first and Compression.fp16 sends 2 MiB pieces
    (exchange.HALF_CHUNK_BYTES)."""
    import hashlib

    import horovod
    import horovod.tensorflow as hvd
    from hvd_compress import exchange

    stamp = pathlib.Path(horovod.__file__).parent / "hvd_compress_patch.sha256"
    patches = ["horovod-0.28.1.patch"] + (["horovod-0.28.1-gpu.patch"] if hvd.nccl_built() else [])
    applied = b"".join((ROOT / "patches" / name).read_bytes() for name in patches)
    assert stamp.read_text().strip() == hashlib.sha256(applied).hexdigest()
    assert horovod.gloo_receives_first is True
    assert exchange.HALF_CHUNK_BYTES == 2 << 20


def test_a_horovod_without_the_patch_gets_small_fp16_pieces():
    """Stock Gloo sends before it receives, so large pieces take turns on a slow link (docs/architecture.md,
    "Compression.fp16"): without the patch's flag the exchange falls back to 512 KiB pieces."""
    import subprocess
    import sys

    code = ("import horovod; del horovod.gloo_receives_first; "
            "from hvd_compress import exchange; print(exchange.HALF_CHUNK_BYTES)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) == 512 << 10
