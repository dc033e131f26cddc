"""The Bazel BUILD and setup.py build the same op sources; the Horovod built is patched as setup.sh says."""
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


def test_the_patched_loop_rests_while_its_rank_computes():
    """Horovod's background loop cycles (and coordinates with every rank) every HOROVOD_CYCLE_TIME, 1 ms, even
    while nothing is queued; the patch lets it rest until a collective is queued, at most HOROVOD_IDLE_CYCLE_TIME
    (20 ms where unset) per cycle, once 10 cycles have found nothing (docs/keras_features.md, "Performance notes").
    2 ranks compute 0.25 s between collectives, 4 times: rank 0's timeline marks its cycles, up to 1,000 in a
    second of stock Horovod's loop (HOROVOD_IDLE_CYCLE_TIME=0), far fewer resting, most of the computing time
    spent between cycles 15 ms or more apart; every collective's sum is right either way."""
    from hvdrun import run_ranks

    cycles, rested = {}, {}
    for idle_ms in (None, "0"):
        ranks = run_ranks("resting_loop.py", "--compute_s=0.25", "--steps=4", np=2, timeout=120,
                          env={} if idle_ms is None else {"HOROVOD_IDLE_CYCLE_TIME": idle_ms})
        assert all(r["sums"] == [2.0, 0.0, 2.0, 4.0, 6.0] for r in ranks), ranks
        cycles[idle_ms] = ranks[0]["cycles"] / ranks[0]["seconds"]
        rested[idle_ms] = ranks[0]["rested_s"] / ranks[0]["seconds"]
    # resting: a cycle in 20 ms, plus each step's collective and the 10 quiet ones before a rest (about 100 a
    # second here, 2 AMD EPYC cores); stock: one a ms, fewer where the computing ranks, or other jobs on the
    # machine, keep the loop from its core (177 a second beside the rest of the suite): that is not rest, and
    # seldom lasts 15 ms
    print(f"cycles a second while computing: {cycles[None]:.0f} resting, {cycles['0']:.0f} stock; share of the "
          f"time between cycles 15 ms or more apart: {rested[None]:.2f} resting, {rested['0']:.2f} stock")
    assert cycles[None] < 150 and cycles["0"] > cycles[None]
    assert rested[None] > 0.5 and rested["0"] < rested[None] / 2
