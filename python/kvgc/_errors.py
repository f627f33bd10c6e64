"""kvgc's exceptions: one class per status of kvgc.h, each carrying kvgc_errmsg()."""

__all__ = ["Error", "InvalidArgument", "OutOfMemory", "BudgetExceeded", "NotFound",
           "DeviceError", "Unsupported", "InternalError"]


class Error(RuntimeError):
    """A kvgc call failed. ``str(e)`` is kvgc_errmsg(): the call and the argument at fault.

    Attributes:
        status: the kvgc_status code (``kvgc.Status``).
        status_name: its name, e.g. ``"KVGC_ENOMEM"``.
        failed_index: for ``Batch.plan``, the index of the first sequence that did not
            fit (or the unknown or repeated one); ``None`` otherwise.

    Whatever the class, the call changed nothing (kvgc.h's rule).
    """

    status = 0

    def __init__(self, message, status=None, failed_index=-1):
        super().__init__(message)
        if status is not None:
            self.status = int(status)
        self.failed_index = None if failed_index is None or failed_index < 0 else int(failed_index)

    @property
    def status_name(self):
        """The status's name, e.g. ``"KVGC_ENOMEM"`` (kvgc_status_str)."""
        from . import _kvgc
        return _kvgc.status_str(self.status)


class InvalidArgument(Error, ValueError):
    """KVGC_EINVAL: an argument, array or option is malformed (the message names it)."""
    status = 1


class OutOfMemory(Error, MemoryError):
    """KVGC_ENOMEM: the arena (or host memory) has no room; the heap is unchanged."""
    status = 2


class BudgetExceeded(Error):
    """KVGC_EBUDGET: a budget cannot be met, e.g. a tenant's page quota."""
    status = 3


class NotFound(Error, LookupError):
    """KVGC_ENOTFOUND: an unknown or destroyed sequence, or an unknown cached prefix."""
    status = 4


class DeviceError(Error):
    """KVGC_EDEVICE: the device (CUDA) reported an error; the message has it."""
    status = 5


class Unsupported(Error, NotImplementedError):
    """KVGC_EUNSUPPORTED: a valid request this build, backend or integration cannot do."""
    status = 6


class InternalError(Error):
    """KVGC_EINTERNAL: an invariant is broken (a kvgc bug; please report it)."""
    status = 7


BY_STATUS = {cls.status: cls for cls in (InvalidArgument, OutOfMemory, BudgetExceeded, NotFound,
                                         DeviceError, Unsupported, InternalError)}
