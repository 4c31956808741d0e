# The one error table. Every CUDA error mpsd can report is a row here: code, name, message, and the
# exception class that carries it. Errors cross the wire as {code, name, message} and become the same
# class on the other side, so the daemon and the client never disagree about what a code means.
from __future__ import annotations

from typing import Any

from ._brief import brief


class CudaError(Exception):
    """A CUDA runtime error, as the real runtime would report it.

    Attributes:
        code: the numeric `cudaError_t` value.
        name: the enumerator's name, e.g. ``"cudaErrorInvalidValue"``.
        message: what went wrong: the runtime's text, then our detail.
        sticky: True for errors that corrupt the context: every later call fails the same way.
    """

    code: int = 999
    name: str = "cudaErrorUnknown"
    description: str = "unknown error"
    sticky: bool = False

    def __init__(self, detail: str | None = None, *, code: int | None = None) -> None:
        if code is not None and code != self.code:
            # A code with no class of its own travels in the generic class.
            row = _ROWS.get(code)
            self.code = code
            self.name, self.description, self.sticky = (
                (row[0], row[1], row[3]) if row else (f"cudaError{code}", "unrecognised error code", False)
            )
        self.detail = detail
        self.message = f"{self.description}: {detail}" if detail else self.description
        super().__init__(f"{self.name}: {self.message}")

    def to_wire(self) -> dict[str, Any]:
        """The error as it crosses the wire: ``{code, name, message}`` (message is the detail only)."""
        return {"code": self.code, "name": self.name, "message": self.detail or ""}


# (code, name, runtime message, class name, built-in base, sticky)
_TABLE: list[tuple[int, str, str, str, type[BaseException] | None, bool]] = [
    (1, "cudaErrorInvalidValue", "invalid argument", "InvalidValueError", ValueError, False),
    (2, "cudaErrorMemoryAllocation", "out of memory", "OutOfMemoryError", MemoryError, False),
    (3, "cudaErrorInitializationError", "initialization error", "InitializationError", None, False),
    (4, "cudaErrorCudartUnloading", "driver shutting down", "CudartUnloadingError", None, False),
    (9, "cudaErrorInvalidConfiguration", "invalid configuration argument", "InvalidConfigurationError",
     ValueError, False),
    (17, "cudaErrorInvalidDevicePointer", "invalid device pointer", "InvalidDevicePointerError", ValueError,
     False),
    (46, "cudaErrorDevicesUnavailable", "CUDA-capable device(s) is/are busy or unavailable",
     "DevicesUnavailableError", None, False),
    (98, "cudaErrorInvalidDeviceFunction", "invalid device function", "InvalidDeviceFunctionError", None, False),
    (100, "cudaErrorNoDevice", "no CUDA-capable device is detected", "NoDeviceError", None, False),
    (101, "cudaErrorInvalidDevice", "invalid device ordinal", "InvalidDeviceError", ValueError, False),
    (201, "cudaErrorDeviceUninitialized", "invalid device context", "DeviceUninitializedError", None, False),
    (217, "cudaErrorPeerAccessUnsupported", "peer access is not supported between these two devices",
     "PeerAccessUnsupportedError", None, False),
    (400, "cudaErrorInvalidResourceHandle", "invalid resource handle", "InvalidResourceHandleError", ValueError,
     False),
    (401, "cudaErrorIllegalState", "the operation cannot be performed in the present state", "IllegalStateError",
     None, False),
    (500, "cudaErrorNotFound", "named symbol not found", "NotFoundError", None, False),
    (600, "cudaErrorNotReady", "device not ready", "NotReadyError", None, False),
    (700, "cudaErrorIllegalAddress", "an illegal memory access was encountered", "IllegalAddressError", None,
     True),
    (701, "cudaErrorLaunchOutOfResources", "too many resources requested for launch",
     "LaunchOutOfResourcesError", None, False),
    (702, "cudaErrorLaunchTimeout", "the launch timed out and was terminated", "LaunchTimeoutError", None, True),
    (709, "cudaErrorContextIsDestroyed", "context is destroyed", "ContextIsDestroyedError", None, False),
    (710, "cudaErrorAssert", "device-side assert triggered", "DeviceAssertError", None, True),
    (719, "cudaErrorLaunchFailure", "unspecified launch failure", "LaunchFailureError", None, True),
    (800, "cudaErrorNotPermitted", "operation not permitted", "NotPermittedError", PermissionError, False),
    (801, "cudaErrorNotSupported", "operation not supported", "NotSupportedError", None, False),
    (805, "cudaErrorMpsConnectionFailed",
     "MPS client failed to connect to the MPS control daemon or the MPS server", "MpsConnectionError",
     ConnectionError, False),
    (806, "cudaErrorMpsRpcFailure", "the remote procedural call between the MPS server and the MPS client failed",
     "MpsRpcFailureError", ConnectionError, False),
    (807, "cudaErrorMpsServerNotReady", "MPS server is not ready to accept new MPS client requests",
     "MpsServerNotReadyError", None, False),
    (808, "cudaErrorMpsMaxClientsReached",
     "the hardware resources required to create MPS client have been exhausted", "MpsMaxClientsReachedError",
     None, False),
    (809, "cudaErrorMpsMaxConnectionsReached",
     "the hardware resources required to support device connections have been exhausted",
     "MpsMaxConnectionsReachedError", None, False),
    (810, "cudaErrorMpsClientTerminated", "the MPS client has been terminated by the server",
     "MpsClientTerminatedError", None, True),
    (900, "cudaErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing",
     "StreamCaptureUnsupportedError", None, False),
    (901, "cudaErrorStreamCaptureInvalidated", "operation failed due to a previous error during capture",
     "StreamCaptureInvalidatedError", None, False),
    (902, "cudaErrorStreamCaptureMerge", "operation would result in a merge of separate capture sequences",
     "StreamCaptureMergeError", None, False),
    (903, "cudaErrorStreamCaptureUnmatched", "capture was not ended in the same stream as it began",
     "StreamCaptureUnmatchedError", None, False),
    (904, "cudaErrorStreamCaptureUnjoined", "capturing stream has unjoined work", "StreamCaptureUnjoinedError",
     None, False),
    (905, "cudaErrorStreamCaptureIsolation",
     "dependency created on uncaptured work in another stream", "StreamCaptureIsolationError", None, False),
    (906, "cudaErrorStreamCaptureImplicit",
     "operation would make the legacy stream depend on a capturing blocking stream",
     "StreamCaptureImplicitError", None, False),
    (907, "cudaErrorCapturedEvent", "operation not permitted on an event last recorded in a capturing stream",
     "CapturedEventError", None, False),
    (908, "cudaErrorStreamCaptureWrongThread",
     "attempt to terminate a thread-local capture sequence from another thread",
     "StreamCaptureWrongThreadError", None, False),
    (910, "cudaErrorGraphExecUpdateFailure", "the graph update was not performed because it included changes "
     "which violated constraints specific to instantiated graph update", "GraphExecUpdateFailureError", None,
     False),
    (999, "cudaErrorUnknown", "unknown error", "UnknownError", None, False),
]

_ROWS: dict[int, tuple[str, str, str, bool]] = {
    code: (name, message, cls_name, sticky) for code, name, message, cls_name, _base, sticky in _TABLE
}
ERROR_CLASSES: dict[int, type[CudaError]] = {}
for _code, _name, _message, _cls_name, _base, _sticky in _TABLE:
    _bases = (CudaError, _base) if _base else (CudaError,)
    ERROR_CLASSES[_code] = type(_cls_name, _bases, {
        "code": _code, "name": _name, "description": _message, "sticky": _sticky,
        "__module__": "mpsd_protocol", "__doc__": f"{_name} ({_code}): {_message}.",
    })
CODES_BY_NAME: dict[str, int] = {row[0]: code for code, row in _ROWS.items()}

# Module-level names for the classes, so `from mpsd_protocol import IllegalAddressError` works.
globals().update({cls.__name__: cls for cls in ERROR_CLASSES.values()})


def error_class(code: int) -> type[CudaError]:
    """The exception class for a CUDA error code (the generic `CudaError` for codes with none)."""
    return ERROR_CLASSES.get(code, CudaError)


def make_error(code: int, detail: str | None = None) -> CudaError:
    """An exception instance for `code`, with `detail` appended to the runtime's message."""
    cls = ERROR_CLASSES.get(code)
    return cls(detail) if cls else CudaError(detail, code=code)


def error_from_wire(payload: Any) -> CudaError:
    """Rebuild an error sent as ``{code, name, message}``; a malformed payload becomes cudaErrorUnknown."""
    if isinstance(payload, dict) and isinstance(payload.get("code"), int):
        message = payload.get("message")
        return make_error(payload["code"], message if isinstance(message, str) and message else None)
    return make_error(999, f"malformed error payload {brief(payload, 80)}")


def error_name(code: int) -> str:
    """``cudaGetErrorName``: the enumerator's name for `code`."""
    return "cudaSuccess" if code == 0 else make_error(code).name


def error_string(code: int) -> str:
    """``cudaGetErrorString``: the runtime's message for `code`."""
    return "no error" if code == 0 else make_error(code).description
