// Adagrad (torch.optim.Adagrad, foreach=False semantics), fused with unscaling, the skip on
// inf/nan (Note [found_inf contract]) and the param rounding options (Note [param rounding]).
#include "multi_tensor_apply.cuh"

// Mirrored by AdagradArgs in scaledoptim/kernels/adagrad.py.
struct AdagradArgs {
  const float* found_inf;  // Note [found_inf contract]; may be null
  const float* inv_scale;  // may be null: grads are not scaled
  float lr;
  float lr_decay;
  float weight_decay;
  float eps;
  int maximize;
};

enum AdagradList { kAdagradParam, kAdagradGrad, kAdagradSum, kAdagradMaster, kAdagradSeed, kAdagradStep, kAdagradLists };

// One element of Adagrad in fp32. `g` is already unscaled; `clr` the decayed learning rate.
__device__ __forceinline__ void adagrad_update(float& p, float g, float& sum, float clr, const AdagradArgs& a) {
  if (a.maximize) g = -g;
  if (a.weight_decay != 0.0f) g = fmaf(a.weight_decay, p, g);  // torch's grad.add(param, alpha=wd)
  sum += g * g;
  const float std = sqrtf(sum) + a.eps;
  p += -clr * (g / std);
}

template <typename P, typename G>
__global__ void adagrad_kernel(TensorTable<kAdagradLists> table, AdagradArgs args) {
  if (step_is_skipped(args.found_inf)) return;  // Note [found_inf contract]
  const Chunk c = this_blocks_chunk(table);
  P* p = chunk_data<P>(table, kAdagradParam, c);
  const G* g = chunk_data<const G>(table, kAdagradGrad, c);
  float* sum = chunk_data<float>(table, kAdagradSum, c);
  const float inv_scale = args.inv_scale ? *args.inv_scale : 1.0f;
  // Note [step counters]: the counter is advanced after this launch; use the new value.
  const float step = *tensor_scalar<const float>(table, kAdagradStep, c) + 1.0f;
  const float clr = args.lr / (1.0f + (step - 1.0f) * args.lr_decay);
  const ParamRounding pr = param_rounding(table, kAdagradMaster, kAdagradSeed, c, step);

  for_each_lanes(c.size, all_aligned(p, g, sum, pr.master), [&](const Lanes& l) {
    float rp[kILP], rg[kILP], rs[kILP];
    load_param(rp, p, pr, l);
    load(rg, g, l);
    load(rs, sum, l);
#pragma unroll
    for (int k = 0; k < kILP; ++k) adagrad_update(rp[k], rg[k] * inv_scale, rs[k], clr, args);
    store_param(p, rp, pr, l);
    store(sum, rs, l);
  });
}
