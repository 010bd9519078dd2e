import re
from pathlib import Path

from setuptools import find_packages, setup

# One place for the version: the package's __version__.
VERSION = re.search(r'^__version__ = "([^"]+)"', Path("python/sglang_cp_shared_kv/__init__.py").read_text(), re.M)[1]

setup(
    name="sglang-cp-shared-kv",
    version=VERSION,
    description="Shard the MLA + NSA/DSA KV cache across SGLang prefill context-parallel ranks",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    package_dir={"": "python"},
    packages=find_packages("python"),
    python_requires=">=3.10",
    # Loose on purpose: the same tree runs on CPU CI (torch 2.13) and on GPU hosts (torch 2.11).
    install_requires=["torch>=2.6", "numpy"],
    extras_require={
        # Exact versions CI runs with; scripts/setup_env.sh installs requirements/*.txt.
        "test": [
            "torch==2.13.0",
            "triton==3.8.0",
            "numpy==2.4.6",
            "pytest==9.2.0",
            "pytest-timeout==2.4.0",
            "hypothesis==6.170.17",
            "matplotlib==3.11.2",
            "build==1.6.1",
        ],
        "mooncake": ["mooncake-transfer-engine-non-cuda==0.3.13.post1"],
        "sglang": ["sglang==0.5.23"],
    },
    entry_points={
        "sglang.srt.plugins": ["cp_shared_kv = sglang_cp_shared_kv.srt.plugin:load"],
    },
)
