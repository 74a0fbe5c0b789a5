// A small persistent thread pool for the CPU kernels (hybridserve.kernels.native): the rows of a
// call are split into contiguous ranges of about equal weight, one per thread; the calling thread
// runs the first range. The caller passes the thread count (torch's intra-op count), so that the
// kernels use the cores torch would. No exception leaves it: a range that throws (out of memory)
// or a thread that cannot start makes the call report failure, or run the range on the caller.
#pragma once

#include <pthread.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace hs {

class Pool {
   public:
    // Runs fn(i) for i in 0 .. n - 1, i = 0 here and the others on the workers; returns false if
    // any of them threw.
    bool run(int n, const std::function<void(int)>& fn) {
        if (n <= 1) return call(fn, 0);
        std::lock_guard<std::mutex> one_call(call_mu_);  // one call at a time (two engines, two threads)
        std::unique_lock<std::mutex> lock(mu_);
        while (static_cast<int>(workers_) < n - 1) {
            try {
                // a new worker waits for the generation after this one: the call below
                std::thread([this, id = static_cast<int>(workers_) + 1, gen = generation_] { loop(id, gen); })
                    .detach();
            } catch (...) {
                break;  // no more threads: the caller runs the ranges that have none
            }
            ++workers_;
        }
        const int on_workers = std::min(n - 1, static_cast<int>(workers_));
        task_ = &fn;
        active_ = on_workers + 1;
        pending_ = on_workers;
        failed_ = false;
        ++generation_;
        lock.unlock();
        wake_.notify_all();
        bool ok = call(fn, 0);
        for (int i = on_workers + 1; i < n; ++i) ok = call(fn, i) && ok;
        lock.lock();
        done_.wait(lock, [this] { return pending_ == 0; });
        task_ = nullptr;
        return ok && !failed_;
    }

   private:
    static bool call(const std::function<void(int)>& fn, int i) {
        try {
            fn(i);
            return true;
        } catch (...) {
            return false;
        }
    }

    void loop(int id, uint64_t seen) {
        std::unique_lock<std::mutex> lock(mu_);
        for (;;) {
            wake_.wait(lock, [&] { return generation_ != seen; });
            seen = generation_;
            if (id >= active_) continue;  // this call uses fewer threads
            const std::function<void(int)>* task = task_;
            lock.unlock();
            const bool ok = call(*task, id);
            lock.lock();
            if (!ok) failed_ = true;
            if (--pending_ == 0) done_.notify_one();
        }
    }

    std::mutex call_mu_, mu_;
    std::condition_variable wake_, done_;
    const std::function<void(int)>* task_ = nullptr;
    uint64_t generation_ = 0;
    size_t workers_ = 0;
    int active_ = 0;
    int pending_ = 0;
    bool failed_ = false;
};

// The process's one T, made on first use. A forked child gets a fresh one: it has none of the
// parent's threads, and the parent's locks and condition variables may be in any state. The old
// one is leaked, never destroyed (detached threads may outlive static destructors).
template <typename T>
inline T& per_process() {
    static T* instance = nullptr;
    static std::once_flag once;
    std::call_once(once, [] {
        instance = new T();
        pthread_atfork(nullptr, nullptr, [] { instance = new T(); });
    });
    return *instance;
}

// The process's pool.
inline Pool& pool() { return per_process<Pool>(); }

// Splits rows [0, R) into at most `threads` contiguous ranges of about equal total weight
// (weight_prefix[r] = the weight of rows before r, weight_prefix[R] the total) and runs
// fn(begin, end) for each, in parallel; false if one of them threw. One range when threads <= 1
// or the work is small.
inline bool parallel_rows(int64_t R, int threads, const std::vector<int64_t>& weight_prefix,
                          int64_t min_weight_per_thread, const std::function<void(int64_t, int64_t)>& fn) {
    const int64_t total = R > 0 ? weight_prefix[static_cast<size_t>(R)] : 0;
    int64_t n = threads < 1 ? 1 : threads;
    if (min_weight_per_thread > 0 && total / min_weight_per_thread < n) n = total / min_weight_per_thread;
    if (n > R) n = R;
    if (n <= 1) {
        try {
            fn(0, R);
            return true;
        } catch (...) {
            return false;
        }
    }
    std::vector<int64_t> bounds(static_cast<size_t>(n + 1), R);
    bounds[0] = 0;
    int64_t r = 0;
    for (int64_t i = 1; i < n; ++i) {
        const int64_t target = total * i / n;
        while (r < R && weight_prefix[static_cast<size_t>(r)] < target) ++r;
        bounds[static_cast<size_t>(i)] = r;
    }
    return pool().run(static_cast<int>(n), [&](int i) {
        const int64_t b = bounds[static_cast<size_t>(i)], e = bounds[static_cast<size_t>(i + 1)];
        if (b < e) fn(b, e);
    });
}

}  // namespace hs
