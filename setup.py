"""Packaging for the Kimi K3 subnet (distribution ``k3-subnet``)."""
import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'^__version__ = "([^"]+)"', (HERE / "inference" / "version.py").read_text(), re.M).group(1)

setup(
    name="k3-subnet",
    version=VERSION,
    description="A Bittensor subnet serving Kimi K3 on sharded hardware, measured and verified",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["inference*", "protocol*", "scoring*", "neurons*", "chain*"]),
    package_data={"inference.planning": ["clusters/*.yaml"]},
    install_requires=[
        "bittensor>=11.3,<12",
        "torch>=2.4",
        "aiohttp>=3.9",
        "pydantic>=2",
        "numpy",
        "safetensors",
        "jinja2>=3.1",
        "pyyaml",
        "prometheus-client",
        "rich",
        "tiktoken",
        "psutil",
    ],
    extras_require={
        "test": [
            "pytest",
            "pytest-asyncio",
            "pytest-timeout",
            "hypothesis",
            "fla-core",
            "triton",
            "openai",
        ],
    },
)
