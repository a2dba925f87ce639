// LAMB (You et al. 2020) with Apex FusedLAMB's semantics, fused with unscaling, the skip on
// inf/nan (Note [found_inf contract]) and the param rounding options (Note [param rounding]).
// Three sync-free launches per step, all gated on found_inf:
//   lamb_grad_norm_kernel: the squared global norm of the unscaled grads, into a device scalar;
//   lamb_norms_kernel:     the new moments, and per chunk the sums of p^2 and update^2;
//   lamb_kernel:           the update, recomputed from the new moments, times the trust ratio.
// Every sum is bit-reproducible, whatever order blocks run in (Note [deterministic sums]).
#include "block_sums.cuh"

// Mirrored by LambArgs in scaledoptim/optim/lamb.py.
struct LambArgs {
  const float* found_inf;     // See Note [found_inf contract]; may be null
  const float* inv_scale;     // may be null: grads are not scaled
  const float* grad_norm_sq;  // squared global norm of the unscaled grads (lamb_grad_norm_kernel)
  float lr;
  float beta1;
  float beta1_grad;  // 1 - beta1, or 1 without grad averaging
  float beta2;
  float one_minus_beta2;
  float eps;
  float weight_decay;
  float max_grad_norm;  // <= 0: no clipping
  float log_beta1;      // log(beta1) in double, rounded once; -inf for beta1 == 0
  float log_beta2;
  int bias_correction;
  int adam_w_mode;      // decoupled decay in the update; else L2 in the grad
  int trust_ratio;      // use_nvlamb or weight_decay != 0
};

// Mirrored by LambNormArgs in scaledoptim/optim/lamb.py.
struct LambNormArgs {
  const float* found_inf;
  const float* inv_scale;
  float* grad_norm_sq;  // stored by the last block to arrive
  float* partials;      // every chunk's partial sum: the per-chunk list, as one buffer
  unsigned* arrivals;   // See Note [deterministic sums]: 0 between launches
  unsigned n_chunks;    // chunks of every grad of the step, over all launches
};

// LambGradNormList, LambNormsList, LambList: generated from the .lists of LAMB_GRAD_NORM_KERNEL,
// LAMB_NORMS_KERNEL and LAMB_KERNEL; See Note [list enums] in kernels/sources.py

template <typename G>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    lamb_grad_norm_kernel(TensorTable<kLambGradNormLists> table, LambNormArgs args) {
  __shared__ float scratch[kMaxThreadsPerBlock];
  if (step_is_skipped(args.found_inf)) return;
  const Chunk c = this_blocks_chunk(table);
  const G* g = chunk_data<const G>(table, kLambGradNormGrads, c);
  const float inv_scale = read_inv_scale(args.inv_scale);
  float sum = 0.0f;
  for_each_lanes(c.size, all_aligned(g), [&](const Lanes& l) {
    float rg[kILP];
    load(rg, g, l);
#pragma unroll
    for (int k = 0; k < kILP; ++k) sum += (rg[k] * inv_scale) * (rg[k] * inv_scale);
  });
  // See Note [deterministic sums]: the partials of all the step's grads lie in one buffer, in the
  // order of the grads and their chunks, whichever launch stored them.
  finish_chunked_sum(table, kLambGradNormGradSqPartials, c, block_sum(sum, scratch),
                     args.partials, args.arrivals, args.n_chunks, args.grad_norm_sq, scratch);
}

struct LambStepScalars {
  float inv_clip;  // 1 / max(norm / max_grad_norm, 1)
  float bias_correction1;
  float bias_correction2;
};

__device__ __forceinline__ LambStepScalars lamb_step_scalars(const LambArgs& a, float step) {
  LambStepScalars s;
  const float norm = sqrtf(*a.grad_norm_sq);
  s.inv_clip = a.max_grad_norm > 0.0f && norm > a.max_grad_norm ? a.max_grad_norm / norm : 1.0f;
  // 1 - beta^step as -expm1(step * log(beta)), as adam.cu: 1 - powf(beta, step) cancels (1000x
  // at beta 0.999, step 1), so an ulp of powf, or of beta's rounding to fp32, became 2 ulp of a
  // 16-bit param (tests/gpu on an H200; the emulator at the GPU tests' sizes).
  s.bias_correction1 = a.bias_correction ? -expm1f(step * a.log_beta1) : 1.0f;
  s.bias_correction2 = a.bias_correction ? -expm1f(step * a.log_beta2) : 1.0f;
  return s;
}

// The new moments of one element (`g` unscaled, not yet clipped).
__device__ __forceinline__ void lamb_moments(float p, float g, float& m, float& v, const LambArgs& a,
                                             const LambStepScalars& s) {
  g *= s.inv_clip;
  if (!a.adam_w_mode && a.weight_decay != 0.0f) g += a.weight_decay * p;
  m = a.beta1 * m + a.beta1_grad * g;
  v = a.beta2 * v + a.one_minus_beta2 * g * g;
}

// The update direction of one element from its new moments (both kernels compute it alike).
__device__ __forceinline__ float lamb_direction(float p, float m, float v, const LambArgs& a,
                                                const LambStepScalars& s) {
  float u = (m / s.bias_correction1) / (sqrtf(v / s.bias_correction2) + a.eps);
  if (a.adam_w_mode && a.weight_decay != 0.0f) u += a.weight_decay * p;
  return u;
}

template <typename P, typename G>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    lamb_norms_kernel(TensorTable<kLambNormsLists> table, LambArgs args) {
  __shared__ float scratch[kMaxThreadsPerBlock];
  if (step_is_skipped(args.found_inf)) return;  // See Note [found_inf contract]
  const UpdateChunk u = update_chunk(table, args);
  const Chunk& c = u.chunk;
  const P* p = chunk_data<const P>(table, kLambNormsParams, c);
  const G* g = chunk_data<const G>(table, kLambNormsGrads, c);
  float* m = chunk_data<float>(table, kLambNormsExpAvgs, c);
  float* v = chunk_data<float>(table, kLambNormsExpAvgSqs, c);
  const LambStepScalars s = lamb_step_scalars(args, u.step.number);
  float p_sq = 0.0f, u_sq = 0.0f;
  for_each_lanes(c.size, all_aligned(p, g, m, v, u.rounding.master), [&](const Lanes& l) {
    float rp[kILP], rg[kILP], rm[kILP], rv[kILP];
    load_param(rp, p, u.rounding, l);
    load(rg, g, l);
    load(rm, m, l);
    load(rv, v, l);
#pragma unroll
    for (int k = 0; k < kILP; ++k) {
      if (!l.active(k)) continue;
      lamb_moments(rp[k], rg[k] * u.inv_scale, rm[k], rv[k], args, s);
      const float d = lamb_direction(rp[k], rm[k], rv[k], args, s);
      p_sq += rp[k] * rp[k];
      u_sq += d * d;
    }
    store(m, rm, l);
    store(v, rv, l);
  });
  // See Note [deterministic sums]: lamb_kernel adds each tensor's partials in chunk order.
  const float p_total = block_sum(p_sq, scratch);
  const float u_total = block_sum(u_sq, scratch);
  if (threadIdx.x == 0) {
    const int chunk = this_blocks_chunk_number(table);
    tensor_scalar<float>(table, kLambNormsParamSqPartials, c)[chunk] = p_total;
    tensor_scalar<float>(table, kLambNormsUpdateSqPartials, c)[chunk] = u_total;
  }
}

template <typename P, typename G>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    lamb_kernel(TensorTable<kLambLists> table, LambArgs args) {
  __shared__ float scratch[kMaxThreadsPerBlock];
  if (step_is_skipped(args.found_inf)) return;  // See Note [found_inf contract]
  const UpdateChunk u = update_chunk(table, args);
  const Chunk& c = u.chunk;
  P* p = chunk_data<P>(table, kLambParams, c);
  const float* m = chunk_data<const float>(table, kLambExpAvgs, c);
  const float* v = chunk_data<const float>(table, kLambExpAvgSqs, c);
  const LambStepScalars s = lamb_step_scalars(args, u.step.number);
  float ratio = 1.0f;
  if (args.trust_ratio) {
    // Every block of the tensor adds the same partials in the same order: the same norms.
    const long long chunks = chunks_of_tensor(table, c);
    const float* p_partials = tensor_scalar<const float>(table, kLambParamSqPartials, c);
    const float* u_partials = tensor_scalar<const float>(table, kLambUpdateSqPartials, c);
    const float p_norm = sqrtf(fixed_order_sum(p_partials, chunks, scratch));
    const float u_norm = sqrtf(fixed_order_sum(u_partials, chunks, scratch));
    if (p_norm > 0.0f && u_norm > 0.0f) ratio = p_norm / u_norm;
  }
  const float step_size = args.lr * ratio;
  for_each_lanes(c.size, all_aligned(p, m, v, u.rounding.master), [&](const Lanes& l) {
    float rp[kILP], rm[kILP], rv[kILP];
    load_param(rp, p, u.rounding, l);
    load(rm, m, l);
    load(rv, v, l);
#pragma unroll
    for (int k = 0; k < kILP; ++k) rp[k] -= step_size * lamb_direction(rp[k], rm[k], rv[k], args, s);
    store_param(p, rp, u.rounding, l);
  });
}
