#!/usr/bin/env bash
# One-command set-up, safe to run again (a second run takes seconds):
#   Debian packages (Open MPI, compilers), a virtual environment (.venv, or
#   $HVD_COMPRESS_VENV), the pinned stack from requirements.txt, Horovod 0.28.1
#   built from source with TensorFlow + Gloo + MPI, and hvd_compress with its
#   compiled ops. Each step says what it does; a failing step is named.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${HVD_COMPRESS_VENV:-.venv}
PYTHON=${PYTHON:-python3}
HOROVOD_VERSION=0.28.1
STEP="start"
trap 'rc=$?; [ $rc = 0 ] || echo "!! hvd_compress set-up failed (exit $rc) during: ${STEP}. The output above says why." >&2' EXIT
step() { STEP="$*"; echo "==> $*"; }
# Runs a command with TensorFlow's start-up log noise filtered out of stderr (keeps its exit status).
tf_quiet() { TF_CPP_MIN_LOG_LEVEL=3 "$@" 2> >(grep -v -E "^(E0000|WARNING: All log|[0-9-]+ [0-9:.]+: [EI] |To enable)" >&2); }

step "Debian packages (openmpi-bin libopenmpi-dev g++ cmake iproute2)"
PACKAGES=(openmpi-bin libopenmpi-dev g++ cmake make iproute2)
missing=()
for p in "${PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

step "Python virtual environment in ${VENV}"
"$PYTHON" -c 'import sys; assert (3, 9) <= sys.version_info[:2] <= (3, 12), \
  f"TensorFlow 2.18 needs Python 3.9-3.12, this is {sys.version.split()[0]}; set PYTHON=python3.11"'
[ -x "${VENV}/bin/python" ] || "$PYTHON" -m venv "${VENV}"
PY="${VENV}/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

step "Pinned Python packages (requirements.txt: TensorFlow 2.18.1, tf_keras, test tools)"
"${PIP[@]}" --upgrade pip setuptools wheel
"${PIP[@]}" -r requirements.txt

step "Horovod ${HOROVOD_VERSION} with TensorFlow, Gloo and MPI (built from source, 4-6 minutes the first time)"
HOROVOD_CHECK='import horovod, horovod.tensorflow as hvd, sys; sys.exit(not (horovod.__version__ == sys.argv[1] and hvd.gloo_built() and hvd.mpi_built()))'
if ! TF_CPP_MIN_LOG_LEVEL=3 "$PY" -c "${HOROVOD_CHECK}" "${HOROVOD_VERSION}" >/dev/null 2>&1; then
  # Gloo's CMakeLists predates CMake 4; this keeps a newer cmake working too.
  CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    "${PIP[@]}" --no-build-isolation "horovod==${HOROVOD_VERSION}"
fi

step "hvd_compress and its TensorFlow ops (tf_ops/ -> hvd_compress/_tf_ops.so)"
# The editable install is made once; the ops are rebuilt in place when a
# source or the TensorFlow version changed (setup.py's build_ext decides).
if ! "$PY" -m pip show -q hvd_compress >/dev/null 2>&1; then
  "${PIP[@]}" --no-build-isolation --no-deps -e .
fi
tf_quiet "$PY" setup.py -q build_ext --inplace

step "TF_USE_LEGACY_KERAS=1 for every Python of this environment"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo 'import os; os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")' > "${SITE}/hvd_compress_legacy_keras.pth"

step "Check: the ops load, tf.keras is Keras 2, Horovod has Gloo and MPI"
tf_quiet "$PY" -c '
import sys, tensorflow as tf, hvd_compress, hvd_compress.ops as ops, horovod, horovod.tensorflow as hvd
ops.library(); hvd_compress.require_legacy_keras()
print(f"    TensorFlow {tf.__version__}, Horovod {horovod.__version__} (Gloo {hvd.gloo_built()}, MPI {hvd.mpi_built()}), ops {ops.LIBRARY_PATH}")
sys.exit(not (hvd.gloo_built() and hvd.mpi_built()))'
echo "==> set-up complete (${VENV})"
