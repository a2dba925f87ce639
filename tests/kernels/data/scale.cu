// The kernel of docs/kernels.md: multiplies every element by a host scalar.
#include "multi_tensor_apply.cuh"

struct ScaleArgs {
  float factor;
};

__device__ __forceinline__ float scale(float x, const ScaleArgs& a) { return x * a.factor; }

template <typename T>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    scale_kernel(TensorTable<1> table, ScaleArgs args) {
  const Chunk c = this_blocks_chunk(table);
  T* x = chunk_data<T>(table, 0, c);
  for_each_lanes(c.size, is_aligned(x), [&](const Lanes& l) {
    float r[kILP];
    load(r, x, l);
    for (int k = 0; k < kILP; ++k) r[k] = scale(r[k], args);
    store(x, r, l);
  });
}
