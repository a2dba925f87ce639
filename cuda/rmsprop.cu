// RMSprop (torch.optim.RMSprop, foreach=False semantics): centered, momentum, weight decay and
// maximize, fused with unscaling, the skip on inf/nan (Note [found_inf contract]) and the param
// rounding options (Note [param rounding]).
#include "blockwise_quant.cuh"
#include "multi_tensor_apply.cuh"

// Mirrored by RmspropArgs in scaledoptim/optim/rmsprop.py.
struct RmspropArgs {
  const float* found_inf;  // See Note [found_inf contract]; may be null
  const float* inv_scale;  // may be null: grads are not scaled
  float lr;
  float alpha;
  float one_minus_alpha;  // 1 - alpha rounded once from double, as torch's scalar argument is
  float eps;
  float weight_decay;
  float momentum;  // 0: no momentum buffer (its list holds null pointers)
  int centered;    // 0: no grad_avg (its list holds null pointers)
  int maximize;
};

// RmspropList: generated from RMSPROP_KERNEL.lists; See Note [list enums] in kernels/sources.py

// One element of RMSprop in fp32. `g` is already unscaled.
__device__ __forceinline__ void rmsprop_update(float& p, float g, float& square_avg, float& buf,
                                               float& grad_avg, const RmspropArgs& a) {
  if (a.maximize) g = -g;
  if (a.weight_decay != 0.0f) g = fmaf(a.weight_decay, p, g);  // grad.add(param, alpha=wd)
  // torch's addcmul is fma(value * t1, t2, self); its addcdiv (value * t1) / t2 + self.
  square_avg = fmaf(a.one_minus_alpha * g, g, square_avg * a.alpha);
  float avg;
  if (a.centered) {
    grad_avg = torch_lerp(grad_avg, g, a.one_minus_alpha);  // grad_avg.lerp_(grad, 1 - alpha)
    avg = sqrtf(fmaf(-grad_avg, grad_avg, square_avg));  // square_avg.addcmul(ga, ga, value=-1)
  } else {
    avg = sqrtf(square_avg);
  }
  avg += a.eps;
  if (a.momentum > 0.0f) {
    buf = buf * a.momentum + g / avg;
    p = fmaf(-a.lr, buf, p);  // param.add_(buf, alpha=-lr)
  } else {
    p += (-a.lr * g) / avg;  // param.addcdiv_(grad, avg, value=-lr)
  }
}

template <typename P, typename G>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    rmsprop_kernel(TensorTable<kRmspropLists> table, RmspropArgs args) {
  update_each<P, G, kRmspropSquareAvgs, kRmspropMomentumBuffers, kRmspropGradAvgs>(
      table, args, [&](StepCount) {
        return [&](float& p, float g, float& square_avg, float& buf, float& grad_avg) {
          rmsprop_update(p, g, square_avg, buf, grad_avg, args);
        };
      });
}

// RMSprop with 8-bit states (state_bits=8; Note [low-bit blocks in a chunk] in
// blockwise_quant.cuh). RmspropLowbitList: generated from RMSPROP_LOWBIT_KERNEL.lists.
using LowBitRmspropArgs = LowBitArgs<RmspropArgs>;

template <typename P, typename G>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    rmsprop_lowbit_kernel(TensorTable<kRmspropLowbitLists> table, LowBitRmspropArgs args) {
  update_each_lowbit<
      P, G,
      LowBitList<kRmspropLowbitSquareAvgsCodes, kRmspropLowbitSquareAvgsScales, UnsignedCode>,
      LowBitList<kRmspropLowbitMomentumBuffersCodes, kRmspropLowbitMomentumBuffersScales,
                 SignedCode>,
      LowBitList<kRmspropLowbitGradAvgsCodes, kRmspropLowbitGradAvgsScales, SignedCode>>(
      table, args, [&](StepCount) {
        return [&](float& p, float g, float& square_avg, float& buf, float& grad_avg) {
          rmsprop_update(p, g, square_avg, buf, grad_avg, args.update);
        };
      });
}
