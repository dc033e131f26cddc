#!/usr/bin/env bash
# One-command set-up, safe to run again (a second run takes seconds):
#   Debian packages (Open MPI, compilers), a virtual environment, the pinned
#   stack, Horovod 0.28.1 built from its source with TensorFlow + Gloo + MPI
#   (patched: patches/horovod-0.28.1.patch), and hvd_compress with its compiled
#   ops. Each step says what it does; a failing step is named.
#
#   HVD_COMPRESS_STACK=current (default): TensorFlow 2.21, Keras 3 and tf_keras 2.21,
#                                         in .venv (requirements.txt)
#   HVD_COMPRESS_STACK=tf2.18:            TensorFlow 2.18, tf_keras 2.18, in .venv-tf2.18
#                                         (requirements-tf2.18.txt)
#   HVD_COMPRESS_VENV=path                another place for the virtual environment
set -euo pipefail
cd "$(dirname "$0")/.."

STACK=${HVD_COMPRESS_STACK:-current}
case "${STACK}" in
  current) REQUIREMENTS=requirements.txt; DEFAULT_VENV=.venv ;;
  tf2.18) REQUIREMENTS=requirements-tf2.18.txt; DEFAULT_VENV=.venv-tf2.18 ;;
  *) echo "!! HVD_COMPRESS_STACK=${STACK} is not a stack: use current (TensorFlow 2.21, Keras 3) or tf2.18." >&2
     exit 2 ;;
esac
VENV=${HVD_COMPRESS_VENV:-${DEFAULT_VENV}}
PYTHON=${PYTHON:-python3}
HOROVOD_VERSION=0.28.1
HOROVOD_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
HOROVOD_PATCH=patches/horovod-${HOROVOD_VERSION}.patch
STEP="start"
trap 'rc=$?; [ $rc = 0 ] || echo "!! hvd_compress set-up failed (exit $rc) during: ${STEP}. The output above says why." >&2' EXIT
step() { STEP="$*"; echo "==> $*"; }
# Runs a command with TensorFlow's start-up log noise filtered out of stderr (keeps its exit status).
tf_quiet() { TF_CPP_MIN_LOG_LEVEL=3 "$@" 2> >(grep -v -E "^(E0000|I0000|WARNING: All log|[0-9-]+ [0-9:.]+: [EI] |To enable)" >&2); }

step "Debian packages (openmpi-bin libopenmpi-dev g++ cmake patch iproute2)"
PACKAGES=(openmpi-bin libopenmpi-dev g++ cmake make patch iproute2)
missing=()
for p in "${PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

step "Python virtual environment in ${VENV} (stack: ${STACK})"
"$PYTHON" -c 'import sys; assert (3, 10) <= sys.version_info[:2] <= (3, 12), \
  f"TensorFlow 2.18-2.21 need Python 3.10-3.12, this is {sys.version.split()[0]}; set PYTHON=python3.11"'
[ -x "${VENV}/bin/python" ] || "$PYTHON" -m venv "${VENV}"
PY="${VENV}/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

step "Pinned Python packages (${REQUIREMENTS})"
"${PIP[@]}" --upgrade pip setuptools wheel
"${PIP[@]}" -r "${REQUIREMENTS}"

step "Horovod ${HOROVOD_VERSION} with TensorFlow, Gloo and MPI (built from source with ${HOROVOD_PATCH}, 3-6 minutes the first time)"
# Built against this environment's TensorFlow: rebuilt when its ops no longer load (another
# TensorFlow) or it was built with another version of the patch (the patch's SHA-256, kept
# beside the installed package).
PATCH_SHA256=$(sha256sum "${HOROVOD_PATCH}" | cut -d' ' -f1)
HOROVOD_CHECK='import horovod, horovod.tensorflow as hvd, pathlib, sys
stamp = pathlib.Path(horovod.__file__).parent / "hvd_compress_patch.sha256"
patched = stamp.exists() and stamp.read_text().strip() == sys.argv[2]
sys.exit(not (horovod.__version__ == sys.argv[1] and patched and hvd.gloo_built() and hvd.mpi_built()))'
if ! TF_CPP_MIN_LOG_LEVEL=3 "$PY" -c "${HOROVOD_CHECK}" "${HOROVOD_VERSION}" "${PATCH_SHA256}" >/dev/null 2>&1; then
  SRC=$(mktemp -d)
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
    -d "${SRC}" "horovod==${HOROVOD_VERSION}"
  echo "${HOROVOD_SHA256}  ${SRC}/horovod-${HOROVOD_VERSION}.tar.gz" | sha256sum -c --quiet - || {
    echo "!! horovod-${HOROVOD_VERSION}.tar.gz does not have the pinned checksum ${HOROVOD_SHA256}." >&2; exit 1; }
  tar -xzf "${SRC}/horovod-${HOROVOD_VERSION}.tar.gz" -C "${SRC}"
  # The patch: XLA includes only in GPU builds (TensorFlow 2.19+ moved them), Horovod's Keras
  # callbacks take the backend of tf.keras (tf_keras), not of `import keras` (Keras 3), and Gloo's
  # alltoall and allgather post their receives before their sends (both directions at once).
  patch -d "${SRC}/horovod-${HOROVOD_VERSION}" -p1 --forward --quiet < "${HOROVOD_PATCH}" || {
    echo "!! ${HOROVOD_PATCH} does not apply to horovod ${HOROVOD_VERSION}'s source in ${SRC}." >&2; exit 1; }
  # Gloo's CMakeLists predates CMake 4; this keeps a newer cmake working too.
  CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    "${PIP[@]}" --no-build-isolation --no-cache-dir --force-reinstall --no-deps "${SRC}/horovod-${HOROVOD_VERSION}"
  "$PY" -c 'import pathlib, sys, horovod
(pathlib.Path(horovod.__file__).parent / "hvd_compress_patch.sha256").write_text(sys.argv[1])' "${PATCH_SHA256}"
  rm -rf "${SRC}"
fi

step "hvd_compress and its TensorFlow ops (tf_ops/ -> hvd_compress/_tf_ops-tf<version>.so)"
# The editable install is made once; the ops are rebuilt in place when a
# source or the TensorFlow version changed (setup.py's build_ext decides).
if ! "$PY" -m pip show -q hvd_compress >/dev/null 2>&1; then
  "${PIP[@]}" --no-build-isolation --no-deps -e .
fi
tf_quiet "$PY" setup.py -q build_ext --inplace

# Earlier set-ups forced tf_keras on every Python of the environment; the user's Keras decides now.
rm -f "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/hvd_compress_legacy_keras.pth"

step "Check: the ops load, Horovod has Gloo and MPI"
tf_quiet "$PY" -c '
import sys, tensorflow as tf, tf_keras, hvd_compress, hvd_compress.ops as ops, horovod, horovod.tensorflow as hvd
import keras
ops.library()
print(f"    TensorFlow {tf.__version__}, Keras {keras.__version__}, tf_keras {tf_keras.__version__}, "
      f"Horovod {horovod.__version__} (Gloo {hvd.gloo_built()}, MPI {hvd.mpi_built()}), ops {ops.LIBRARY_PATH}")
sys.exit(not (hvd.gloo_built() and hvd.mpi_built()))'
echo "==> set-up complete (${VENV})"
