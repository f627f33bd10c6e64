"""Heap options as Python keywords, normalised to kvgc_heap_options' fields.

Each keyword mirrors one KVGC_* variable (README's Environment table) and accepts the
same forms, typed: a count is an int, a fraction a float, a choice its name. None leaves
the default. As in C, the environment overrides these unless ignore_env=True.
"""
import os

from ._enums import Demote, Device, Harvest, LayerBudget, Policy, PrefixCharge
from ._errors import InvalidArgument

__all__ = ["heap_options", "OPTION_NAMES"]

_CHOICES = {
    "device": {"auto": Device.AUTO, "cpu": Device.CPU, "cuda": Device.CUDA},
    "policy": {"generational": Policy.GENERATIONAL, "full": Policy.FULL,
               "streaming": Policy.STREAMING, "h2o": Policy.H2O, "random": Policy.RANDOM},
    "demote": {"off": Demote.OFF, "int4": Demote.INT4, "int8": Demote.INT8,
               "int8,int4": Demote.LADDER, "ladder": Demote.LADDER,
               "int8,int4,int2": Demote.LADDER_INT2},
    "layer_budget": {"uniform": LayerBudget.UNIFORM, "pyramid": LayerBudget.PYRAMID,
                     "entropy": LayerBudget.ENTROPY},
    "harvest": {"deferred": Harvest.DEFERRED, "immediate": Harvest.IMMEDIATE},
    "prefix_charge": {"cache": PrefixCharge.CACHE, "view": PrefixCharge.VIEW,
                      "prune": PrefixCharge.PRUNE, "shrink": PrefixCharge.SHRINK},
}
_ENUMS = {"device": Device, "policy": Policy, "demote": Demote, "layer_budget": LayerBudget,
          "harvest": Harvest, "prefix_charge": PrefixCharge}
_COUNTS = ("sinks", "window", "window_min", "min_length", "page_tokens", "seed", "slab_bytes", "first_layer",
           "total_layers", "cuda_device", "budget_bytes")
_REALS = ("compact_threshold", "score_noise", "recent_decay", "budget_fraction")

OPTION_NAMES = tuple(sorted(set(_CHOICES) | set(_COUNTS) | set(_REALS) | {
    "budget", "token_budget", "byte_budget", "layer_weights", "verbose", "cpu_threads",
    "ignore_env"}))

_SUFFIX = {"": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
           "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def _choice(name, value):
    enum = _ENUMS[name]
    if isinstance(value, enum):
        return int(value)
    if isinstance(value, str) and value.lower().replace(" ", "") in _CHOICES[name]:
        return int(_CHOICES[name][value.lower().replace(" ", "")])
    raise InvalidArgument(f"{name}={value!r}: expected one of "
                          f"{', '.join(repr(c) for c in _CHOICES[name])}")


def _count(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"{name}={value!r}: expected a non-negative int")
    return value


def _real(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name}={value!r}: expected a number")
    return float(value)


def _share(name, value, absolute, fraction, out):
    """An int is absolute, a float in (0, 1] or a "N%" string a fraction."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            value = float(value.strip()[:-1]) / 100.0
        except ValueError:
            raise InvalidArgument(f"{name}={value!r}: expected an int, a fraction or 'N%'") from None
    if isinstance(value, bool):
        raise InvalidArgument(f"{name}={value!r}: expected an int, a fraction or 'N%'")
    if isinstance(value, int):
        if value <= 0:
            raise InvalidArgument(f"{name}={value!r}: must be positive")
        out[absolute] = value
    elif isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise InvalidArgument(f"{name}={value!r}: a fraction must be in (0, 1]")
        out[fraction] = value
    else:
        raise InvalidArgument(f"{name}={value!r}: expected an int, a fraction or 'N%'")


def _budget(value, out):
    """The arena: bytes (int, or "512M"/"24G"), or a fraction of free memory (float, "N%")."""
    if isinstance(value, str) and not value.strip().endswith("%"):
        text = value.strip().lower()
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz ")
        unit = text[len(digits):].strip()
        try:
            if unit not in _SUFFIX:
                raise ValueError
            out["budget_bytes"] = int(float(digits) * _SUFFIX[unit])
            return
        except ValueError:
            raise InvalidArgument(f"budget={value!r}: expected bytes (512M, 24G), a fraction "
                                  "or 'N%'") from None
    _share("budget", value, "budget_bytes", "budget_fraction", out)


def heap_options(**kw):
    """The options dict the extension takes: kvgc_heap_options field -> value."""
    out = {}
    flags = 0
    for name, value in kw.items():
        if value is None:
            continue
        if name in _CHOICES:
            out[name] = _choice(name, value)
        elif name in _COUNTS:
            out[name] = _count(name, value)
        elif name in _REALS:
            out[name] = _real(name, value)
        elif name == "budget":
            _budget(value, out)
        elif name == "token_budget":
            _share(name, value, "token_budget", "token_budget_fraction", out)
        elif name == "byte_budget":
            _share(name, value, "byte_budget", "byte_budget_fraction", out)
        elif name == "layer_weights":
            try:
                out[name] = [float(w) for w in value]
            except (TypeError, ValueError):
                raise InvalidArgument("layer_weights: expected a sequence of numbers") from None
        elif name == "verbose":
            out[name] = 1 if value else 0
        elif name == "cpu_threads":
            if value == "auto":
                value = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
                    else (os.cpu_count() or 1)
            out[name] = _count(name, value)
        elif name == "ignore_env":
            flags |= 1 if value else 0
        else:
            raise InvalidArgument(f"unknown heap option {name!r} (known: {', '.join(OPTION_NAMES)})")
    out["flags"] = flags
    return out
