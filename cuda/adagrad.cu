// Adagrad (torch.optim.Adagrad, foreach=False semantics), fused with unscaling, the skip on
// inf/nan (Note [found_inf contract]) and the param rounding options (Note [param rounding]).
#include "multi_tensor_apply.cuh"

// Mirrored by AdagradArgs in scaledoptim/optim/adagrad.py.
struct AdagradArgs {
  const float* found_inf;  // See Note [found_inf contract]; may be null
  const float* inv_scale;  // may be null: grads are not scaled
  float lr;
  float lr_decay;
  float weight_decay;
  float eps;
  int maximize;
};

// AdagradList: generated from ADAGRAD_KERNEL.lists; See Note [list enums] in kernels/sources.py

// One element of Adagrad in fp32. `g` is already unscaled; `clr` the decayed learning rate.
__device__ __forceinline__ void adagrad_update(float& p, float g, float& sum, float clr, const AdagradArgs& a) {
  if (a.maximize) g = -g;
  if (a.weight_decay != 0.0f) g = fmaf(a.weight_decay, p, g);  // torch's grad.add(param, alpha=wd)
  sum += g * g;
  const float std = sqrtf(sum) + a.eps;
  p += -clr * (g / std);
}

template <typename P, typename G>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    adagrad_kernel(TensorTable<kAdagradLists> table, AdagradArgs args) {
  update_each<P, G, kAdagradStateSums>(table, args, [&](StepCount step) {
    const float clr = args.lr / (1.0f + (step.number - 1.0f) * args.lr_decay);
    return [&, clr](float& p, float g, float& sum) { adagrad_update(p, g, sum, clr, args); };
  });
}
