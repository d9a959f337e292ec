// Limits libtorch's intra-op parallelism on the calling thread only, so the metrics
// worker never starts an OpenMP team of its own beside the training thread's.
// `at::set_num_threads` would also change the process-wide default that every new
// libtorch thread starts from; the OpenMP setting changed here is per thread.
#include <ATen/Parallel.h>
#include <dlfcn.h>

extern "C" int rankscope_threads_here() {
  try {
    return at::get_num_threads();
  } catch (...) {
    return -1;
  }
}

// Returns the thread count now in force on this thread, or -1 if it cannot be set.
extern "C" int rankscope_limit_threads_here(int n) {
  try {
    // libtorch sets a thread's OpenMP team size from its process-wide default the
    // first time the thread asks; ask first so that the limit below sticks.
    at::get_num_threads();
    using SetFn = void (*)(int);
    auto omp_set = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
    if (omp_set == nullptr) {
      return -1;
    }
    omp_set(n);
    // MKL's C entry point (the lower-case names are its Fortran ones, by pointer).
    auto mkl_set = reinterpret_cast<int (*)(int)>(dlsym(RTLD_DEFAULT, "MKL_Set_Num_Threads_Local"));
    if (mkl_set != nullptr) {
      mkl_set(n);
    }
    return at::get_num_threads();
  } catch (...) {
    return -1;
  }
}

