// The Mamba1 selective scan on the CPU (hybridserve.kernels.native.mamba1_scan; its torch twin is
// hybridserve.kernels.selective_scan.selective_scan_rows). Per channel c with state h_c [N]:
//   h_c = exp(dt_c * A_c) * h_c + dt_c * x_c * B,   y_c = h_c . C + Dskip_c * x_c
// token by token within a row (dt already softplus(dt_raw + bias); the gate is the caller's).
//
// Channels are independent, so a call splits the channels (not the rows) over the threads: a
// prefill is often one long row. Each thread first copies the initial states of every row for its
// channels (read_slot, or zeros where has_init[r] is 0), then runs the rows in order, writing the
// state after token t to each slot listed for t: every read happens before any write, as in the
// twin. Writes as CSR: row r's are write_token / write_slot[write_offsets[r] .. [r + 1]), sorted
// by token. Slot 0 is the null slot: writes to it are skipped.
// Layouts: x, dt [T, Dc] with row strides; B, C [T, N] with row strides; A [Dc, N]; Dskip [Dc];
// ssm_state [slots, Dc, N]; y [T, Dc].
// Return codes: 0 ok, 1 bad shapes, 2 a slot, token or row range out of bounds, 3 a slot written by
// two rows (declined: the twin runs), 4 out of memory.
// Nothing is written unless the result is 0.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_parallel.h"

namespace {

// Below this much work (tokens x channels x N) a call runs on one thread.
constexpr int64_t kMinParallelWork = int64_t(1) << 15;
constexpr int64_t kMinChannelsPerThread = 8;

struct Args {
    int64_t T, Dc, N, R, num_slots;
    const int64_t* qsl;
    const int64_t* read_slot;
    const uint8_t* has_init;  // null: every row reads its slot
    const int64_t* write_offsets;
    const int64_t* write_token;
    const int64_t* write_slot;
};

int check(const Args& a) {
    if (a.T < 0 || a.Dc <= 0 || a.N <= 0 || a.R < 0 || a.num_slots <= 0) return 1;
    if (a.qsl[0] != 0 || a.write_offsets[0] != 0 || a.qsl[a.R] != a.T) return 2;
    for (int64_t r = 0; r < a.R; ++r) {
        const int64_t n = a.qsl[r + 1] - a.qsl[r];
        if (n < 0) return 2;
        if ((a.has_init == nullptr || a.has_init[r] != 0) && (a.read_slot[r] < 0 || a.read_slot[r] >= a.num_slots))
            return 2;
        const int64_t e0 = a.write_offsets[r], e1 = a.write_offsets[r + 1];
        if (e1 < e0) return 2;
        for (int64_t e = e0; e < e1; ++e) {
            const int64_t t = a.write_token[e], s = a.write_slot[e];
            if (t < 0 || t >= n || s < 0 || s >= a.num_slots) return 2;
            if (e > e0 && t < a.write_token[e - 1]) return 1;
        }
    }
    // A slot written by two rows: which write lands last differs from the twin's order (it writes
    // token position by token position across rows); declined, the caller runs the twin.
    std::vector<std::pair<int64_t, int64_t>> slot_rows;
    for (int64_t r = 0; r < a.R; ++r)
        for (int64_t e = a.write_offsets[r]; e < a.write_offsets[r + 1]; ++e)
            if (a.write_slot[e] != 0) slot_rows.emplace_back(a.write_slot[e], r);
    std::sort(slot_rows.begin(), slot_rows.end());
    for (size_t i = 1; i < slot_rows.size(); ++i)
        if (slot_rows[i].first == slot_rows[i - 1].first && slot_rows[i].second != slot_rows[i - 1].second) return 3;
    return 0;
}

template <typename T>
void scan_channels(const Args& a, const T* x, int64_t x_stride, const T* dt, int64_t dt_stride, const T* A,
                   const T* B, int64_t b_stride, const T* C, int64_t c_stride, const T* Dskip, T* ssm_state, T* y,
                   int64_t c0, int64_t c1) {
    const int64_t N = a.N, nd = c1 - c0, width = nd * N;
    std::vector<T> h(static_cast<size_t>(a.R * width));
    for (int64_t r = 0; r < a.R; ++r) {
        T* hr = h.data() + r * width;
        if (a.has_init == nullptr || a.has_init[r] != 0) {
            std::memcpy(hr, ssm_state + (a.read_slot[r] * a.Dc + c0) * N, sizeof(T) * static_cast<size_t>(width));
        } else {
            std::fill(hr, hr + width, T(0));
        }
    }
    for (int64_t r = 0; r < a.R; ++r) {
        T* hr = h.data() + r * width;
        int64_t e = a.write_offsets[r];
        const int64_t e1 = a.write_offsets[r + 1];
        const int64_t n = a.qsl[r + 1] - a.qsl[r];
        for (int64_t t = 0; t < n; ++t) {
            const int64_t i = a.qsl[r] + t;
            const T* Bi = B + i * b_stride;
            const T* Ci = C + i * c_stride;
            for (int64_t c = c0; c < c1; ++c) {
                const T d = dt[i * dt_stride + c], xv = x[i * x_stride + c], dx = d * xv;
                const T* Ac = A + c * N;
                T* hc = hr + (c - c0) * N;
                T acc = T(0);
                for (int64_t k = 0; k < N; ++k) {
                    const T v = std::exp(d * Ac[k]) * hc[k] + dx * Bi[k];
                    hc[k] = v;
                    acc += v * Ci[k];
                }
                y[i * a.Dc + c] = acc + Dskip[c] * xv;
            }
            for (; e < e1 && a.write_token[e] == t; ++e) {
                const int64_t s = a.write_slot[e];
                if (s != 0) std::memcpy(ssm_state + (s * a.Dc + c0) * N, hr, sizeof(T) * static_cast<size_t>(width));
            }
        }
    }
}

template <typename T>
int run(const T* x, int64_t x_stride, const T* dt, int64_t dt_stride, const T* A, const T* B, int64_t b_stride,
        const T* C, int64_t c_stride, const T* Dskip, T* ssm_state, const Args& a, T* y, int threads) {
    const int rc = check(a);
    if (rc != 0) return rc;
    if (a.T == 0) return 0;
    std::vector<int64_t> weight(static_cast<size_t>(a.Dc + 1));
    for (int64_t c = 0; c <= a.Dc; ++c) weight[static_cast<size_t>(c)] = c;
    const bool parallel = threads > 1 && a.T * a.Dc * a.N >= kMinParallelWork;
    const bool ok = hs::parallel_rows(a.Dc, parallel ? threads : 1, weight, kMinChannelsPerThread,
                                      [&](int64_t c0, int64_t c1) {
                                          scan_channels<T>(a, x, x_stride, dt, dt_stride, A, B, b_stride, C,
                                                           c_stride, Dskip, ssm_state, y, c0, c1);
                                      });
    return ok ? 0 : 4;
}

}  // namespace

extern "C" {

#define HS_MAMBA1_SCAN(NAME, T)                                                                                     \
    int NAME(const T* x, int64_t x_stride, const T* dt, int64_t dt_stride, const T* A, const T* B, int64_t b_stride, \
             const T* C, int64_t c_stride, const T* Dskip, T* ssm_state, int64_t num_slots, const int64_t* qsl,     \
             int64_t R, const int64_t* read_slot, const uint8_t* has_init, const int64_t* write_offsets,           \
             const int64_t* write_token, const int64_t* write_slot, int64_t T_, int64_t Dc, int64_t N, T* y,       \
             int threads) {                                                                                         \
        try {                                                                                                       \
            const Args a{T_, Dc, N, R, num_slots, qsl, read_slot, has_init, write_offsets, write_token, write_slot}; \
            return run<T>(x, x_stride, dt, dt_stride, A, B, b_stride, C, c_stride, Dskip, ssm_state, a, y, threads); \
        } catch (...) {                                                                                             \
            return 4;                                                                                               \
        }                                                                                                           \
    }

HS_MAMBA1_SCAN(hs_mamba1_scan_f32, float)
HS_MAMBA1_SCAN(hs_mamba1_scan_f64, double)

#undef HS_MAMBA1_SCAN

}  // extern "C"
