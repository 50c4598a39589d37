"""The CUDA page-copy kernels, shared by the torch and JAX backends; imports no framework.

- ``kernels/page_copy.cu``: the kernels (framework-free CUDA C++, compiled at first use);
- :mod:`~kvgroups_cuda.params`: their launch parameters, mirrored with ctypes;
- :mod:`~kvgroups_cuda.geometry`: a kernel group's page shape and grid sizing;
- :mod:`~kvgroups_cuda.nvrtc`: compiling them with NVRTC (no GPU needed) and the disk cache.

``kvgroups_torch`` launches them through the CUDA driver; ``kvgroups_jax`` (lowering
``"cuda"``) has XLA launch them inside compiled programs.
"""
