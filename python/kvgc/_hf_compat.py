"""Version gate for kvgc.transformers: which transformers releases the Cache binding supports.

transformers reworked its cache API twice: 4.56 introduced per-layer cache objects
(``Cache.layers`` of ``CacheLayerMixin``), which KvgcCache builds on; 5.x keeps the layer
classes but passes ``get_mask_sizes`` a query length in some releases where 4.56-4.57
(and 5.2) pass ``cache_position``. Everything version-dependent is decided here, in one tested
place, so that the binding refuses what it was not written for instead of failing deep
inside ``generate()``.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

# Oldest release with Cache.layers / CacheLayerMixin (the contract KvgcCache implements),
# and the first major release the binding has not been written against.
MIN_VERSION = (4, 56)
TESTED_VERSIONS = ("4.57", "5.2")  # tools/test-python.sh runs the suite on both
MAX_MAJOR = 5


@dataclass(frozen=True)
class HfProfile:
    """What KvgcCache needs to know about the installed transformers.

    Attributes:
        version: (major, minor, patch) of the installed transformers.
        mask_sizes_arg: the first parameter ``CacheLayerMixin.get_mask_sizes`` takes:
            ``"cache_position"`` (a tensor, 4.56-4.57) or ``"query_length"`` (an int).
        tested: True for the releases the test suite ran on (others are best effort).
    """

    version: tuple
    mask_sizes_arg: str
    tested: bool


def parse_version(text: str) -> tuple:
    """``"4.57.6"`` -> ``(4, 57, 6)``; dev/rc suffixes are ignored (``"5.0.0rc1"`` -> (5, 0, 0))."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        raise ValueError(f"cannot parse a transformers version from {text!r}")
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))


def check_version(text: str) -> tuple:
    """Parse ``text`` and raise ``kvgc.Unsupported`` unless KvgcCache supports that release."""
    from . import Unsupported  # late: keeps this module importable on its own for tests

    v = parse_version(text)
    if v[:2] < MIN_VERSION:
        raise Unsupported(
            f"kvgc.transformers needs transformers >= {MIN_VERSION[0]}.{MIN_VERSION[1]} "
            f"(per-layer Cache objects); found {text}. Upgrade with "
            f"`pip install 'transformers>=4.56,<{MAX_MAJOR + 1}'`."
        )
    if v[0] > MAX_MAJOR:
        raise Unsupported(
            f"kvgc.transformers supports transformers 4.56 to {MAX_MAJOR}.x (tested: "
            f"{', '.join(TESTED_VERSIONS)}); found {text}, whose Cache contract it has not "
            f"been checked against."
        )
    return v


def mask_sizes_arg(layer_cls=None) -> str:
    """The name of ``get_mask_sizes``' first parameter in the installed transformers.

    Read from the signature rather than the version number, since that is what the
    calling code relies on.
    """
    if layer_cls is None:
        from transformers.cache_utils import CacheLayerMixin as layer_cls
    params = list(inspect.signature(layer_cls.get_mask_sizes).parameters)
    first = params[1] if len(params) > 1 else "cache_position"
    return "cache_position" if first == "cache_position" else "query_length"


def query_length(arg) -> int:
    """``get_mask_sizes``' first argument as a query length, whichever form it came in."""
    shape = getattr(arg, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else int(arg)
    return int(arg)


_profile = None


def profile() -> HfProfile:
    """The installed transformers' profile (checked once, then cached)."""
    global _profile
    if _profile is None:
        import transformers

        v = check_version(transformers.__version__)
        tested = any(transformers.__version__.startswith(t + ".") for t in TESTED_VERSIONS)
        _profile = HfProfile(v, mask_sizes_arg(), tested)
    return _profile
