"""kvgc.h's enums as IntEnums, and the dtype names they are given by."""
import enum

__all__ = ["Status", "DType", "Device", "StorageClass", "Policy", "Demote", "Harvest",
           "PrefixCharge", "Generation", "LayerBudget", "dtype_of"]


class Status(enum.IntEnum):
    """kvgc_status: what a C call returned; a failure raises the kvgc.Error subclass for it."""
    OK = 0
    EINVAL = 1
    ENOMEM = 2
    EBUDGET = 3
    ENOTFOUND = 4
    EDEVICE = 5
    EUNSUPPORTED = 6
    EINTERNAL = 7


class DType(enum.IntEnum):
    """The model's K/V dtype: every array handed to a heap has it."""
    F16 = 0
    BF16 = 1
    F32 = 2


class Device(enum.IntEnum):
    """The backend a heap runs on; AUTO is CUDA when a device answers, else CPU."""
    AUTO = 0
    CPU = 1
    CUDA = 2


class StorageClass(enum.IntEnum):
    """How a token's K/V are stored: a ladder by rank FP16 > INT8 > INT4 > INT2 > evicted."""
    FP16 = 0
    INT4 = 1
    INT8 = 2
    INT2 = 3  # 0.10, on the ladder only with Demote.LADDER_INT2


class Policy(enum.IntEnum):
    """Eviction policies: one GC mechanism with different priority keys (KVGC_POLICY)."""
    GENERATIONAL = 0
    FULL = 1
    STREAMING = 2
    H2O = 3
    RANDOM = 4


class Demote(enum.IntEnum):
    """The rungs of the storage ladder a GC may demote to before it evicts (KVGC_DEMOTE)."""
    OFF = 0
    INT4 = 1
    INT8 = 2
    LADDER = 3  # int8, then int4, then eviction
    LADDER_INT2 = 4  # int8, int4, then int2, then eviction (0.10, opt-in)


class Harvest(enum.IntEnum):
    """When the host applies a GC's page-level results: at the sequence's next step, or
    within the same step (KVGC_HARVEST)."""
    DEFERRED = 0
    IMMEDIATE = 1


class PrefixCharge(enum.IntEnum):
    """Who pays for tokens attached from the prefix cache (KVGC_PREFIX_CHARGE, 0.7)."""
    CACHE = 0  # kept whole in every holder's view, never pruned there, held and charged once
    VIEW = 1   # each holder, as if it had appended them: its budgets count them, its GC prunes
    PRUNE = 2  # 0.8, retired in 0.15: a heap given PRUNE runs (and reports) SHRINK
    SHRINK = 3  # 0.13, the default since 0.15: VIEW's decisions, but a demoted shared
                # token is only charged at its rung and read from the shared page (each
                # holder holds its own tokens), and a shared page every holder counts at
                # the ladder's first rung below FP16 or cheaper is re-stored there


class Generation(enum.IntEnum):
    """Token generations (tiers): sinks and the young window are never evicted."""
    SINK = 0
    YOUNG = 1
    INTERMEDIATE = 2
    LONG_TERM = 3


class LayerBudget(enum.IntEnum):
    """How a segment's budget is split across layers: the same for each, PyramidKV's
    (more for lower layers) or per-layer weights (KVGC_LAYER_BUDGET)."""
    UNIFORM = 0
    PYRAMID = 1
    ENTROPY = 2


_DTYPE_NAMES = {"float16": DType.F16, "f16": DType.F16, "half": DType.F16,
                "bfloat16": DType.BF16, "bf16": DType.BF16,
                "float32": DType.F32, "f32": DType.F32, "float": DType.F32}


def dtype_of(dtype):
    """A kvgc.DType from a DType, a name ("float16", "bfloat16", "float32"), a numpy
    dtype or a torch dtype. Raises InvalidArgument for anything else."""
    from ._errors import InvalidArgument
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, bool):
        raise InvalidArgument(f"dtype={dtype!r}: expected float16, bfloat16 or float32")
    if isinstance(dtype, int) and dtype in DType._value2member_map_:
        return DType(dtype)
    # torch.float16 prints as "torch.float16"; numpy dtypes and types have a .name or __name__.
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    else:
        name = getattr(dtype, "name", None) or getattr(dtype, "__name__", None) or name
    try:
        return _DTYPE_NAMES[str(name).lower()]
    except KeyError:
        raise InvalidArgument(
            f"dtype={dtype!r}: kvgc stores float16, bfloat16 or float32 K/V") from None
