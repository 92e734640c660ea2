#!/usr/bin/env bash
# One device check on an NVIDIA machine without network: MLX's CUDA build (mlx + mlx-cuda-13 wheels,
# unpacked and recompressed as .dev/mlx_cuda_site.tar.xz.* because the wheel is over the 64 MiB a
# call may carry) is installed into /tmp/site; then the test suite runs with MLX's GPU as the
# default device: `backend=None` takes the fused CUDA kernels there, so the PyTorch comparisons of
# the kernels tests check them, and test_fused_kernels' real-GPU test compares them with the
# MLX-ops path on every flag and layout. bench/attention.py then times every backend (MLX-ops path,
# fused CUDA) against the authors' torch core on CUDA (and their compiled CUDA op, if importable)
# and on all CPU cores. Writes its log to $OUT (or ./device-out).
set -uo pipefail
out=${OUT:-device-out}
mkdir -p "$out" /tmp/site
{
  echo "== machine"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.version.cuda)"
  cat .dev/mlx_cuda_site.tar.xz.* | xz -d | tar -x -C /tmp/site || exit 1
  # libmlx.so finds cuBLAS, cuDNN, NCCL, NVRTC through $ORIGIN/../../nvidia: use the machine's own.
  ln -sfn "$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')" /tmp/site/nvidia
  export PYTHONPATH=/tmp/site:$PWD CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
  python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), 'cuda', mx.cuda.is_available())"
  echo "== tests, MLX default device = GPU (float64 tests on the CPU device: MLX GPUs have no float64)"
  python3 -m pytest -q -p no:cacheprovider --tb=short -rs tests 2>&1 | tail -60
  echo "== the fused CUDA kernels against the MLX-ops path, on the GPU"
  python3 -m pytest -q -p no:cacheprovider --tb=short -rs tests/test_fused_kernels.py -k on_this_gpu 2>&1 | tail -20
  echo "== bench vs torch on CUDA"
  python3 bench/attention.py --repeats 10 --torch-device cuda
  echo "== bench vs torch on CPU ($(nproc) threads)"
  python3 bench/attention.py --repeats 3 --threads "$(nproc)"
} 2>&1 | tee "$out/h200_mlx_cuda.log"
