// microbench.h — what microbench.cpp gives kernels.cpp to bind: the CPU's features and rooflines.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "common.h"

namespace FD_NS {

// x86 features usable here: the CPU has them and the OS saves their state (cpu_has asks by name)
std::vector<std::string> cpu_features();

// GB/s of each of `reps` reads of nbytes by a pool of `threads` (pinned to cpus): memory's roofline
std::vector<double> read_bandwidth(size_t nbytes, int threads, int reps, std::vector<int> cpus);

// multiply-adds of one kind ("zmm", "ymm", "zmm_dpbf16") per ns on the calling thread: compute's
// roofline; std::invalid_argument for seconds outside (0, 10] or a kind this build cannot time
double fma_rate(const std::string& kind, double seconds);

}  // namespace FD_NS
