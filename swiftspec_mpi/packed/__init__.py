"""Packed weights: the 4-bit and 8-bit formats (int4, int8) and the CPU kernels that run them
(cpu_linear, cpu_quant, cpu_ops over the C GEMMs in csrc/, built as _cpu_gemm)."""
