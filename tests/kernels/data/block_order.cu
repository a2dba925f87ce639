// Records the order in which a launch's blocks run (tests/kernels/test_block_order.py):
// ran[i] is the index of the i-th block to run. The tensor list only sizes the grid.
#include "multi_tensor_apply.cuh"

struct BlockOrderArgs {
  float* ran;
  unsigned* count;  // blocks that ran so far: 0 before the launch
};

__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    block_order_kernel(TensorTable<1> table, BlockOrderArgs args) {
  if (threadIdx.x == 0) args.ran[atomicAdd(args.count, 1u)] = static_cast<float>(blockIdx.x);
}
