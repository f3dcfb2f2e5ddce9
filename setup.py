from setuptools import find_packages, setup

setup(
    name="transformer_engine_compile",
    version="0.1.0",
    description="Quantized (FP8, MXFP8, FP8-blockwise, NVFP4) training layers for torch.compile",
    packages=find_packages(include=["transformer_engine_compile", "transformer_engine_compile.*"]),
    package_data={"transformer_engine_compile": ["kernels/*.cpp", "kernels/*.h"]},  # the native eager path
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "numpy"],  # numpy: torch.distributed.checkpoint's object gathers
    extras_require={"test": ["pytest", "pytest-xdist", "transformers", "import-linter"],
                    "gpu": ["triton"]},
)
