// One background thread that runs one posted call at a time, for the engine's overlapped steps
// (hybridserve.engine.llm_engine): the caller posts a decode step and returns to Python, which
// builds the previous step's outputs while the step runs here, then waits for its return code.
//
// The hand-over has to be cheap next to a step of a few hundred microseconds. A thread asleep on
// a condition variable took 40-80 us to wake on the 2-core VM of benches/README.md, twice per
// step, so both sides poll (yielding the core to any other runnable thread) for up to kPollUs
// before they sleep: steps that follow each other never sleep, and an idle engine stops polling
// after kPollUs. The waiter does not poll through a long step, though: a polling core is CPU time
// the step's own core may lack on a shared machine (a step of 64 rows ran 10-40% slower so), so
// it sleeps until kMarginUs before the time the previous job took, then polls.
#pragma once

#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "cpu_parallel.h"

namespace hs {

class Background {
   public:
    // Posts `job` to the background thread; false (nothing posted) if a job is already posted
    // and not yet waited for, or the thread cannot start.
    bool post(std::function<int()> job) {
        std::lock_guard<std::mutex> lock(mu_);
        if (state_.load(std::memory_order_relaxed) != kIdle) return false;
        if (!started_) {
            try {
                std::thread([this] { loop(); }).detach();
            } catch (...) {
                return false;
            }
            started_ = true;
        }
        job_ = std::move(job);
        posted_at_ = std::chrono::steady_clock::now();
        state_.store(kPosted, std::memory_order_release);
        cv_.notify_all();
        return true;
    }

    // The return code of the posted job, once it has run (-1 when nothing was posted).
    int wait() {
        if (state_.load(std::memory_order_acquire) == kIdle) return -1;
        {
            std::unique_lock<std::mutex> lock(mu_);
            const auto wake = posted_at_ + last_run_ - std::chrono::microseconds(kMarginUs);
            cv_.wait_until(lock, wake, [this] { return state_.load(std::memory_order_relaxed) == kDone; });
        }
        poll_for(kDone);
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return state_.load(std::memory_order_relaxed) == kDone; });
        state_.store(kIdle, std::memory_order_relaxed);
        return rc_;
    }

   private:
    static constexpr int kIdle = 0, kPosted = 1, kRunning = 2, kDone = 3;
    static constexpr int kPollUs = 2000, kMarginUs = 150;

    void poll_for(int wanted) const {
        const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(kPollUs);
        while (state_.load(std::memory_order_acquire) != wanted && std::chrono::steady_clock::now() < end)
            sched_yield();
    }

    void loop() {
        for (;;) {
            poll_for(kPosted);
            std::function<int()> job;
            {
                std::unique_lock<std::mutex> lock(mu_);
                cv_.wait(lock, [this] { return state_.load(std::memory_order_relaxed) == kPosted; });
                job = std::move(job_);
                state_.store(kRunning, std::memory_order_relaxed);
            }
            const auto start = std::chrono::steady_clock::now();
            int rc = 5;  // a job that throws has failed part way (its writes are unknown)
            try {
                rc = job();
            } catch (...) {
            }
            {
                std::lock_guard<std::mutex> lock(mu_);
                last_run_ = std::chrono::steady_clock::now() - start;
                rc_ = rc;
                state_.store(kDone, std::memory_order_release);
            }
            cv_.notify_all();
        }
    }

    std::mutex mu_;
    std::condition_variable cv_;
    std::atomic<int> state_{kIdle};
    std::function<int()> job_;
    int rc_ = 0;
    bool started_ = false;
    std::chrono::steady_clock::time_point posted_at_;
    std::chrono::steady_clock::duration last_run_{0};  // how long the previous job ran
};

// The process's background thread (a forked child gets its own: cpu_parallel.h per_process).
inline Background& background() { return per_process<Background>(); }

}  // namespace hs
