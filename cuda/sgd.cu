// SGD with momentum, dampening, Nesterov, weight decay and maximize (torch.optim.SGD,
// foreach=False semantics), fused with unscaling and the skip on inf/nan
// (Note [found_inf contract]) and the param rounding options (Note [param rounding]).
#include "blockwise_quant.cuh"
#include "multi_tensor_apply.cuh"

// Mirrored by SgdArgs in scaledoptim/optim/sgd.py.
struct SgdArgs {
  const float* found_inf;  // See Note [found_inf contract]; may be null
  const float* inv_scale;  // may be null: grads are not scaled
  float lr;
  float momentum;             // 0: no momentum buffer (its list holds null pointers)
  float one_minus_dampening;
  float weight_decay;
  int nesterov;
  int maximize;
};

// SgdList: generated from SGD_KERNEL.lists; See Note [list enums] in kernels/sources.py

// One element of SGD in fp32. `g` is already unscaled; `first_step` is true on the first taken
// step, where torch creates the momentum buffer as a copy of the gradient. Without dampening the
// buffer is read as usual: it starts at zero, so `1 * g + buf * momentum` is that copy exactly,
// and a buffer loaded with a step count of 0 is read as torch.optim reads a loaded buffer (as
// SGD.torch_update reads it: both backends take the same step).
__device__ __forceinline__ void sgd_update(float& p, float g, float& buf, bool first_step,
                                           const SgdArgs& a) {
  // Each `x.add(y, alpha=a)` of torch.optim.SGD is one fmaf, as torch's vectorised CPU and CUDA
  // kernels compute it: separate roundings lose the update when p and lr * g nearly cancel.
  if (a.maximize) g = -g;
  if (a.weight_decay != 0.0f) g = fmaf(a.weight_decay, p, g);
  if (a.momentum != 0.0f) {
    buf = first_step && a.one_minus_dampening != 1.0f
              ? g
              : fmaf(a.one_minus_dampening, g, buf * a.momentum);
    g = a.nesterov ? fmaf(a.momentum, buf, g) : buf;
  }
  p = fmaf(-a.lr, g, p);
}

template <typename P, typename G>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    sgd_kernel(TensorTable<kSgdLists> table, SgdArgs args) {
  update_each<P, G, kSgdMomentumBuffers>(table, args, [&](StepCount step) {
    const bool first_step = step.taken == 0.0f;
    return [&, first_step](float& p, float g, float& buf) {
      sgd_update(p, g, buf, first_step, args);
    };
  });
}

// SGD with an 8-bit momentum buffer (state_bits=8; Note [low-bit blocks in a chunk] in
// blockwise_quant.cuh). SgdLowbitList: generated from SGD_LOWBIT_KERNEL.lists.
using LowBitSgdArgs = LowBitArgs<SgdArgs>;

template <typename P, typename G>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    sgd_lowbit_kernel(TensorTable<kSgdLowbitLists> table, LowBitSgdArgs args) {
  update_each_lowbit<
      P, G, LowBitList<kSgdLowbitMomentumBuffersCodes, kSgdLowbitMomentumBuffersScales, SignedCode>>(
      table, args, [&](StepCount step) {
        const bool first_step = step.taken == 0.0f;
        return [&, first_step](float& p, float g, float& buf) {
          sgd_update(p, g, buf, first_step, args.update);
        };
      });
}
