// Shared by every kernel in cuda/: the contract with the Python launcher and the host shim.
#pragma once

#if !defined(__CUDACC__)
// g++ build for the CPU emulator (scaledoptim/kernels/emulator.py).
#include "emulator_shim.h"
#endif

// Note [found_inf contract]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// `found_inf` is a 0-dim float32 tensor on the device, passed to kernels by pointer so the host
// never reads it (a read would be a host sync and would break CUDA-graph capture).
//  * Producers (non_finite_check.cu, unscale.cu) only ever store 1.0f into it and never 0.0f:
//    the caller zeroes it before the first producer, so producers compose in any order.
//  * Consumers (every update kernel: update_each in multi_tensor_apply.cuh, lamb.cu,
//    step_epilogue.cu) return before touching memory when `found_inf != nullptr &&
//    *found_inf != 0` -- "!= 0", not "== 1", so a flag that was summed or max-reduced across
//    ranks still skips. Params, optimizer state and step counters are then bit-for-bit unchanged.
//  * `inv_scale` (may be null: grads not scaled) is applied to the gradient in registers by
//    update kernels; gradient memory is never written by them. Only unscale.cu writes grads.
//  * Step counters: see Note [step counters].
// The Python side of the contract is scaledoptim/fused/backends/ (kernels.py, torch_native.py).

// Note [step counters]
// ~~~~~~~~~~~~~~~~~~~~
// Each parameter has a 0-dim float32 `step` tensor on the device counting *taken* steps.
// Update kernels only read it (StepCount: `*step + 1` for Adam's bias correction, `*step == 0`
// for SGD's first momentum step): the blocks of one tensor run concurrently, so none of them may
// write it. The launcher then runs step_epilogue_kernel, gated on found_inf like any update, as
// the last launch of the step on the same stream. No host read, so a whole step can be
// graph-captured.

typedef unsigned long long so_uintptr;

// Note [launch bounds]
// ~~~~~~~~~~~~~~~~~~~~
// Every __global__ kernel is declared `__global__ void __launch_bounds__(kMaxThreadsPerBlock)`,
// so the GPU compiler keeps it within the 65536 registers of a block of that many threads (64
// per thread) and it launches at any block size LaunchConfig allows (MAX_THREADS_PER_BLOCK in
// scaledoptim/kernels/config.py); without it a kernel may use more and fail to launch at 1024
// with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES. tests/kernels/test_launch_bounds.py reads the
// registers of every compiled kernel.
constexpr int kMaxThreadsPerBlock = 1024;

// See Note [found_inf contract]: consumers skip the whole step on any non-zero flag.
__device__ __forceinline__ bool step_is_skipped(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.0f;
}
