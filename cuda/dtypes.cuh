// 16-bit storage types and their conversions to and from fp32, without cuda_fp16.h/cuda_bf16.h
// (the pip NVRTC wheel ships neither, nor does g++). Device code uses the hardware cvt
// instructions; the host emulator uses exact round-to-nearest-even bit arithmetic
// (tests/kernels/test_emulated_dtypes.py checks it against torch's casts for every 16-bit pattern).
#pragma once
#include "common.cuh"

struct so_half {
  unsigned short bits;
};
struct so_bfloat16 {
  unsigned short bits;
};

__device__ __forceinline__ unsigned so_float_bits(float x) {
#if defined(__CUDACC__)
  return __float_as_uint(x);
#else
  return std::bit_cast<unsigned>(x);
#endif
}

__device__ __forceinline__ float so_float_from_bits(unsigned bits) {
#if defined(__CUDACC__)
  return __uint_as_float(bits);
#else
  return std::bit_cast<float>(bits);
#endif
}

// Finite iff the exponent is not all ones; bitwise so that fast-math flags cannot fold it away.
__device__ __forceinline__ bool is_finite(float x) {
  return (so_float_bits(x) & 0x7f800000u) != 0x7f800000u;
}

__device__ __forceinline__ unsigned short half_bits_from_float_rne(float x) {
  const unsigned bits = so_float_bits(x);
  const unsigned short sign = (bits >> 16) & 0x8000u;
  const unsigned abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN -> quiet NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
  if (abs >= 0x38800000u) {                       // normal half (>= 2^-14)
    const unsigned rounded = abs + 0xfffu + ((abs >> 13) & 1u);
    return sign | static_cast<unsigned short>((rounded - 0x38000000u) >> 13);
  }
  const unsigned exponent = abs >> 23;
  if (exponent < 102) return sign;  // below 2^-25: rounds to zero
  // Subnormal half: value = mantissa * 2^(exponent - 150) = h * 2^-24.
  const unsigned mantissa = (abs & 0x7fffffu) | 0x800000u;
  const unsigned shift = 126 - exponent;  // 14..24
  unsigned h = mantissa >> shift;
  const unsigned rest = mantissa & ((1u << shift) - 1u);
  const unsigned halfway = 1u << (shift - 1);
  if (rest > halfway || (rest == halfway && (h & 1u))) ++h;  // may carry into the min normal
  return sign | static_cast<unsigned short>(h);
}

__device__ __forceinline__ float float_from_half_bits(unsigned short h) {
  const unsigned sign = static_cast<unsigned>(h & 0x8000u) << 16;
  unsigned exponent = (h >> 10) & 0x1fu;
  unsigned mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return so_float_from_bits(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return so_float_from_bits(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return so_float_from_bits(sign);
  exponent = 113;  // subnormal: normalise
  while (!(mantissa & 0x400u)) {
    mantissa <<= 1;
    --exponent;
  }
  return so_float_from_bits(sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13));
}

__device__ __forceinline__ unsigned short bfloat16_bits_from_float_rne(float x) {
  const unsigned bits = so_float_bits(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((bits >> 16) | 0x40u);
  return static_cast<unsigned short>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float to_float(float x) { return x; }

__device__ __forceinline__ float to_float(so_half x) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
#else
  return float_from_half_bits(x.bits);
#endif
}

__device__ __forceinline__ float to_float(so_bfloat16 x) {
  return so_float_from_bits(static_cast<unsigned>(x.bits) << 16);
}

template <typename T>
__device__ T from_float(float x);

template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}

template <>
__device__ __forceinline__ so_half from_float<so_half>(float x) {
  so_half h;
#if defined(__CUDA_ARCH__)
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
#else
  h.bits = half_bits_from_float_rne(x);
#endif
  return h;
}

template <>
__device__ __forceinline__ so_bfloat16 from_float<so_bfloat16>(float x) {
  so_bfloat16 b;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.bits) : "f"(x));
#else
  b.bits = bfloat16_bits_from_float_rne(x);
#endif
  return b;
}

// Note [stochastic rounding]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// bf16 stores may round stochastically: 16 bits of uniform noise are added to the fp32 bit
// pattern below the bf16 rounding point and the low 16 bits truncated, so x rounds up with
// probability (x - down) / (up - down): unbiased. The noise is a counter-based hash of
// (a 32-bit seed per param, the taken-step count including this step, the element's index in
// the param's storage): no RNG state, the same bits on every replay of a captured graph, on
// resume from a checkpoint, and in the torch-native backend, which computes the same bits
// with int32 tensor ops (scaledoptim/torch_ops.py, Note [stochastic rounding in int32]).

// murmur3's 32-bit finaliser: a bijection with full avalanche.
__device__ __forceinline__ unsigned so_fmix32(unsigned h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// The per-(param, step) key; the element index is mixed in by so_sr_noise.
__device__ __forceinline__ unsigned so_sr_key(unsigned seed, unsigned step) {
  return so_fmix32(seed ^ so_fmix32(step));
}

// 16 uniform bits for element `index` (its low 32 bits).
__device__ __forceinline__ unsigned so_sr_noise(unsigned key, long long index) {
  return so_fmix32(static_cast<unsigned>(index) ^ key) >> 16;
}

__device__ __forceinline__ unsigned short bfloat16_bits_from_float_sr(float x, unsigned noise) {
  const unsigned bits = so_float_bits(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((bits >> 16) | 0x40u);
  // Sign-magnitude: the noise rounds the magnitude up, so both signs are unbiased; an infinity
  // (low bits zero) stays one, and only values within one bf16 ulp of the largest finite
  // bf16 can carry into infinity.
  return static_cast<unsigned short>((bits + noise) >> 16);
}
