"""C kernels for the CPU, compiled on first use with the system's C compiler and loaded through ctypes."""
