from setuptools import find_packages, setup

setup(
    name="transformer_engine_compile",
    version="0.1.0",
    description="Quantized (FP8, MXFP8, FP8-blockwise, NVFP4) training layers for torch.compile",
    packages=find_packages(include=["transformer_engine_compile", "transformer_engine_compile.*"]),
    package_data={"transformer_engine_compile": ["kernels/*.cpp", "kernels/*.h"]},  # the native eager path
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "numpy"],  # numpy: torch.distributed.checkpoint's object gathers
    # test: Triton too where it installs, so its interpreter runs the CUDA
    # kernels on CPU tensors (tests/test_triton_interpreted.py and the lowering
    # tests); 3.6-3.9 are the versions torch 2.11-2.15 pair with
    extras_require={"test": ["pytest", "pytest-xdist", "transformers", "import-linter",
                             "triton>=3.6,<3.10; platform_system == 'Linux'"],
                    "gpu": ["triton"],
                    "plots": ["matplotlib"],
                    # kernels compiled at run time (kernels/runner.py); 4.3.5 is one wheel
                    "cutedsl": ["nvidia-cutlass-dsl==4.3.5"]},
)
