// pool.h — a small pinned thread pool that never busy-waits for long.
//
// Why not OpenMP: libgomp's idle threads spin (GOMP_SPINCOUNT, OMP_WAIT_POLICY read once at
// library load, possibly by another extension), and R-workers often share cores with other MPI
// ranks (3 ranks on 2 cores in CI). Here idle workers spin for `spin_us` microseconds (enough to
// catch back-to-back layer calls) and then block on a condition variable: idle CPU ~ 0.
//
// Work is a flat range of items handed out by an atomic counter. Which thread runs an item never
// changes what the item computes, so results do not depend on the thread count.
//
// The calling thread is worker 0 and takes items too; workers 1..T-1 are pinned to cpus[1..].
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "common.h"

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace FD_NS {

static inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

class Pool {
public:
    // fn(ctx, item, next): `next` is the item this thread runs after `item` (-1: none), so an
    // item can prefetch its successor's first data while it finishes
    using Fn = void (*)(void* ctx, int64_t item, int64_t next);

    Pool(int nthreads, std::vector<int> cpus, int spin_us)
        : nthreads_(nthreads < 1 ? 1 : nthreads), cpus_(std::move(cpus)), spin_us_(spin_us) {}

    ~Pool() { stop(); }

    int size() const { return nthreads_; }

    // Run fn(ctx, i, next) for i in [0, n) on all threads; returns when every item is done.
    void run(int64_t n, Fn fn, void* ctx) {
        if (n <= 0) return;
        std::lock_guard<std::mutex> one_job(run_mu_);
        if (nthreads_ == 1 || n == 1) {
            for (int64_t i = 0; i < n; ++i) fn(ctx, i, i + 1 < n ? i + 1 : -1);
            return;
        }
        if (workers_.empty()) start();

        // 1. publish the job while it is closed (no worker reads these fields then)
        fn_ = fn;
        ctx_ = ctx;
        n_ = n;
        next_.store(0, std::memory_order_relaxed);
        closed_.store(false);                       // seq_cst: pairs with active_ in workers
        gen_.fetch_add(1);
        if (sleepers_.load() > 0) {
            { std::lock_guard<std::mutex> lk(mu_); }
            wake_cv_.notify_all();
        }
        // 2. the caller works too
        take_items(n, fn, ctx);
        // 3. close; late workers see closed_ and back out. Wait for those still inside an item.
        closed_.store(true);
        if (active_.load() != 0) {
            auto t0 = std::chrono::steady_clock::now();
            int k = 0;
            while (active_.load() != 0) {
                cpu_relax();
                if ((++k & 255) == 0 && elapsed_us(t0) > spin_us_) {
                    std::unique_lock<std::mutex> lk(mu_);
                    done_cv_.wait(lk, [&] { return active_.load() == 0; });
                    break;
                }
            }
        }
    }

    // Convenience: any callable f(int64_t item, int64_t next)
    template <class F>
    void parallel_for(int64_t n, F& f) {
        run(n, [](void* c, int64_t i, int64_t nx) { (*static_cast<F*>(c))(i, nx); }, &f);
    }

private:
    // claim items one ahead, so each call knows its successor
    void take_items(int64_t n, Fn fn, void* ctx) {
        int64_t cur = next_.fetch_add(1, std::memory_order_relaxed);
        while (cur < n) {
            int64_t nxt = next_.fetch_add(1, std::memory_order_relaxed);
            fn(ctx, cur, nxt < n ? nxt : -1);
            cur = nxt;
        }
    }

    static double elapsed_us(std::chrono::steady_clock::time_point t0) {
        return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    }

    void start() {
        for (int w = 1; w < nthreads_; ++w) workers_.emplace_back([this, w] { worker_main(w); });
    }

    void stop() {
        if (workers_.empty()) return;
        stop_.store(true);
        gen_.fetch_add(1);
        { std::lock_guard<std::mutex> lk(mu_); }
        wake_cv_.notify_all();
        for (auto& t : workers_) t.join();
        workers_.clear();
    }

    void pin(int w) {
#if defined(__linux__)
        if (cpus_.empty()) return;
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus_[w % cpus_.size()], &set);
        pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort
#else
        (void)w;
#endif
    }

    void worker_main(int w) {
        pin(w);
        uint64_t seen = 0;
        for (;;) {
            // 1. wait for a new generation: spin briefly, then block
            auto t0 = std::chrono::steady_clock::now();
            int k = 0;
            while (gen_.load() == seen) {
                cpu_relax();
                if ((++k & 255) == 0 && elapsed_us(t0) > spin_us_) {
                    std::unique_lock<std::mutex> lk(mu_);
                    sleepers_.fetch_add(1);
                    wake_cv_.wait(lk, [&] { return gen_.load() != seen; });
                    sleepers_.fetch_sub(1);
                    break;
                }
            }
            seen = gen_.load();
            if (stop_.load()) return;
            // 2. join the job unless the caller has already closed it
            active_.fetch_add(1);
            if (!closed_.load()) {
                const int64_t n = n_;
                Fn fn = fn_;
                void* ctx = ctx_;
                take_items(n, fn, ctx);
            }
            if (active_.fetch_sub(1) == 1) {
                std::lock_guard<std::mutex> lk(mu_);
                done_cv_.notify_all();
            }
        }
    }

    const int nthreads_;
    const std::vector<int> cpus_;
    const int spin_us_;
    std::vector<std::thread> workers_;

    std::mutex run_mu_;                      // one job at a time per pool
    std::mutex mu_;
    std::condition_variable wake_cv_, done_cv_;
    std::atomic<uint64_t> gen_{0};
    std::atomic<int> sleepers_{0};
    std::atomic<int> active_{0};
    std::atomic<bool> closed_{true};
    std::atomic<bool> stop_{false};
    std::atomic<int64_t> next_{0};
    int64_t n_ = 0;
    Fn fn_ = nullptr;
    void* ctx_ = nullptr;
};

}  // namespace FD_NS
