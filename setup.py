"""megatron-zb: zero-bubble pipeline parallelism for stock megatron-core."""
from setuptools import find_packages, setup

setup(
    name="megatron-zb",
    version="0.1.0",
    description="Zero-bubble pipeline-parallel schedules (ZB-H1/H2, auto, ZB-V, V-Half/V-Min) "
    "as a plugin for NVIDIA megatron-core",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_zb", "megatron_zb.*"]),
    # The schedule core (simulate/compare/plot/plan) needs only these light packages.
    install_requires=["numpy", "scipy>=1.9", "matplotlib"],
    extras_require={
        # Training needs torch and megatron-core. Install torch for your platform first
        # (on CPU machines here: `pip install torch==2.13.0`); these ranges then add nothing.
        "train": ["torch>=2.4", "megatron-core>=0.16.1"],
        "test": ["pytest", "hypothesis"],
    },
    entry_points={"console_scripts": ["megatron-zb=megatron_zb.cli:main"]},
)
