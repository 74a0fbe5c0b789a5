// torch.ops.hybridserve.* : tensor validation, host-side metadata and launches of the CUDA
// kernels in the .cu files beside it. Signatures mirror python/hybridserve/kernels/reference.py (and the
// rejection sampler of python/hybridserve/sampling/rejection.py) argument for argument.
//
// Index tensors (query_start_loc, slots, emits) may live on the CPU or on the GPU. The ops that
// need host metadata (ssd_prefill, causal_conv1d_prefill, copy_slots) copy them to the host; the
// decode ops (selective_state_update, causal_conv1d_update) validate row lengths only when
// query_start_loc is on the CPU, so a GPU-resident batch never forces a host sync.
#include <ATen/ATen.h>
#include <torch/library.h>
#ifndef HS_EMULATE
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <unordered_set>
#include <vector>

#include "kernels.h"

// HS_EMULATE (tests/kernels/test_cuda_emulated.py only): the same ops on CPU tensors, registered as
// torch.ops.hybridserve_emu.*, with the kernels run by the CPU emulation of tests/cuda_emu.
#ifdef HS_EMULATE
#define HS_NS hybridserve_emu
#define HS_KEY CPU
#define HS_ON_DEVICE(t) ((t).is_cpu())
#define HS_GUARD(d) (void)(d)
#define HS_STREAM() static_cast<cudaStream_t>(nullptr)
#else
#define HS_NS hybridserve
#define HS_KEY CUDA
#define HS_ON_DEVICE(t) ((t).is_cuda())
#define HS_GUARD(d) const c10::cuda::CUDAGuard hs_device_guard_(d)
#define HS_STREAM() static_cast<cudaStream_t>(at::cuda::getCurrentCUDAStream())
#endif
#define HS_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define HS_TORCH_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

namespace {

using at::Tensor;

hs::DType to_hs(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return hs::DType::F32;
    case at::kHalf:
      return hs::DType::F16;
    case at::kBFloat16:
      return hs::DType::BF16;
    default:
      TORCH_CHECK(false, "hybridserve CUDA ops support float32/float16/bfloat16 activations, got ", t);
  }
  return hs::DType::F32;
}

// The innermost dim contiguous (a strided view of a wider projection is fine), in dtype `dt`.
Tensor inner_contig(const Tensor& t, at::ScalarType dt) {
  Tensor r = t.scalar_type() == dt ? t : t.to(dt);
  if (r.dim() > 0 && r.stride(-1) != 1) r = r.contiguous();
  return r;
}

Tensor f32_param(const Tensor& t, const Tensor& like) {
  return t.to(like.device(), at::kFloat).contiguous();
}

Tensor dev_long(const Tensor& t, const Tensor& like) {
  return t.to(like.device(), at::kLong).contiguous();
}

Tensor cpu_long(const Tensor& t) {
  return t.to(at::kCPU, at::kLong).contiguous();
}

// Row lengths from a CPU query_start_loc, validated against the token count.
std::vector<int64_t> row_lengths(const Tensor& qsl_cpu, int64_t T) {
  const int64_t R = qsl_cpu.numel() - 1;
  const int64_t* q = qsl_cpu.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(q[0] == 0, "query_start_loc must start at 0");
  std::vector<int64_t> len(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    len[r] = q[r + 1] - q[r];
    TORCH_CHECK_VALUE(len[r] >= 0, "query_start_loc must be non-decreasing");
  }
  TORCH_CHECK_VALUE(q[R] <= T, "query_start_loc[-1] = ", q[R], " exceeds the number of tokens ", T);
  return len;
}

void check_state(const Tensor& s, const Tensor& x, const char* name) {
  TORCH_CHECK(HS_ON_DEVICE(s) && s.device() == x.device(), name, " must be on the device of x");
  TORCH_CHECK(s.is_contiguous(), name, " must be contiguous");
}

void scatter_slots(const Tensor& src_buf, const Tensor& dst_state, const std::vector<int64_t>& src_index,
                   const std::vector<int64_t>& dst_slot, int64_t slot_bytes) {
  if (src_index.empty()) return;
  const int64_t n = static_cast<int64_t>(src_index.size());
  Tensor idx = at::empty({2, n}, at::TensorOptions().dtype(at::kLong));
  std::copy(src_index.begin(), src_index.end(), idx.data_ptr<int64_t>());
  std::copy(dst_slot.begin(), dst_slot.end(), idx.data_ptr<int64_t>() + n);
  Tensor d = idx.to(dst_state.device());
  hs::SlotCopyParams p{};
  p.src = static_cast<const char*>(src_buf.data_ptr());
  p.dst = static_cast<char*>(dst_state.data_ptr());
  p.src_index = d.data_ptr<int64_t>();
  p.dst_slot = d.data_ptr<int64_t>() + n;
  p.n = n;
  p.slot_bytes = slot_bytes;
  hs::launch_slot_copy(p, HS_STREAM());
}

// dt clamp bounds as float: anything beyond the float range (1e300, inf) is "no bound".
float as_bound(double v) {
  if (v >= 3.4028234663852886e38) return INFINITY;
  if (v <= -3.4028234663852886e38) return -INFINITY;
  return static_cast<float>(v);
}

void check_launch() {
  const cudaError_t e = cudaGetLastError();
  TORCH_CHECK(e == cudaSuccess, "hybridserve kernel launch failed: ", cudaGetErrorString(e));
}

// ------------------------------------------------------------------------------------------------
// The inputs the SSD scan and the state update share, laid out alike for both kernels; the
// tensors own the memory that fill_ssm_inputs points the kernel parameters at.
struct SsmInputs {
  Tensor x, dt, B, C, A, D, dt_bias;
};

SsmInputs ssm_inputs(const Tensor& x, const Tensor& dt, const Tensor& B, const Tensor& C, const Tensor& A,
                     const Tensor& D, const Tensor& dt_bias) {
  const at::ScalarType xt = x.scalar_type();
  return {inner_contig(x, xt), inner_contig(dt, dt.scalar_type() == at::kFloat ? at::kFloat : xt),
          inner_contig(B, xt), inner_contig(C, xt), f32_param(A, x), f32_param(D, x), f32_param(dt_bias, x)};
}

// hs::SsdParams and hs::SsuParams name these fields alike.
template <typename Params>
void fill_ssm_inputs(Params& p, const SsmInputs& in, const Tensor& ssm_state, double dt_min, double dt_max) {
  p.x = in.x.data_ptr();
  p.x_st = in.x.stride(0);
  p.x_sh = in.x.stride(1);
  p.dt = in.dt.data_ptr();
  p.dt_st = in.dt.stride(0);
  p.dt_sh = in.dt.stride(1);
  p.B = in.B.data_ptr();
  p.b_st = in.B.stride(0);
  p.b_sg = in.B.stride(1);
  p.C = in.C.data_ptr();
  p.c_st = in.C.stride(0);
  p.c_sg = in.C.stride(1);
  p.A = in.A.data_ptr<float>();
  p.D = in.D.data_ptr<float>();
  p.dt_bias = in.dt_bias.data_ptr<float>();
  p.state = ssm_state.data_ptr<float>();
  p.dt_min = as_bound(dt_min);
  p.dt_max = as_bound(dt_max);
  p.x_dtype = to_hs(in.x.scalar_type());
  p.dt_f32 = in.dt.scalar_type() == at::kFloat;
}

Tensor ssd_prefill(const Tensor& x, const Tensor& dt, const Tensor& A, const Tensor& B, const Tensor& C,
                   const Tensor& D, const Tensor& dt_bias, Tensor ssm_state, const Tensor& query_start_loc,
                   const Tensor& num_computed_tokens, const Tensor& read_slot, const Tensor& has_initial_state,
                   const Tensor& write_slot, const Tensor& emit_row, const Tensor& emit_token,
                   const Tensor& emit_slot, int64_t chunk_size, double dt_min, double dt_max) {
  TORCH_CHECK(HS_ON_DEVICE(x) && x.dim() == 3, "x must be a CUDA tensor [T, H, P]");
  HS_GUARD(x.device());
  const int64_t T = x.size(0), H = x.size(1), P = x.size(2);
  TORCH_CHECK(B.dim() == 3 && C.dim() == 3 && B.sizes() == C.sizes(), "B and C must be [T, G, N]");
  const int64_t G = B.size(1), N = B.size(2);
  TORCH_CHECK_VALUE(G > 0 && H % G == 0, "nheads ", H, " not divisible by ngroups ", G);
  TORCH_CHECK(ssm_state.scalar_type() == at::kFloat, "CUDA ssd_prefill needs a float32 ssm_state");
  check_state(ssm_state, x, "ssm_state");
  TORCH_CHECK(ssm_state.dim() == 4 && ssm_state.size(1) == H && ssm_state.size(2) == P && ssm_state.size(3) == N,
              "ssm_state must be [num_slots, H, P, N]");
  const int64_t R = query_start_loc.numel() - 1;
  if (T == 0 || R <= 0) return at::empty_like(x);
  const int64_t Q = chunk_size;
  TORCH_CHECK_VALUE(Q >= 1 && Q <= 1024, "chunk_size must be in [1, 1024]");

  Tensor qsl = cpu_long(query_start_loc);
  Tensor nct = cpu_long(num_computed_tokens);
  const std::vector<int64_t> len = row_lengths(qsl, T);
  const int64_t* q = qsl.data_ptr<int64_t>();
  const int64_t* nc = nct.data_ptr<int64_t>();

  // emits, validated, and per row the sorted tokens they end at
  const int64_t E = emit_row.numel();
  std::vector<int64_t> em_row, em_tok, em_dst;
  std::vector<std::vector<int64_t>> row_emits(static_cast<size_t>(R));
  if (E > 0) {
    Tensor er = cpu_long(emit_row), et = cpu_long(emit_token), es = cpu_long(emit_slot);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r = er.data_ptr<int64_t>()[e], t = et.data_ptr<int64_t>()[e];
      TORCH_CHECK_VALUE(r >= 0 && r < R, "emit_row out of range");
      TORCH_CHECK_VALUE(t >= 0 && t < len[r], "emit_token out of range of its row");
      em_row.push_back(r);
      em_tok.push_back(t);
      em_dst.push_back(es.data_ptr<int64_t>()[e]);
      row_emits[r].push_back(t);
    }
    for (auto& v : row_emits) {
      std::sort(v.begin(), v.end());
      v.erase(std::unique(v.begin(), v.end()), v.end());
    }
  }

  // chunk metadata: boundaries at absolute multiples of Q, and right after every emitted token,
  // so that each emitted state is the state after a chunk (the kernels index a chunk's tokens
  // from its start, so a chunk need not start or end at a multiple of Q)
  std::vector<int64_t> cstart, clen, rco(static_cast<size_t>(R + 1));
  for (int64_t r = 0; r < R; ++r) {
    rco[r] = static_cast<int64_t>(cstart.size());
    TORCH_CHECK_VALUE(nc[r] >= 0, "num_computed_tokens must be >= 0");
    auto next_emit = row_emits[r].begin();
    for (int64_t i = 0; i < len[r];) {
      const int64_t abs = nc[r] + i;
      int64_t l = std::min(Q - abs % Q, len[r] - i);
      while (next_emit != row_emits[r].end() && *next_emit < i) ++next_emit;
      if (next_emit != row_emits[r].end()) l = std::min(l, *next_emit - i + 1);
      cstart.push_back(q[r] + i);
      clen.push_back(l);
      i += l;
    }
  }
  const int64_t NC = static_cast<int64_t>(cstart.size());
  rco[R] = NC;
  TORCH_CHECK(NC <= 65535, "ssd_prefill: too many chunks in one call (", NC, ")");

  // state writes: finals first, then emits (src index into the `states` scratch: after state
  // passing, states[c + 1] holds the state entering chunk c + 1, i.e. the state after chunk c)
  Tensor ws = cpu_long(write_slot);
  std::vector<int64_t> fin_src, fin_dst, em_src;
  for (int64_t r = 0; r < R; ++r) {
    if (len[r] > 0) {
      fin_src.push_back(NC + r);
      fin_dst.push_back(ws.data_ptr<int64_t>()[r]);
    }
  }
  for (size_t e = 0; e < em_row.size(); ++e) {
    const int64_t r = em_row[e];
    // the chunk of the row that ends at the emitted token (the last one starting at or before it)
    const auto first = cstart.begin() + rco[r], stop = cstart.begin() + rco[r + 1];
    const int64_t ce = (std::upper_bound(first, stop, q[r] + em_tok[e]) - cstart.begin()) - 1;
    em_src.push_back(ce == rco[r + 1] - 1 ? NC + r : ce + 1);
  }

  Tensor meta_cpu = at::empty({2 * NC + R + 1}, at::TensorOptions().dtype(at::kLong));
  int64_t* m = meta_cpu.data_ptr<int64_t>();
  std::copy(cstart.begin(), cstart.end(), m);
  std::copy(clen.begin(), clen.end(), m + NC);
  std::copy(rco.begin(), rco.end(), m + 2 * NC);
  Tensor meta = meta_cpu.to(x.device());

  const SsmInputs in = ssm_inputs(x, dt, B, C, A, D, dt_bias);
  Tensor rs = dev_long(read_slot, x), hi = dev_long(has_initial_state, x);
  auto fopt = x.options().dtype(at::kFloat);
  Tensor dtp = at::empty({T, H}, fopt), lam = at::empty({T, H}, fopt);
  Tensor cb = at::empty({NC, G, Q, Q}, fopt);
  Tensor states = at::empty({NC + R, H, P, N}, fopt);
  Tensor out = at::empty({T, H, P}, x.options());

  hs::SsdParams p{};
  fill_ssm_inputs(p, in, ssm_state, dt_min, dt_max);
  p.out = out.data_ptr();
  p.chunk_start = meta.data_ptr<int64_t>();
  p.chunk_len = meta.data_ptr<int64_t>() + NC;
  p.row_chunk_off = meta.data_ptr<int64_t>() + 2 * NC;
  p.read_slot = rs.data_ptr<int64_t>();
  p.has_init = hi.data_ptr<int64_t>();
  p.dtp = dtp.data_ptr<float>();
  p.lam = lam.data_ptr<float>();
  p.cb = cb.data_ptr<float>();
  p.states = states.data_ptr<float>();
  p.T = static_cast<int>(T);
  p.H = static_cast<int>(H);
  p.P = static_cast<int>(P);
  p.N = static_cast<int>(N);
  p.G = static_cast<int>(G);
  p.R = static_cast<int>(R);
  p.NC = static_cast<int>(NC);
  p.Q = static_cast<int>(Q);
  hs::launch_ssd(p, HS_STREAM());
  check_launch();
  const int64_t slot_bytes = H * P * N * 4;
  scatter_slots(states, ssm_state, fin_src, fin_dst, slot_bytes);
  scatter_slots(states, ssm_state, em_src, em_dst, slot_bytes);
  check_launch();
  return out;
}

// ------------------------------------------------------------------------------------------------
Tensor selective_state_update(const Tensor& x, const Tensor& dt, const Tensor& A, const Tensor& B, const Tensor& C,
                              const Tensor& D, const Tensor& dt_bias, Tensor ssm_state,
                              const Tensor& query_start_loc, const Tensor& read_slot, const Tensor& write_slots,
                              double dt_min, double dt_max) {
  TORCH_CHECK(HS_ON_DEVICE(x) && x.dim() == 3, "x must be a CUDA tensor [T, H, P]");
  HS_GUARD(x.device());
  const int64_t T = x.size(0), H = x.size(1), P = x.size(2);
  TORCH_CHECK(B.dim() == 3 && C.dim() == 3 && B.sizes() == C.sizes(), "B and C must be [T, G, N]");
  const int64_t G = B.size(1), N = B.size(2);
  TORCH_CHECK_VALUE(G > 0 && H % G == 0, "nheads ", H, " not divisible by ngroups ", G);
  TORCH_CHECK(N <= 256, "CUDA selective_state_update supports dstate <= 256");
  TORCH_CHECK(ssm_state.scalar_type() == at::kFloat, "CUDA selective_state_update needs a float32 ssm_state");
  check_state(ssm_state, x, "ssm_state");
  TORCH_CHECK(ssm_state.dim() == 4 && ssm_state.size(1) == H && ssm_state.size(2) == P && ssm_state.size(3) == N,
              "ssm_state must be [num_slots, H, P, N]");
  TORCH_CHECK(write_slots.dim() == 2, "write_slots must be [R, W]");
  const int64_t R = query_start_loc.numel() - 1;
  if (T == 0 || R <= 0) return at::empty_like(x);
  TORCH_CHECK(R <= 65535, "selective_state_update: at most 65535 rows per call");
  if (!query_start_loc.is_cuda()) {
    const std::vector<int64_t> len = row_lengths(cpu_long(query_start_loc), T);
    const int64_t lmax = len.empty() ? 0 : *std::max_element(len.begin(), len.end());
    TORCH_CHECK_VALUE(lmax <= write_slots.size(1), "a row has ", lmax, " tokens but write_slots has only ",
                      write_slots.size(1), " columns");
  }
  const SsmInputs in = ssm_inputs(x, dt, B, C, A, D, dt_bias);
  Tensor qsl = dev_long(query_start_loc, x), rs = dev_long(read_slot, x), ws = dev_long(write_slots, x);
  Tensor out = at::empty({T, H, P}, x.options());
  hs::SsuParams p{};
  fill_ssm_inputs(p, in, ssm_state, dt_min, dt_max);
  p.qsl = qsl.data_ptr<int64_t>();
  p.read_slot = rs.data_ptr<int64_t>();
  p.write_slots = ws.data_ptr<int64_t>();
  p.ws_sr = ws.stride(0);
  p.ws_w = ws.stride(1);
  p.out = out.data_ptr();
  p.T = static_cast<int>(T);
  p.H = static_cast<int>(H);
  p.P = static_cast<int>(P);
  p.N = static_cast<int>(N);
  p.G = static_cast<int>(G);
  p.R = static_cast<int>(R);
  hs::launch_ssu(p, HS_STREAM());
  check_launch();
  return out;
}

// ------------------------------------------------------------------------------------------------
// The Mamba1 selective scan (kernels/selective_scan.py is its twin). Rows, tokens and slots are
// validated on the host before the launch (the write lists come from the host anyway).
Tensor mamba1_scan(const Tensor& x, const Tensor& dt, const Tensor& A, const Tensor& B, const Tensor& C,
                   const Tensor& D, Tensor ssm_state, const Tensor& query_start_loc, const Tensor& read_slot,
                   const std::optional<Tensor>& has_initial_state, const Tensor& write_row,
                   const Tensor& write_token, const Tensor& write_slot) {
  TORCH_CHECK(HS_ON_DEVICE(x) && x.dim() == 2, "x must be a CUDA tensor [T, Dc]");
  HS_GUARD(x.device());
  const int64_t T = x.size(0), Dc = x.size(1);
  TORCH_CHECK(ssm_state.scalar_type() == at::kFloat, "CUDA mamba1_scan needs a float32 ssm_state");
  check_state(ssm_state, x, "ssm_state");
  TORCH_CHECK(ssm_state.dim() == 3 && ssm_state.size(1) == Dc, "ssm_state must be [num_slots, Dc, N]");
  const int64_t N = ssm_state.size(2), S = ssm_state.size(0);
  TORCH_CHECK(N <= 128, "CUDA mamba1_scan supports d_state <= 128");
  TORCH_CHECK(dt.sizes() == x.sizes(), "dt must be [T, Dc]");
  TORCH_CHECK(B.dim() == 2 && C.dim() == 2 && B.size(0) == T && B.size(1) == N && C.sizes() == B.sizes(),
              "B and C must be [T, N]");
  TORCH_CHECK(A.dim() == 2 && A.size(0) == Dc && A.size(1) == N && D.numel() == Dc, "A must be [Dc, N], D [Dc]");
  const int64_t R = query_start_loc.numel() - 1;
  Tensor out = at::empty({T, Dc}, x.options().dtype(at::kFloat));
  if (T == 0 || R <= 0) return out.to(x.scalar_type());
  TORCH_CHECK(R <= 65535, "mamba1_scan: at most 65535 rows per call");
  // host checks: row lengths, slots in range, each row's writes sorted by token (CSR offsets)
  const Tensor q = cpu_long(query_start_loc), rsl = cpu_long(read_slot), wr = cpu_long(write_row),
               wt = cpu_long(write_token), ws = cpu_long(write_slot);
  const std::vector<int64_t> len = row_lengths(q, T);
  TORCH_CHECK_VALUE(q.data_ptr<int64_t>()[R] == T, "query_start_loc must end at the token count");
  TORCH_CHECK(rsl.numel() == R, "read_slot must have one entry per row");
  std::optional<Tensor> hi;
  if (has_initial_state.has_value()) {
    TORCH_CHECK(has_initial_state->numel() == R, "has_initial_state must have one entry per row");
    hi = cpu_long(*has_initial_state);
  }
  const int64_t E = wr.numel();
  TORCH_CHECK(wt.numel() == E && ws.numel() == E, "write_row, write_token and write_slot must have one length");
  Tensor offsets = at::zeros({R + 1}, at::TensorOptions().dtype(at::kLong));
  int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    const bool reads = !hi.has_value() || hi->data_ptr<int64_t>()[r] != 0;
    const int64_t s = rsl.data_ptr<int64_t>()[r];
    TORCH_CHECK_VALUE(!reads || (s >= 0 && s < S), "read_slot ", s, " out of range [0, ", S, ")");
  }
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r = wr.data_ptr<int64_t>()[e], t = wt.data_ptr<int64_t>()[e], s = ws.data_ptr<int64_t>()[e];
    TORCH_CHECK_VALUE(r >= 0 && r < R && t >= 0 && t < len[r] && s >= 0 && s < S,
                      "a write (row ", r, ", token ", t, ", slot ", s, ") is out of range");
    TORCH_CHECK_VALUE(e == 0 || r > wr.data_ptr<int64_t>()[e - 1] ||
                          (r == wr.data_ptr<int64_t>()[e - 1] && t >= wt.data_ptr<int64_t>()[e - 1]),
                      "writes must be sorted by row, then token");
    off[r + 1] += 1;
  }
  for (int64_t r = 0; r < R; ++r) off[r + 1] += off[r];
  const Tensor xf = inner_contig(x, at::kFloat), dtf = inner_contig(dt, at::kFloat), bf = inner_contig(B, at::kFloat),
               cf = inner_contig(C, at::kFloat), af = f32_param(A, x), df = f32_param(D, x);
  const Tensor qd = dev_long(q, x), rd = dev_long(rsl, x), od = dev_long(offsets, x), td = dev_long(wt, x),
               sd = dev_long(ws, x);
  std::optional<Tensor> hd;
  if (hi.has_value()) hd = dev_long(*hi, x);
  hs::Mamba1Params p{};
  p.x = xf.data_ptr<float>();
  p.x_st = xf.stride(0);
  p.dt = dtf.data_ptr<float>();
  p.dt_st = dtf.stride(0);
  p.B = bf.data_ptr<float>();
  p.b_st = bf.stride(0);
  p.C = cf.data_ptr<float>();
  p.c_st = cf.stride(0);
  p.A = af.data_ptr<float>();
  p.D = df.data_ptr<float>();
  p.state = ssm_state.data_ptr<float>();
  p.qsl = qd.data_ptr<int64_t>();
  p.read_slot = rd.data_ptr<int64_t>();
  p.has_init = hd ? hd->data_ptr<int64_t>() : nullptr;
  p.write_offsets = od.data_ptr<int64_t>();
  p.write_token = td.data_ptr<int64_t>();
  p.write_slot = sd.data_ptr<int64_t>();
  p.out = out.data_ptr<float>();
  p.T = static_cast<int>(T);
  p.Dc = static_cast<int>(Dc);
  p.N = static_cast<int>(N);
  p.R = static_cast<int>(R);
  hs::launch_mamba1(p, HS_STREAM());
  check_launch();
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// ------------------------------------------------------------------------------------------------
bool want_silu(const std::optional<c10::string_view>& activation) {
  if (!activation.has_value()) return false;
  const std::string a(activation->data(), activation->size());
  TORCH_CHECK_VALUE(a == "silu" || a == "swish", "unsupported conv activation '", a, "'");
  return true;
}

void conv_common(hs::ConvParams& p, const Tensor& xx, const Tensor& w, const std::optional<Tensor>& bias_f,
                 const Tensor& conv_state, const Tensor& out) {
  p.x = xx.data_ptr();
  p.x_st = xx.stride(0);
  p.weight = w.data_ptr();
  p.bias = bias_f.has_value() ? bias_f->data_ptr() : nullptr;
  p.conv_state = conv_state.data_ptr();
  p.out = out.data_ptr();
  p.T = static_cast<int>(xx.size(0));
  p.Dc = static_cast<int>(xx.size(1));
  p.W = static_cast<int>(w.size(1));
  p.x_dtype = to_hs(xx.scalar_type());
  p.state_dtype = to_hs(conv_state.scalar_type());
}

void check_conv(const Tensor& x, const Tensor& weight, const Tensor& conv_state) {
  TORCH_CHECK(HS_ON_DEVICE(x) && x.dim() == 2, "x must be a CUDA tensor [T, conv_dim]");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == x.size(1), "weight must be [conv_dim, W]");
  const int64_t W = weight.size(1);
  TORCH_CHECK(W >= 2 && W <= 8, "CUDA conv1d supports kernel widths 2..8");
  check_state(conv_state, x, "conv_state");
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(1) == x.size(1) && conv_state.size(2) == W - 1,
              "conv_state must be [num_slots, conv_dim, W - 1]");
}

Tensor causal_conv1d_prefill(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                             Tensor conv_state, const Tensor& query_start_loc, const Tensor& read_slot,
                             const Tensor& has_initial_state, const Tensor& write_slot, const Tensor& emit_row,
                             const Tensor& emit_token, const Tensor& emit_slot,
                             std::optional<c10::string_view> activation) {
  check_conv(x, weight, conv_state);
  HS_GUARD(x.device());
  const bool silu = want_silu(activation);
  const int64_t T = x.size(0), Dc = x.size(1), W = weight.size(1);
  const int64_t R = query_start_loc.numel() - 1;
  if (T == 0 || R <= 0) return at::empty_like(x);
  Tensor qsl_c = cpu_long(query_start_loc);
  const std::vector<int64_t> len = row_lengths(qsl_c, T);
  Tensor ws = cpu_long(write_slot);
  std::vector<int64_t> grow, gtok, fin_dst, em_dst;
  for (int64_t r = 0; r < R; ++r) {
    if (len[r] > 0) {
      grow.push_back(r);
      gtok.push_back(len[r] - 1);
      fin_dst.push_back(ws.data_ptr<int64_t>()[r]);
    }
  }
  const int64_t E = emit_row.numel();
  if (E > 0) {
    Tensor er = cpu_long(emit_row), et = cpu_long(emit_token), es = cpu_long(emit_slot);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r = er.data_ptr<int64_t>()[e], t = et.data_ptr<int64_t>()[e];
      TORCH_CHECK_VALUE(r >= 0 && r < R, "emit_row out of range");
      TORCH_CHECK_VALUE(t >= 0 && t < len[r], "emit_token out of range of its row");
      grow.push_back(r);
      gtok.push_back(t);
      em_dst.push_back(es.data_ptr<int64_t>()[e]);
    }
  }
  const int64_t NG = static_cast<int64_t>(grow.size());
  TORCH_CHECK(NG <= 65535, "causal_conv1d_prefill: too many state writes in one call");
  Tensor gmeta_c = at::empty({2 * NG + R + 1}, at::TensorOptions().dtype(at::kLong));
  std::copy(grow.begin(), grow.end(), gmeta_c.data_ptr<int64_t>());
  std::copy(gtok.begin(), gtok.end(), gmeta_c.data_ptr<int64_t>() + NG);
  std::copy(qsl_c.data_ptr<int64_t>(), qsl_c.data_ptr<int64_t>() + R + 1, gmeta_c.data_ptr<int64_t>() + 2 * NG);
  Tensor gmeta = gmeta_c.to(x.device());

  Tensor xx = inner_contig(x, x.scalar_type());
  Tensor w = f32_param(weight, x);
  std::optional<Tensor> bf;
  if (bias.has_value()) bf = f32_param(*bias, x);
  Tensor rs = dev_long(read_slot, x), hi = dev_long(has_initial_state, x);
  Tensor out = at::empty({T, Dc}, x.options());
  Tensor gathered = at::empty({std::max<int64_t>(NG, 1), Dc, W - 1}, conv_state.options());
  hs::ConvParams p{};
  conv_common(p, xx, w, bf, conv_state, out);
  p.qsl = gmeta.data_ptr<int64_t>() + 2 * NG;
  p.read_slot = rs.data_ptr<int64_t>();
  p.has_init = hi.data_ptr<int64_t>();
  p.R = static_cast<int>(R);
  p.silu = silu;
  p.gather_row = gmeta.data_ptr<int64_t>();
  p.gather_tok = gmeta.data_ptr<int64_t>() + NG;
  p.gather_out = gathered.data_ptr();
  p.n_gather = static_cast<int>(NG);
  hs::launch_conv_prefill(p, HS_STREAM());
  check_launch();
  const int64_t slot_bytes = Dc * (W - 1) * conv_state.element_size();
  std::vector<int64_t> fin_src(fin_dst.size()), em_src(em_dst.size());
  for (size_t i = 0; i < fin_src.size(); ++i) fin_src[i] = static_cast<int64_t>(i);
  for (size_t i = 0; i < em_src.size(); ++i) em_src[i] = static_cast<int64_t>(fin_src.size() + i);
  scatter_slots(gathered, conv_state, fin_src, fin_dst, slot_bytes);
  scatter_slots(gathered, conv_state, em_src, em_dst, slot_bytes);
  check_launch();
  return out;
}

Tensor causal_conv1d_update(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                            Tensor conv_state, const Tensor& query_start_loc, const Tensor& read_slot,
                            const Tensor& write_slots, std::optional<c10::string_view> activation) {
  check_conv(x, weight, conv_state);
  HS_GUARD(x.device());
  const bool silu = want_silu(activation);
  const int64_t T = x.size(0), Dc = x.size(1);
  const int64_t R = query_start_loc.numel() - 1;
  TORCH_CHECK(write_slots.dim() == 2, "write_slots must be [R, W]");
  if (T == 0 || R <= 0) return at::empty_like(x);
  TORCH_CHECK(R <= 65535, "causal_conv1d_update: at most 65535 rows per call");
  if (!query_start_loc.is_cuda()) {
    const std::vector<int64_t> len = row_lengths(cpu_long(query_start_loc), T);
    const int64_t lmax = len.empty() ? 0 : *std::max_element(len.begin(), len.end());
    TORCH_CHECK_VALUE(lmax <= write_slots.size(1), "a row has ", lmax, " tokens but write_slots has only ",
                      write_slots.size(1), " columns");
  }
  Tensor xx = inner_contig(x, x.scalar_type());
  Tensor w = f32_param(weight, x);
  std::optional<Tensor> bf;
  if (bias.has_value()) bf = f32_param(*bias, x);
  Tensor qsl = dev_long(query_start_loc, x), rs = dev_long(read_slot, x), ws = dev_long(write_slots, x);
  Tensor out = at::empty({T, Dc}, x.options());
  hs::ConvParams p{};
  conv_common(p, xx, w, bf, conv_state, out);
  p.qsl = qsl.data_ptr<int64_t>();
  p.read_slot = rs.data_ptr<int64_t>();
  p.write_slots = ws.data_ptr<int64_t>();
  p.ws_sr = ws.stride(0);
  p.ws_w = ws.stride(1);
  p.R = static_cast<int>(R);
  p.silu = silu;
  hs::launch_conv_update(p, HS_STREAM());
  check_launch();
  return out;
}

// ------------------------------------------------------------------------------------------------
void copy_slots(Tensor state, const Tensor& src, const Tensor& dst) {
  TORCH_CHECK(HS_ON_DEVICE(state) && state.is_contiguous(), "state must be a contiguous CUDA tensor");
  HS_GUARD(state.device());
  const int64_t n = src.numel();
  TORCH_CHECK_VALUE(dst.numel() == n, "src and dst must have the same length");
  if (n == 0 || state.size(0) == 0) return;
  Tensor s = cpu_long(src), d = cpu_long(dst);
  std::vector<int64_t> sv, dv;
  const int64_t S = state.size(0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t a = s.data_ptr<int64_t>()[i], b = d.data_ptr<int64_t>()[i];
    TORCH_CHECK_VALUE(a >= 0 && a < S && b >= 0 && b < S, "slot index out of range");
    if (b != 0 && a != b) {
      sv.push_back(a);
      dv.push_back(b);
    }
  }
  if (sv.empty()) return;
  const int64_t slot_bytes = state.numel() / S * state.element_size();
  // Sequential semantics: split into runs in which no slot is both read and written and no dst
  // repeats; each run is one batched launch (the usual case is a single run).
  size_t begin = 0;
  while (begin < sv.size()) {
    std::unordered_set<int64_t> dsts, srcs;
    size_t end = begin;
    while (end < sv.size() && !dsts.count(sv[end]) && !dsts.count(dv[end]) && !srcs.count(dv[end])) {
      dsts.insert(dv[end]);
      srcs.insert(sv[end]);
      ++end;
    }
    std::vector<int64_t> rs(sv.begin() + begin, sv.begin() + end), rd(dv.begin() + begin, dv.begin() + end);
    scatter_slots(state, state, rs, rd, slot_bytes);
    begin = end;
  }
  check_launch();
}

// ------------------------------------------------------------------------------------------------
std::tuple<Tensor, Tensor> rejection_sample(const Tensor& target_probs, const std::optional<Tensor>& target_logits,
                                            const Tensor& draft_token_ids, const Tensor& num_draft_tokens,
                                            const Tensor& is_greedy, const std::optional<Tensor>& draft_probs,
                                            const std::optional<Tensor>& uniforms, const std::optional<Tensor>& noise,
                                            const Tensor& seeds, const Tensor& offsets) {
  TORCH_CHECK(HS_ON_DEVICE(target_probs) && target_probs.dim() == 2, "target_probs must be a CUDA tensor [M, V]");
  TORCH_CHECK(target_probs.scalar_type() == at::kFloat, "CUDA rejection_sample needs float32 probabilities");
  HS_GUARD(target_probs.device());
  const Tensor& like = target_probs;
  const int64_t M = target_probs.size(0), V = target_probs.size(1);
  const int64_t R = num_draft_tokens.numel();
  TORCH_CHECK(V > 0 && V <= (int64_t{1} << 26), "the vocabulary must have between 1 and 2^26 entries");
  if (num_draft_tokens.is_cpu()) {  // (counts on the device are trusted: checking them would sync)
    const int64_t rows = num_draft_tokens.to(at::kLong).sum().item<int64_t>() + R;
    TORCH_CHECK_VALUE(rows == M, "target_probs has ", M, " rows, but the drafts need sum(k + 1) = ", rows);
  }
  Tensor probs = inner_contig(target_probs, at::kFloat);
  Tensor k = dev_long(num_draft_tokens, like);
  Tensor out_tokens = at::empty({M}, like.options().dtype(at::kLong));
  Tensor out_acc = at::empty({R}, like.options().dtype(at::kLong));
  if (R == 0) return {out_tokens, out_acc};
  Tensor drafts = dev_long(draft_token_ids, like);
  Tensor greedy = is_greedy.to(like.device(), at::kBool).contiguous();
  Tensor sd = dev_long(seeds, like), off = dev_long(offsets, like);
  std::optional<Tensor> lg, dp, un, nz;
  if (target_logits.has_value()) {
    TORCH_CHECK(target_logits->sizes() == target_probs.sizes(), "target_logits must match target_probs");
    lg = inner_contig(target_logits->to(like.device()), at::kFloat);
  }
  if (draft_probs.has_value()) {
    TORCH_CHECK(draft_probs->dim() == 2 && draft_probs->size(0) == drafts.numel() && draft_probs->size(1) == V,
                "draft_probs must be [sum k, V]");
    dp = inner_contig(draft_probs->to(like.device()), at::kFloat);
  }
  if (uniforms.has_value()) {
    TORCH_CHECK(uniforms->numel() == drafts.numel(), "uniforms must have one entry per draft token");
    un = uniforms->to(like.device(), at::kFloat).contiguous();
  }
  if (noise.has_value()) {
    TORCH_CHECK(noise->dim() == 2 && noise->size(0) == R && noise->size(1) == V, "noise must be [R, V]");
    nz = inner_contig(noise->to(like.device()), at::kFloat);
  }
  hs::RejectionParams p{};
  p.probs = probs.data_ptr<float>();
  p.probs_stride = probs.stride(0);
  p.logits = lg ? lg->data_ptr<float>() : nullptr;
  p.logits_stride = lg ? lg->stride(0) : 0;
  p.draft_probs = dp ? dp->data_ptr<float>() : nullptr;
  p.dp_stride = dp ? dp->stride(0) : 0;
  p.draft_ids = drafts.data_ptr<int64_t>();
  p.num_drafts = k.data_ptr<int64_t>();
  p.is_greedy = greedy.data_ptr<bool>();
  p.uniforms = un ? un->data_ptr<float>() : nullptr;
  p.noise = nz ? nz->data_ptr<float>() : nullptr;
  p.noise_stride = nz ? nz->stride(0) : 0;
  p.seeds = sd.data_ptr<int64_t>();
  p.offsets = off.data_ptr<int64_t>();
  Tensor partials = at::empty({hs::rejection_workspace_bytes(M, static_cast<int>(V))}, like.options().dtype(at::kByte));
  p.partials = partials.data_ptr();
  p.out_tokens = out_tokens.data_ptr<int64_t>();
  p.out_accepted = out_acc.data_ptr<int64_t>();
  p.R = static_cast<int>(R);
  p.V = static_cast<int>(V);
  hs::launch_rejection(p, HS_STREAM());
  check_launch();
  return {out_tokens, out_acc};
}

}  // namespace

// Defaults mirror reference.py; dt_max=1e300 stands for +inf (the schema grammar has no inf; it
// becomes +inf as a float, i.e. no clamp).
HS_TORCH_LIBRARY(HS_NS, m) {
  m.def(
      "ssd_prefill(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, Tensor dt_bias, "
      "Tensor(a!) ssm_state, Tensor query_start_loc, Tensor num_computed_tokens, Tensor read_slot, "
      "Tensor has_initial_state, Tensor write_slot, Tensor emit_row, Tensor emit_token, Tensor emit_slot, "
      "int chunk_size, float dt_min=0.0, float dt_max=1e300) -> Tensor");
  m.def(
      "selective_state_update(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, Tensor dt_bias, "
      "Tensor(a!) ssm_state, Tensor query_start_loc, Tensor read_slot, Tensor write_slots, float dt_min=0.0, "
      "float dt_max=1e300) -> Tensor");
  m.def(
      "causal_conv1d_prefill(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state, "
      "Tensor query_start_loc, Tensor read_slot, Tensor has_initial_state, Tensor write_slot, "
      "Tensor emit_row, Tensor emit_token, Tensor emit_slot, str? activation=\"silu\") -> Tensor");
  m.def(
      "causal_conv1d_update(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state, "
      "Tensor query_start_loc, Tensor read_slot, Tensor write_slots, str? activation=\"silu\") -> Tensor");
  m.def("copy_slots(Tensor(a!) state, Tensor src, Tensor dst) -> ()");
  m.def(
      "rejection_sample(Tensor target_probs, Tensor? target_logits, Tensor draft_token_ids, "
      "Tensor num_draft_tokens, Tensor is_greedy, Tensor? draft_probs, Tensor? uniforms, Tensor? noise, "
      "Tensor seeds, Tensor offsets) -> (Tensor, Tensor)");
  m.def(
      "mamba1_scan(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, Tensor(a!) ssm_state, "
      "Tensor query_start_loc, Tensor read_slot, Tensor? has_initial_state, Tensor write_row, "
      "Tensor write_token, Tensor write_slot) -> Tensor");
}

HS_TORCH_LIBRARY_IMPL(HS_NS, HS_KEY, m) {
  m.impl("ssd_prefill", &ssd_prefill);
  m.impl("selective_state_update", &selective_state_update);
  m.impl("causal_conv1d_prefill", &causal_conv1d_prefill);
  m.impl("causal_conv1d_update", &causal_conv1d_update);
  m.impl("copy_slots", &copy_slots);
  m.impl("rejection_sample", &rejection_sample);
  m.impl("mamba1_scan", &mamba1_scan);
}
