// Batched slot copy / scatter: dst[dst_slot[i]] = src[src_index[i]] (whole slots), skipping
// dst_slot <= 0 (null slot / padding). Grid: (chunks of a slot, n copies). 16-byte vector copies
// when both pointers and slot_bytes allow it.
#include "common.cuh"

namespace hs {
namespace {

template <typename V>
__global__ void slot_copy_kernel(const SlotCopyParams p) {
  const int64_t i = blockIdx.y;
  const int64_t d = p.dst_slot[i];
  if (d <= 0) return;
  const int64_t s = p.src_index[i];
  const int64_t nvec = p.slot_bytes / static_cast<int64_t>(sizeof(V));
  const V* src = reinterpret_cast<const V*>(p.src + s * p.slot_bytes);
  V* dst = reinterpret_cast<V*>(p.dst + d * p.slot_bytes);
  if (src == dst) return;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < nvec;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[e] = src[e];
  }
}

}  // namespace

void launch_slot_copy(const SlotCopyParams& p, cudaStream_t stream) {
  if (p.n <= 0 || p.slot_bytes <= 0) return;
  const bool v16 = (p.slot_bytes % 16 == 0) && (reinterpret_cast<uintptr_t>(p.src) % 16 == 0) &&
                   (reinterpret_cast<uintptr_t>(p.dst) % 16 == 0);
  const int threads = 256;
  const int64_t elems = v16 ? p.slot_bytes / 16 : p.slot_bytes;
  int64_t blocks_x = (elems + threads - 1) / threads;
  if (blocks_x > 1024) blocks_x = 1024;
  // gridDim.y <= 65535: larger batches are split into several launches.
  for (int64_t off = 0; off < p.n; off += 65535) {
    SlotCopyParams q = p;
    q.src_index = p.src_index + off;
    q.dst_slot = p.dst_slot + off;
    const int64_t n = (p.n - off) < 65535 ? (p.n - off) : 65535;
    dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(n));
    if (v16) {
      slot_copy_kernel<uint4><<<grid, threads, 0, stream>>>(q);
    } else {
      slot_copy_kernel<unsigned char><<<grid, threads, 0, stream>>>(q);
    }
  }
}

}  // namespace hs
