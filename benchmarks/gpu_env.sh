# Shared settings of the GPU machine scripts (sourced by gpu_engine.sh and gpu_engine_runs.sh):
# output folder, unbuffered Python, no NVLink multicast, Open MPI as root, the `swiftspec` command.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4
MPI="mpirun --allow-run-as-root --oversubscribe"
export SWIFTSPEC_TEST_MPIEXEC="$MPI" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
SW="python3 -m swiftspec_mpi"
