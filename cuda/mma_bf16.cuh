// The bf16 tensor-core MMA the GEMV and attention kernels share. The .cu files include it by its
// quoted name: nvcc finds it next to them (tools/compile_cuda.sh), and the runtime loader
// (swiftspec_mpi/gpu/launch.py, cuda_source) pastes it into the source it compiles.
#pragma once

#include <stdint.h>

// C[16x8] += A[16x16] * B[16x8], bf16 inputs, fp32 accumulators (PTX fragment layouts).
__device__ __forceinline__ void mma_bf16(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
