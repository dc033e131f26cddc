#!/usr/bin/env bash
# One-command set-up, safe to run again (a second run takes seconds):
#   Debian packages (Open MPI, compilers), a virtual environment, the pinned
#   stack, Horovod 0.28.1 built from its source with TensorFlow + Gloo + MPI
#   (patched: patches/horovod-0.28.1.patch), and hvd_compress with its compiled
#   ops. The terminal shows one line per step with its time; what the tools print
#   (apt, pip, the compilers) goes to build/setup.log, the ops' compile (which runs
#   beside Horovod's step) to build/ops.log. A failing step is named, with its log's
#   last 40 lines.
#
#   The Horovod wheel this builds is kept in ~/.cache/hvd_compress (HVD_COMPRESS_CACHE),
#   under a key of its version, the patches, TensorFlow's version, Python's and the
#   build's kind: another checkout or a new environment with the same key installs it
#   in seconds instead of building it again.
#
#   HVD_COMPRESS_STACK=current (default): TensorFlow 2.21, Keras 3 and tf_keras 2.21,
#                                         in .venv (requirements.txt)
#   HVD_COMPRESS_STACK=tf2.18:            TensorFlow 2.18, tf_keras 2.18, in .venv-tf2.18
#                                         (requirements-tf2.18.txt)
#   HVD_COMPRESS_VENV=path                another place for the virtual environment
#   HVD_COMPRESS_GPU=1                    a GPU build (stack current only), in .venv-gpu: Horovod with
#                                         NCCL and CUDA as well (HOROVOD_GPU_OPERATIONS=NCCL), patched with
#                                         patches/horovod-0.28.1-gpu.patch too, and the CUDA pieces from
#                                         pip (requirements-gpu.txt). It compiles without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

STACK=${HVD_COMPRESS_STACK:-current}
case "${STACK}" in
  current) REQUIREMENTS=requirements.txt; DEFAULT_VENV=.venv ;;
  tf2.18) REQUIREMENTS=requirements-tf2.18.txt; DEFAULT_VENV=.venv-tf2.18 ;;
  *) echo "!! HVD_COMPRESS_STACK=${STACK} is not a stack: use current (TensorFlow 2.21, Keras 3) or tf2.18." >&2
     exit 2 ;;
esac
GPU=${HVD_COMPRESS_GPU:-0}
case "${GPU}" in
  0|"") GPU=0 ;;
  1) [ "${STACK}" = current ] || {
       echo "!! HVD_COMPRESS_GPU=1 is for the current stack (TensorFlow 2.21) only, not ${STACK}." >&2; exit 2; }
     DEFAULT_VENV=.venv-gpu ;;
  *) echo "!! HVD_COMPRESS_GPU=${GPU}: use 1 (a GPU build with NCCL) or 0." >&2; exit 2 ;;
esac
VENV=${HVD_COMPRESS_VENV:-${DEFAULT_VENV}}
PYTHON=${PYTHON:-python3}
HOROVOD_VERSION=0.28.1
HOROVOD_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
# Applied in this order; the GPU build adds its own patch on top of the common one.
HOROVOD_PATCHES=(patches/horovod-${HOROVOD_VERSION}.patch)
((GPU)) && HOROVOD_PATCHES+=(patches/horovod-${HOROVOD_VERSION}-gpu.patch)
mkdir -p build
LOG=$(pwd)/build/setup.log
: > "${LOG}"
echo "hvd_compress set-up (stack ${STACK}$( ((GPU)) && echo ', GPU build')), the tools' output in ${LOG}"
STEP=""
NOTE=""
# One terminal line per step: its name, then its time (and a note) when the next step starts or the set-up ends.
step() { end_step; STEP="$*"; STEP_STARTED=${SECONDS}; printf '==> %s ... ' "$*"; printf '\n==> %s\n' "$*" >>"${LOG}"; }
end_step() {
  [ -n "${STEP}" ] || return 0
  echo "$((SECONDS - STEP_STARTED)) s${NOTE:+ (${NOTE})}"
  STEP=""; NOTE=""
}
# Runs a command with everything it prints in the log.
logged() { "$@" >>"${LOG}" 2>&1; }
FAILED_LOG=${LOG}
OPS_PID=""
on_exit() {
  local rc=$?
  [ -z "${OPS_PID}" ] || kill "${OPS_PID}" $(pgrep -P "${OPS_PID}") 2>/dev/null || true
  if [ "${rc}" = 0 ]; then return; fi
  echo
  echo "!! hvd_compress set-up failed (exit ${rc}) during: ${STEP:-start}. The last 40 lines of ${FAILED_LOG}:" >&2
  tail -n 40 "${FAILED_LOG}" | sed 's/^/   | /' >&2
  echo "!! The whole log: ${FAILED_LOG}" >&2
}
trap on_exit EXIT

step "Debian packages (openmpi-bin libopenmpi-dev g++ cmake patch iproute2)"
PACKAGES=(openmpi-bin libopenmpi-dev g++ cmake make patch iproute2)
missing=()
for p in "${PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  logged $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive logged $SUDO apt-get install -y -qq "${missing[@]}"
  NOTE="installed ${missing[*]}"
fi

step "Python virtual environment in ${VENV} (stack: ${STACK})"
"$PYTHON" -c 'import sys; assert (3, 10) <= sys.version_info[:2] <= (3, 12), \
  f"TensorFlow 2.18-2.21 need Python 3.10-3.12, this is {sys.version.split()[0]}; set PYTHON=python3.11"'
[ -x "${VENV}/bin/python" ] || logged "$PYTHON" -m venv "${VENV}"
PY="${VENV}/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

step "Pinned Python packages (${REQUIREMENTS})"
logged "${PIP[@]}" --upgrade pip setuptools wheel
logged "${PIP[@]}" -r "${REQUIREMENTS}"

# What the Horovod build gets in its environment besides the frameworks (none for the CPU build).
HOROVOD_BUILD_ENV=()
HOROVOD_FEATURES="Gloo and MPI"
if ((GPU)); then
  step "CUDA pieces from pip (requirements-gpu.txt): CUDA 12.5 runtime and NCCL for TensorFlow, CUDA 13.0's nvcc for Horovod"
  logged "${PIP[@]}" -r requirements-gpu.txt
  NVIDIA=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia
  GPU_CUDA_HOME="${NVIDIA}/cu13"
  GPU_NCCL_HOME="${NVIDIA}/nccl"
  # The wheels as a toolkit: nvcc links from lib64, CMake looks for libcudart.so and libnccl.so.
  ln -sfn lib "${GPU_CUDA_HOME}/lib64"
  ln -sf libcudart.so.13 "${GPU_CUDA_HOME}/lib/libcudart.so"
  ln -sf libnccl.so.2 "${GPU_NCCL_HOME}/lib/libnccl.so"
  NOTE="nvcc: $("${GPU_CUDA_HOME}/bin/nvcc" --version | tail -n 1)"
  # Horovod finds nvcc on PATH first (here it has to be this one, not another CUDA's); its CUDA
  # kernels for these architectures (CUDA 13 compiles Turing, sm_75, and newer). NCCL is linked
  # shared, from the wheel (TensorFlow's own NCCL); the CUDA runtime statically (Horovod's default).
  # MAKEFLAGS: the build's jobs, and no flags leaking in from `make setup GPU=1`.
  HOROVOD_BUILD_ENV=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_CUDA_HOME="${GPU_CUDA_HOME}" PATH="${GPU_CUDA_HOME}/bin:${PATH}"
                     HOROVOD_BUILD_CUDA_CC_LIST=75,80,86,89,90 HOROVOD_NCCL_HOME="${GPU_NCCL_HOME}" HOROVOD_NCCL_LINK=SHARED
                     MAKEFLAGS="-j$(nproc)")
  HOROVOD_FEATURES="Gloo, MPI and NCCL (CUDA)"
fi

# The ops compile beside Horovod's step (they need TensorFlow only): Horovod's build leaves a core idle while
# it configures, links and packs, and the ops' precompiled header is one job. Their output: build/ops.log.
# The ops are rebuilt in place when a source, a flag or the TensorFlow version changed (setup.py's build_ext
# decides); HVD_COMPRESS_GPU=1 (in the environment) makes setup.py add the ops' CUDA kernels, with the toolkit
# at CUDA_HOME: the GPU build's (CUDA 13.0's nvcc and static runtime, from pip).
OPS_LOG=$(pwd)/build/ops.log
OPS_ENV=(HVD_COMPRESS_GPU="${GPU}")
((GPU)) && OPS_ENV+=(CUDA_HOME="${GPU_CUDA_HOME}")
(started=${SECONDS}
 env "${OPS_ENV[@]}" TF_CPP_MIN_LOG_LEVEL=3 "$PY" setup.py build_ext --inplace > "${OPS_LOG}" 2>&1
 echo "$((SECONDS - started))" > "${OPS_LOG}.seconds") &
OPS_PID=$!

step "Horovod ${HOROVOD_VERSION} with TensorFlow, ${HOROVOD_FEATURES}, patched (${HOROVOD_PATCHES[*]})"
# Built against this environment's TensorFlow: rebuilt when its ops no longer load (another
# TensorFlow) or it was built with other versions of the patches (the SHA-256 of the patches
# in order, kept beside the installed package; for the CPU build, that of its one patch).
PATCH_SHA256=$(cat "${HOROVOD_PATCHES[@]}" | sha256sum | cut -d' ' -f1)
HOROVOD_CHECK='import horovod, horovod.tensorflow as hvd, pathlib, sys
stamp = pathlib.Path(horovod.__file__).parent / "hvd_compress_patch.sha256"
patched = stamp.exists() and stamp.read_text().strip() == sys.argv[2]
gpu = sys.argv[3] == "1"
sys.exit(not (horovod.__version__ == sys.argv[1] and patched and hvd.gloo_built() and hvd.mpi_built()
              and (not gpu or (hvd.nccl_built() and hvd.cuda_built()))))'
horovod_ready() { TF_CPP_MIN_LOG_LEVEL=3 "$PY" -c "${HOROVOD_CHECK}" "${HOROVOD_VERSION}" "${PATCH_SHA256}" "${GPU}" >/dev/null 2>&1; }
# The built wheel's cache: one folder per key (what the build depends on).
TF_VERSION=$("$PY" -c 'import importlib.metadata as m; print(m.version("tensorflow"))')
CACHE_KEY=$(printf '%s\n' "${HOROVOD_VERSION}" "${PATCH_SHA256}" "${TF_VERSION}" "${GPU}" "$(uname -m)" \
  "$("$PY" -c 'import sys; print(sys.version)')" | sha256sum | cut -c1-16)
HOROVOD_CACHE="${HVD_COMPRESS_CACHE:-${XDG_CACHE_HOME:-${HOME}/.cache}/hvd_compress}/horovod-${HOROVOD_VERSION}-${CACHE_KEY}"
install_horovod_wheel() {
  logged "${PIP[@]}" --force-reinstall --no-deps "$1"
  "$PY" -c 'import pathlib, sys, horovod
(pathlib.Path(horovod.__file__).parent / "hvd_compress_patch.sha256").write_text(sys.argv[1])' "${PATCH_SHA256}"
}
build_horovod_wheel() {
  local src
  src=$(mktemp -d)
  logged "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
    -d "${src}" "horovod==${HOROVOD_VERSION}"
  echo "${HOROVOD_SHA256}  ${src}/horovod-${HOROVOD_VERSION}.tar.gz" | logged sha256sum -c - || {
    echo "!! horovod-${HOROVOD_VERSION}.tar.gz does not have the pinned checksum ${HOROVOD_SHA256}." >>"${LOG}"; exit 1; }
  tar -xzf "${src}/horovod-${HOROVOD_VERSION}.tar.gz" -C "${src}"
  # The patch: XLA includes only in GPU builds (TensorFlow 2.19+ moved them), Horovod's Keras
  # callbacks take the backend of tf.keras (tf_keras), not of `import keras` (Keras 3), and Gloo's
  # alltoall and allgather post their receives before their sends (both directions at once), and the background
  # loop rests while nothing is queued (HOROVOD_IDLE_CYCLE_TIME).
  # The GPU patch: Horovod's XLA ops and TensorFlow GPU streams on TensorFlow 2.19+ (its header says how).
  for patch_file in "${HOROVOD_PATCHES[@]}"; do
    logged patch -d "${src}/horovod-${HOROVOD_VERSION}" -p1 --forward < "${patch_file}" || {
      echo "!! ${patch_file} does not apply to horovod ${HOROVOD_VERSION}'s source in ${src}." >>"${LOG}"; exit 1; }
  done
  # Gloo's CMakeLists predates CMake 4; this keeps a newer cmake working too. The wheel is built in a folder of
  # its own and moved into the cache whole, so an interrupted build leaves no wheel behind.
  mkdir -p "${src}/wheel"
  logged env "${HOROVOD_BUILD_ENV[@]}" CMAKE_POLICY_VERSION_MINIMUM=3.5 \
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    "$PY" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-cache-dir --no-deps \
    -w "${src}/wheel" "${src}/horovod-${HOROVOD_VERSION}"
  mkdir -p "$(dirname "${HOROVOD_CACHE}")"
  rm -rf "${HOROVOD_CACHE}"
  mv "${src}/wheel" "${HOROVOD_CACHE}"
  rm -rf "${src}"
}
if horovod_ready; then
  NOTE="installed"
else
  cached=$(ls "${HOROVOD_CACHE}"/horovod-*.whl 2>/dev/null | head -n 1 || true)
  if [ -n "${cached}" ]; then
    install_horovod_wheel "${cached}"
    NOTE="from the wheel in ${HOROVOD_CACHE}"
  fi
  if ! horovod_ready; then
    echo "Building Horovod (3-6 minutes on two cores); the wheel goes to ${HOROVOD_CACHE}" >>"${LOG}"
    build_horovod_wheel
    install_horovod_wheel "$(ls "${HOROVOD_CACHE}"/horovod-*.whl | head -n 1)"
    horovod_ready || { echo "!! the Horovod just built does not load with ${HOROVOD_FEATURES}." >>"${LOG}"; exit 1; }
    NOTE="built from source; wheel kept in ${HOROVOD_CACHE}"
  fi
fi

step "hvd_compress and its TensorFlow ops (tf_ops/ -> hvd_compress/_tf_ops-tf<version>.so)"
FAILED_LOG=${OPS_LOG}
wait "${OPS_PID}"
OPS_PID=""
# The editable install is made once (its own build_ext finds the library built and does nothing).
if ! "$PY" -m pip show -q hvd_compress >/dev/null 2>&1; then
  logged env "${OPS_ENV[@]}" "${PIP[@]}" --no-build-isolation --no-deps -e .
fi
FAILED_LOG=${LOG}
NOTE="compiled in $(cat "${OPS_LOG}.seconds") s beside Horovod's step, $(grep -c "warning:" "${OPS_LOG}" || true) compiler warnings"

# Earlier set-ups forced tf_keras on every Python of the environment; the user's Keras decides now.
rm -f "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/hvd_compress_legacy_keras.pth"

step "Check: the ops load, Horovod has ${HOROVOD_FEATURES}"
VERSIONS=$(TF_CPP_MIN_LOG_LEVEL=3 "$PY" -c '
import sys, tensorflow as tf, tf_keras, hvd_compress, hvd_compress.ops as ops, horovod, horovod.tensorflow as hvd
import keras
ops.library()
gpu = sys.argv[1] == "1"
nccl = f", NCCL {hvd.nccl_built()}, CUDA {hvd.cuda_built()}" if gpu else ""
print(f"    TensorFlow {tf.__version__}, Keras {keras.__version__}, tf_keras {tf_keras.__version__}, "
      f"Horovod {horovod.__version__} (Gloo {hvd.gloo_built()}, MPI {hvd.mpi_built()}{nccl}), ops {ops.LIBRARY_PATH}")
sys.exit(not (hvd.gloo_built() and hvd.mpi_built() and (not gpu or (hvd.nccl_built() and hvd.cuda_built()))))' \
  "${GPU}" 2>>"${LOG}")
end_step
echo "${VERSIONS}"
echo "==> set-up complete in ${SECONDS} s (${VENV})"
