// SGD with momentum, dampening, Nesterov, weight decay and maximize (torch.optim.SGD,
// foreach=False semantics), fused with unscaling and the skip on inf/nan
// (Note [found_inf contract]) and the param rounding options (Note [param rounding]).
#include "multi_tensor_apply.cuh"

// Mirrored by SgdArgs in scaledoptim/kernels/builtin.py.
struct SgdArgs {
  const float* found_inf;  // Note [found_inf contract]; may be null
  const float* inv_scale;  // may be null: grads are not scaled
  float lr;
  float momentum;             // 0: no momentum buffer (its list holds null pointers)
  float one_minus_dampening;
  float weight_decay;
  int nesterov;
  int maximize;
};

enum SgdList {
  kSgdParam, kSgdGrad, kSgdMomentumBuffer,
  kSgdMaster, kSgdSeed,  // Note [param rounding]
  kSgdStep, kSgdLists
};

// One element of SGD in fp32. `g` is already unscaled; `first_step` is true on the first taken
// step, where torch creates the momentum buffer as a copy of the gradient.
__device__ __forceinline__ void sgd_update(float& p, float g, float& buf, bool first_step,
                                           const SgdArgs& a) {
  // Each `x.add(y, alpha=a)` of torch.optim.SGD is one fmaf, as torch's vectorised CPU and CUDA
  // kernels compute it: separate roundings lose the update when p and lr * g nearly cancel.
  if (a.maximize) g = -g;
  if (a.weight_decay != 0.0f) g = fmaf(a.weight_decay, p, g);
  if (a.momentum != 0.0f) {
    buf = first_step ? g : fmaf(a.one_minus_dampening, g, buf * a.momentum);
    g = a.nesterov ? fmaf(a.momentum, buf, g) : buf;
  }
  p = fmaf(-a.lr, g, p);
}

template <typename P, typename G>
__global__ void sgd_kernel(TensorTable<kSgdLists> table, SgdArgs args) {
  if (step_is_skipped(args.found_inf)) return;  // Note [found_inf contract]
  const Chunk c = this_blocks_chunk(table);
  P* p = chunk_data<P>(table, kSgdParam, c);
  const G* g = chunk_data<const G>(table, kSgdGrad, c);
  float* buf = args.momentum != 0.0f ? chunk_data<float>(table, kSgdMomentumBuffer, c) : nullptr;
  const float inv_scale = args.inv_scale ? *args.inv_scale : 1.0f;
  // Note [step counters]: still the count before this step.
  const float taken = *tensor_scalar<const float>(table, kSgdStep, c);
  const bool first_step = taken == 0.0f;
  const ParamRounding pr = param_rounding(table, kSgdMaster, kSgdSeed, c, taken + 1.0f);

  for_each_lanes(c.size, all_aligned(p, g, buf, pr.master), [&](const Lanes& l) {
    float rp[kILP], rg[kILP], rbuf[kILP] = {};
    load_param(rp, p, pr, l);
    load(rg, g, l);
    if (buf) load(rbuf, buf, l);
#pragma unroll
    for (int k = 0; k < kILP; ++k) sgd_update(rp[k], rg[k] * inv_scale, rbuf[k], first_step, args);
    store_param(p, rp, pr, l);
    if (buf) store(buf, rbuf, l);
  });
}
