#!/usr/bin/env bash
# One virtual environment per peer, outside the repository: bash install.sh [DIR] (default
# /work/peer-venvs). Run as root on Debian 12 (apt-get), with Python 3.11 as python3.
#
# The peers conflict (MosaicML Streaming pins numpy < 2.2; FFCV 1.0.2 builds from source against
# Debian's OpenCV and libturbojpeg; SPDL 0.8 loads Debian 12's FFmpeg 5.1 libraries), so each has
# its own venv. torch 2.14.1 + torchvision 0.29.1 (a 5.4 GB CUDA build) are installed once into
# DIR/_torch (without their numpy and Pillow) and added to the torch-using venvs by a .pth file
# placed after the venv's own site-packages, so each venv's own numpy wins.
# Every step is skipped when its venv already imports its peer. Logs: DIR/logs/.
set -euo pipefail
DIR=${1:-/work/peer-venvs}
PY=${PYTHON:-python3}
mkdir -p "$DIR/logs"
cd "$DIR"

if ! dpkg -s libturbojpeg0-dev libopencv-dev pkg-config libavformat59 >/dev/null 2>&1; then
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q libturbojpeg0-dev libopencv-dev pkg-config \
    libavdevice59 libavfilter8 libavformat59 libavcodec59 libavutil57 libswscale6 libswresample4
fi

if [ ! -d _torch/torch ]; then
  "$PY" -m pip install -q --target _torch torch==2.14.1 torchvision==0.29.1
  rm -rf _torch/numpy* _torch/PIL _torch/pillow* _torch/bin
fi

venv() {  # venv NAME [torch]: a fresh venv; with "torch", the shared torch after its own packages
  [ -x "$1/bin/python" ] || "$PY" -m venv "$1"
  if [ "${2:-}" = torch ]; then
    echo "$DIR/_torch" > "$1/lib/python3.11/site-packages/zz_shared_torch.pth"
  fi
}

# ok VENV MODULE: VENV imports MODULE from a file (run from /: here in DIR the venv folder of the
# same name would import as an empty namespace package and pass for the peer)
ok() {
  (cd / && "$DIR/$1/bin/python" -c "import sys, $2; sys.exit($2.__file__ is None)") >/dev/null 2>&1
}

venv dali
ok dali nvidia.dali || dali/bin/pip install -q nvidia-dali-cuda120==2.4.0 numpy

venv spdl
ok spdl spdl.io || spdl/bin/pip install -q spdl==0.8.0 numpy

venv litdata torch
ok litdata litdata || litdata/bin/pip install -q litdata==0.2.76 numpy pillow

venv streaming torch
ok streaming streaming || streaming/bin/pip install -q mosaicml-streaming==0.13.0 pillow

venv ffcv torch
if ! ok ffcv ffcv; then
  # FFCV's own requirements (opencv-python swapped for the headless wheel), then FFCV 1.0.2 built
  # from its source release against the Debian packages above (pkg-config opencv4, libturbojpeg).
  ffcv/bin/pip install -q numpy pillow opencv-python-headless numba terminaltables \
    pytorch_pfn_extras fastargs assertpy tqdm psutil
  ffcv/bin/pip install -q --no-build-isolation --no-deps --no-binary ffcv ffcv==1.0.2
fi

missing=0
for pair in dali:nvidia.dali spdl:spdl.io litdata:litdata streaming:streaming ffcv:ffcv; do
  v=${pair%%:*} m=${pair#*:}
  if ok "$v" "$m"; then
    printf '%-10s %s\n' "$v" "$(cd / && "$DIR/$v/bin/python" -c "import $m; print($m.__file__)")"
  else
    printf '%-10s NOT INSTALLED: %s does not import %s\n' "$v" "$DIR/$v" "$m"
    missing=1
  fi
done
exit $missing
