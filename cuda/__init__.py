"""CUDA C++ sources (tree attention, GEMM + all-reduce) shipped as package data; loaded at run time with cupy.RawModule by swiftspec_mpi.kernels."""
