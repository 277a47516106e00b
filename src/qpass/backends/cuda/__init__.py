"""qpass CUDA C++ kernels compiled at run time with NVRTC (see ``runtime``)."""
