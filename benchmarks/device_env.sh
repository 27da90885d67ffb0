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
