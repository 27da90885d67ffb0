# Sourced by the GPU scripts of benchmarks/: run from the repository's root, with what the machine's
# image lacks installed from the wheels carried in .whl/ (see the device notes) and this tree installed
# editable (pyproject.toml maps its subpackages in: the root on the path is not enough); output goes
# to $OUT. Loopback only for every MPI.
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e . || exit 1
export PYTHONUNBUFFERED=1 HYDRA_IFACE=lo UCX_TLS=self,sm UCX_NET_DEVICES=lo FI_TCP_IFACE=lo
export OMPI_MCA_oob_tcp_if_include=lo OMPI_MCA_btl_tcp_if_include=lo
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1   # Open MPI refuses root otherwise; the device runs as root
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
psctl() { python3 -m psgrid.cluster.cli "$@"; }
# An MPS control daemon of the calling script's own: a private pipe directory, so that only the processes
# started here while it is on use it; mps_off quits it (and the EXIT trap, should the script end first).
mps_on() {
  mps_dir=$(mktemp -d)
  export CUDA_MPS_PIPE_DIRECTORY=$mps_dir/pipe CUDA_MPS_LOG_DIRECTORY=$mps_dir/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && trap mps_off EXIT
}
mps_off() {
  [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] || return 0
  echo quit | nvidia-cuda-mps-control
  sleep 1
  rm -rf "$mps_dir"
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  trap - EXIT
}
