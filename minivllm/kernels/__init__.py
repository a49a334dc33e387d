"""C kernels for the CPU (paged attention, small-batch linear, GGUF blocks), built on first use."""
