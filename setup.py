"""The C++ CPU kernel of `kernels` (kernels/fused/ms_deform_attn_cpu.cpp), built by the install.

Optional: where it cannot be built (no C++17 compiler), the install goes on and `kernels` uses its
MLX-ops path on the CPU (`kernels.available_backends()` tells). Everything else is in pyproject.toml.
"""

import sys

from setuptools import Extension, setup

flags = ["/O2", "/std:c++17"] if sys.platform == "win32" else ["-O3", "-std=c++17"]
setup(
    ext_modules=[
        Extension(
            "kernels._cpu",
            sources=["kernels/fused/ms_deform_attn_cpu.cpp"],
            include_dirs=["kernels/fused"],
            extra_compile_args=flags,
            extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
            optional=True,
        )
    ]
)
