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


# (code, name, runtime message, class name, built-in base, sticky, driver). The driver API's CUresult shares the
# runtime's numbers wherever both have the error (CUDA_ERROR_INVALID_CONTEXT is 201 as cudaErrorDeviceUninitialized
# is), so a row holds both names: `driver` is the CUresult enumerator for the code, or, for a runtime-only code,
# the code the driver reports instead (it has no invalid-configuration error: a bad launch is
# CUDA_ERROR_INVALID_VALUE; a bad function is CUDA_ERROR_INVALID_HANDLE).
_TABLE: list[tuple[int, str, str, str, type[BaseException] | None, bool, str | int]] = [
    (1, "cudaErrorInvalidValue", "invalid argument", "InvalidValueError", ValueError, False,
     "CUDA_ERROR_INVALID_VALUE"),
    (2, "cudaErrorMemoryAllocation", "out of memory", "OutOfMemoryError", MemoryError, False,
     "CUDA_ERROR_OUT_OF_MEMORY"),
    (3, "cudaErrorInitializationError", "initialization error", "InitializationError", None, False,
     "CUDA_ERROR_NOT_INITIALIZED"),
    (4, "cudaErrorCudartUnloading", "driver shutting down", "CudartUnloadingError", None, False,
     "CUDA_ERROR_DEINITIALIZED"),
    (9, "cudaErrorInvalidConfiguration", "invalid configuration argument", "InvalidConfigurationError",
     ValueError, False, 1),
    (17, "cudaErrorInvalidDevicePointer", "invalid device pointer", "InvalidDevicePointerError", ValueError,
     False, 1),
    (46, "cudaErrorDevicesUnavailable", "CUDA-capable device(s) is/are busy or unavailable",
     "DevicesUnavailableError", None, False, "CUDA_ERROR_DEVICE_UNAVAILABLE"),
    (98, "cudaErrorInvalidDeviceFunction", "invalid device function", "InvalidDeviceFunctionError", None, False,
     400),
    (100, "cudaErrorNoDevice", "no CUDA-capable device is detected", "NoDeviceError", None, False,
     "CUDA_ERROR_NO_DEVICE"),
    (101, "cudaErrorInvalidDevice", "invalid device ordinal", "InvalidDeviceError", ValueError, False,
     "CUDA_ERROR_INVALID_DEVICE"),
    (201, "cudaErrorDeviceUninitialized", "invalid device context", "DeviceUninitializedError", None, False,
     "CUDA_ERROR_INVALID_CONTEXT"),
    (217, "cudaErrorPeerAccessUnsupported", "peer access is not supported between these two devices",
     "PeerAccessUnsupportedError", None, False, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"),
    (400, "cudaErrorInvalidResourceHandle", "invalid resource handle", "InvalidResourceHandleError", ValueError,
     False, "CUDA_ERROR_INVALID_HANDLE"),
    (401, "cudaErrorIllegalState", "the operation cannot be performed in the present state", "IllegalStateError",
     None, False, "CUDA_ERROR_ILLEGAL_STATE"),
    (500, "cudaErrorNotFound", "named symbol not found", "NotFoundError", None, False, "CUDA_ERROR_NOT_FOUND"),
    (600, "cudaErrorNotReady", "device not ready", "NotReadyError", None, False, "CUDA_ERROR_NOT_READY"),
    (700, "cudaErrorIllegalAddress", "an illegal memory access was encountered", "IllegalAddressError", None,
     True, "CUDA_ERROR_ILLEGAL_ADDRESS"),
    (701, "cudaErrorLaunchOutOfResources", "too many resources requested for launch",
     "LaunchOutOfResourcesError", None, False, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"),
    (702, "cudaErrorLaunchTimeout", "the launch timed out and was terminated", "LaunchTimeoutError", None, True,
     "CUDA_ERROR_LAUNCH_TIMEOUT"),
    (709, "cudaErrorContextIsDestroyed", "context is destroyed", "ContextIsDestroyedError", None, False,
     "CUDA_ERROR_CONTEXT_IS_DESTROYED"),
    (710, "cudaErrorAssert", "device-side assert triggered", "DeviceAssertError", None, True, "CUDA_ERROR_ASSERT"),
    (719, "cudaErrorLaunchFailure", "unspecified launch failure", "LaunchFailureError", None, True,
     "CUDA_ERROR_LAUNCH_FAILED"),
    (800, "cudaErrorNotPermitted", "operation not permitted", "NotPermittedError", PermissionError, False,
     "CUDA_ERROR_NOT_PERMITTED"),
    (801, "cudaErrorNotSupported", "operation not supported", "NotSupportedError", None, False,
     "CUDA_ERROR_NOT_SUPPORTED"),
    (805, "cudaErrorMpsConnectionFailed",
     "MPS client failed to connect to the MPS control daemon or the MPS server", "MpsConnectionError",
     ConnectionError, False, "CUDA_ERROR_MPS_CONNECTION_FAILED"),
    (806, "cudaErrorMpsRpcFailure", "the remote procedural call between the MPS server and the MPS client failed",
     "MpsRpcFailureError", ConnectionError, False, "CUDA_ERROR_MPS_RPC_FAILURE"),
    (807, "cudaErrorMpsServerNotReady", "MPS server is not ready to accept new MPS client requests",
     "MpsServerNotReadyError", None, False, "CUDA_ERROR_MPS_SERVER_NOT_READY"),
    (808, "cudaErrorMpsMaxClientsReached",
     "the hardware resources required to create MPS client have been exhausted", "MpsMaxClientsReachedError",
     None, False, "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED"),
    (809, "cudaErrorMpsMaxConnectionsReached",
     "the hardware resources required to support device connections have been exhausted",
     "MpsMaxConnectionsReachedError", None, False, "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED"),
    (810, "cudaErrorMpsClientTerminated", "the MPS client has been terminated by the server",
     "MpsClientTerminatedError", None, True, "CUDA_ERROR_MPS_CLIENT_TERMINATED"),
    (900, "cudaErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing",
     "StreamCaptureUnsupportedError", None, False, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"),
    (901, "cudaErrorStreamCaptureInvalidated", "operation failed due to a previous error during capture",
     "StreamCaptureInvalidatedError", None, False, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"),
    (902, "cudaErrorStreamCaptureMerge", "operation would result in a merge of separate capture sequences",
     "StreamCaptureMergeError", None, False, "CUDA_ERROR_STREAM_CAPTURE_MERGE"),
    (903, "cudaErrorStreamCaptureUnmatched", "capture was not ended in the same stream as it began",
     "StreamCaptureUnmatchedError", None, False, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED"),
    (904, "cudaErrorStreamCaptureUnjoined", "capturing stream has unjoined work", "StreamCaptureUnjoinedError",
     None, False, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED"),
    (905, "cudaErrorStreamCaptureIsolation",
     "dependency created on uncaptured work in another stream", "StreamCaptureIsolationError", None, False,
     "CUDA_ERROR_STREAM_CAPTURE_ISOLATION"),
    (906, "cudaErrorStreamCaptureImplicit",
     "operation would make the legacy stream depend on a capturing blocking stream",
     "StreamCaptureImplicitError", None, False, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"),
    (907, "cudaErrorCapturedEvent", "operation not permitted on an event last recorded in a capturing stream",
     "CapturedEventError", None, False, "CUDA_ERROR_CAPTURED_EVENT"),
    (908, "cudaErrorStreamCaptureWrongThread",
     "attempt to terminate a thread-local capture sequence from another thread",
     "StreamCaptureWrongThreadError", None, False, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD"),
    (910, "cudaErrorGraphExecUpdateFailure", "the graph update was not performed because it included changes "
     "which violated constraints specific to instantiated graph update", "GraphExecUpdateFailureError", None,
     False, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE"),
    (999, "cudaErrorUnknown", "unknown error", "UnknownError", None, False, "CUDA_ERROR_UNKNOWN"),
]

_ROWS: dict[int, tuple[str, str, str, bool]] = {
    code: (name, message, cls_name, sticky) for code, name, message, cls_name, _base, sticky, _driver in _TABLE
}
ERROR_CLASSES: dict[int, type[CudaError]] = {}
for _code, _name, _message, _cls_name, _base, _sticky, _driver in _TABLE:
    _bases = (CudaError, _base) if _base else (CudaError,)
    ERROR_CLASSES[_code] = type(_cls_name, _bases, {
        "code": _code, "name": _name, "description": _message, "sticky": _sticky,
        "__module__": "mpsd_protocol", "__doc__": f"{_name} ({_code}): {_message}.",
    })
CODES_BY_NAME: dict[str, int] = {row[0]: code for code, row in _ROWS.items()}
# The driver's side of the rows: each CUresult name's code, and where a code is runtime-only, the driver's code.
DRIVER_CODES_BY_NAME: dict[str, int] = {row[6]: row[0] for row in _TABLE if isinstance(row[6], str)}
_DRIVER_NAMES: dict[int, str] = {code: name for name, code in DRIVER_CODES_BY_NAME.items()}
_DRIVER_INSTEAD: dict[int, int] = {row[0]: row[6] for row in _TABLE if isinstance(row[6], int)}


def _driver_class_name(name: str) -> str:
    return "".join(word.capitalize() for word in name.removeprefix("CUDA_ERROR_").split("_")) + "Error"


# The classes under the driver's names where those differ from the runtime's (InvalidContextError is
# DeviceUninitializedError: one code, one class, so `except` catches it whichever flavour raised it).
DRIVER_ALIASES: dict[str, type[CudaError]] = {
    _driver_class_name(name): ERROR_CLASSES[code] for name, code in DRIVER_CODES_BY_NAME.items()
    if _driver_class_name(name) != ERROR_CLASSES[code].__name__
}

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


def driver_error(error: CudaError) -> CudaError:
    """`error` as the driver API reports it: its CUresult code (the driver's own where the runtime's code has no
    driver twin), a `CudaError` of that code's class whose ``name`` is the ``CUDA_ERROR_*`` enumerator."""
    code = _DRIVER_INSTEAD.get(error.code, error.code)
    converted = make_error(code, error.detail)
    converted.name = driver_error_name(code)
    converted.args = (f"{converted.name}: {converted.message}",)
    return converted


def driver_error_name(code: int) -> str:
    """``cuGetErrorName``: the CUresult enumerator's name for `code`."""
    if code == 0:
        return "CUDA_SUCCESS"
    return _DRIVER_NAMES.get(_DRIVER_INSTEAD.get(code, code), f"CUDA_ERROR_{code}")


def driver_error_string(code: int) -> str:
    """``cuGetErrorString``: the driver's message for `code` (the runtime's text: the two agree)."""
    return "no error" if code == 0 else make_error(_DRIVER_INSTEAD.get(code, code)).description
