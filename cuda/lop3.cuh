// One lop3 for (a & m) | c, the 4-bit unpack's mask of the nibbles and OR of 128's exponent, which
// the GEMV and step kernels share. Written out because C's `(a & m) | c` with two constants
// compiles to two lop3s (a lop3 takes one immediate); here m and c stay in registers.
#pragma once

#include <stdint.h>

__device__ __forceinline__ uint32_t lop3_andor(uint32_t a, uint32_t m, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(m), "r"(c));
  return d;
}
