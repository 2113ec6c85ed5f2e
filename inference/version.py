"""The one place the project's version lives."""
__version__ = "0.1.0"


def version_key(version: str = __version__) -> int:
    """Integer form used as the chain's weights ``version_key``: 1.2.3 -> 1002003."""
    major, minor, patch = (int(p) for p in version.split(".")[:3])
    return major * 1_000_000 + minor * 1_000 + patch
