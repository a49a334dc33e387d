"""C kernels for the CPU (paged decode attention, small-batch linear), built on first use."""
