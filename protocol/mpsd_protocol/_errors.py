# The one error table. Every CUDA error mpsd can report is a row here: code, name, message, and the
# exception class that carries it. Errors cross the wire as {code, name, message} and become the same
# class on the other side, so the daemon and the client never disagree about what a code means.
from __future__ import annotations

import builtins
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


# One class per code, written out so that a type checker and a reader see each. A class's attributes are its
# row of the table; ERROR_CLASSES below lists each once, in code order. `__all__` is these classes, which
# mpsd_protocol and mpsd_client re-export (`from ._errors import *`); the module's other names are imported by
# name. (`__module__` is the package's, where they are imported from, as when they were built from a table.)
__all__ = [
    "InvalidValueError", "OutOfMemoryError", "InitializationError", "CudartUnloadingError", "InvalidConfigurationError",
    "InvalidDevicePointerError", "DevicesUnavailableError", "InvalidDeviceFunctionError", "NoDeviceError",
    "InvalidDeviceError", "InvalidKernelImageError", "DeviceUninitializedError", "PeerAccessUnsupportedError",
    "KernelFileNotFoundError", "InvalidResourceHandleError",
    "IllegalStateError", "NotFoundError", "NotReadyError", "IllegalAddressError", "LaunchOutOfResourcesError",
    "LaunchTimeoutError", "ContextIsDestroyedError", "DeviceAssertError", "LaunchFailureError", "NotPermittedError",
    "NotSupportedError", "MpsConnectionError", "MpsRpcFailureError", "MpsServerNotReadyError",
    "MpsMaxClientsReachedError", "MpsMaxConnectionsReachedError", "MpsClientTerminatedError",
    "StreamCaptureUnsupportedError", "StreamCaptureInvalidatedError", "StreamCaptureMergeError",
    "StreamCaptureUnmatchedError", "StreamCaptureUnjoinedError", "StreamCaptureIsolationError",
    "StreamCaptureImplicitError", "CapturedEventError", "StreamCaptureWrongThreadError", "GraphExecUpdateFailureError",
    "UnknownError",
]


class InvalidValueError(CudaError, ValueError):
    """cudaErrorInvalidValue (1): invalid argument."""

    code = 1
    name = "cudaErrorInvalidValue"
    description = "invalid argument"


class OutOfMemoryError(CudaError, MemoryError):
    """cudaErrorMemoryAllocation (2): out of memory."""

    code = 2
    name = "cudaErrorMemoryAllocation"
    description = "out of memory"


class InitializationError(CudaError):
    """cudaErrorInitializationError (3): initialization error."""

    code = 3
    name = "cudaErrorInitializationError"
    description = "initialization error"


class CudartUnloadingError(CudaError):
    """cudaErrorCudartUnloading (4): driver shutting down."""

    code = 4
    name = "cudaErrorCudartUnloading"
    description = "driver shutting down"


class InvalidConfigurationError(CudaError, ValueError):
    """cudaErrorInvalidConfiguration (9): invalid configuration argument."""

    code = 9
    name = "cudaErrorInvalidConfiguration"
    description = "invalid configuration argument"


class InvalidDevicePointerError(CudaError, ValueError):
    """cudaErrorInvalidDevicePointer (17): invalid device pointer."""

    code = 17
    name = "cudaErrorInvalidDevicePointer"
    description = "invalid device pointer"


class DevicesUnavailableError(CudaError):
    """cudaErrorDevicesUnavailable (46): CUDA-capable device(s) is/are busy or unavailable."""

    code = 46
    name = "cudaErrorDevicesUnavailable"
    description = "CUDA-capable device(s) is/are busy or unavailable"


class InvalidDeviceFunctionError(CudaError):
    """cudaErrorInvalidDeviceFunction (98): invalid device function."""

    code = 98
    name = "cudaErrorInvalidDeviceFunction"
    description = "invalid device function"


class NoDeviceError(CudaError):
    """cudaErrorNoDevice (100): no CUDA-capable device is detected."""

    code = 100
    name = "cudaErrorNoDevice"
    description = "no CUDA-capable device is detected"


class InvalidDeviceError(CudaError, ValueError):
    """cudaErrorInvalidDevice (101): invalid device ordinal."""

    code = 101
    name = "cudaErrorInvalidDevice"
    description = "invalid device ordinal"


class InvalidKernelImageError(CudaError):
    """cudaErrorInvalidKernelImage (200): device kernel image is invalid (a module file that does not run or
    declares its kernels wrongly; CUDA_ERROR_INVALID_IMAGE to the driver)."""

    code = 200
    name = "cudaErrorInvalidKernelImage"
    description = "device kernel image is invalid"


class DeviceUninitializedError(CudaError):
    """cudaErrorDeviceUninitialized (201): invalid device context."""

    code = 201
    name = "cudaErrorDeviceUninitialized"
    description = "invalid device context"


class PeerAccessUnsupportedError(CudaError):
    """cudaErrorPeerAccessUnsupported (217): peer access is not supported between these two devices."""

    code = 217
    name = "cudaErrorPeerAccessUnsupported"
    description = "peer access is not supported between these two devices"


class KernelFileNotFoundError(CudaError, FileNotFoundError):
    """cudaErrorFileNotFound (301): file not found (a module file missing, or outside the daemon's
    --module-path). Not `FileNotFoundError` by name, which is Python's: it is one, as well as a CudaError."""

    code = 301
    name = "cudaErrorFileNotFound"
    description = "file not found"


class InvalidResourceHandleError(CudaError, ValueError):
    """cudaErrorInvalidResourceHandle (400): invalid resource handle."""

    code = 400
    name = "cudaErrorInvalidResourceHandle"
    description = "invalid resource handle"


class IllegalStateError(CudaError):
    """cudaErrorIllegalState (401): the operation cannot be performed in the present state."""

    code = 401
    name = "cudaErrorIllegalState"
    description = "the operation cannot be performed in the present state"


class NotFoundError(CudaError):
    """cudaErrorNotFound (500): named symbol not found."""

    code = 500
    name = "cudaErrorNotFound"
    description = "named symbol not found"


class NotReadyError(CudaError):
    """cudaErrorNotReady (600): device not ready."""

    code = 600
    name = "cudaErrorNotReady"
    description = "device not ready"


class IllegalAddressError(CudaError):
    """cudaErrorIllegalAddress (700): an illegal memory access was encountered."""

    code = 700
    name = "cudaErrorIllegalAddress"
    description = "an illegal memory access was encountered"
    sticky = True


class LaunchOutOfResourcesError(CudaError):
    """cudaErrorLaunchOutOfResources (701): too many resources requested for launch."""

    code = 701
    name = "cudaErrorLaunchOutOfResources"
    description = "too many resources requested for launch"


class LaunchTimeoutError(CudaError):
    """cudaErrorLaunchTimeout (702): the launch timed out and was terminated."""

    code = 702
    name = "cudaErrorLaunchTimeout"
    description = "the launch timed out and was terminated"
    sticky = True


class ContextIsDestroyedError(CudaError):
    """cudaErrorContextIsDestroyed (709): context is destroyed."""

    code = 709
    name = "cudaErrorContextIsDestroyed"
    description = "context is destroyed"


class DeviceAssertError(CudaError):
    """cudaErrorAssert (710): device-side assert triggered."""

    code = 710
    name = "cudaErrorAssert"
    description = "device-side assert triggered"
    sticky = True


class LaunchFailureError(CudaError):
    """cudaErrorLaunchFailure (719): unspecified launch failure."""

    code = 719
    name = "cudaErrorLaunchFailure"
    description = "unspecified launch failure"
    sticky = True


class NotPermittedError(CudaError, PermissionError):
    """cudaErrorNotPermitted (800): operation not permitted."""

    code = 800
    name = "cudaErrorNotPermitted"
    description = "operation not permitted"


class NotSupportedError(CudaError):
    """cudaErrorNotSupported (801): operation not supported."""

    code = 801
    name = "cudaErrorNotSupported"
    description = "operation not supported"


class MpsConnectionError(CudaError, ConnectionError):
    """cudaErrorMpsConnectionFailed (805): MPS client failed to connect to the MPS control daemon or the MPS server."""

    code = 805
    name = "cudaErrorMpsConnectionFailed"
    description = "MPS client failed to connect to the MPS control daemon or the MPS server"


class MpsRpcFailureError(CudaError, ConnectionError):
    """cudaErrorMpsRpcFailure (806): the remote procedural call between the MPS server and the MPS client failed."""

    code = 806
    name = "cudaErrorMpsRpcFailure"
    description = "the remote procedural call between the MPS server and the MPS client failed"


class MpsServerNotReadyError(CudaError):
    """cudaErrorMpsServerNotReady (807): MPS server is not ready to accept new MPS client requests."""

    code = 807
    name = "cudaErrorMpsServerNotReady"
    description = "MPS server is not ready to accept new MPS client requests"


class MpsMaxClientsReachedError(CudaError):
    """cudaErrorMpsMaxClientsReached (808): the hardware resources required to create MPS client have been exhausted."""

    code = 808
    name = "cudaErrorMpsMaxClientsReached"
    description = "the hardware resources required to create MPS client have been exhausted"


class MpsMaxConnectionsReachedError(CudaError):
    """cudaErrorMpsMaxConnectionsReached (809): the hardware resources required to support device connections have
    been exhausted."""

    code = 809
    name = "cudaErrorMpsMaxConnectionsReached"
    description = "the hardware resources required to support device connections have been exhausted"


class MpsClientTerminatedError(CudaError):
    """cudaErrorMpsClientTerminated (810): the MPS client has been terminated by the server."""

    code = 810
    name = "cudaErrorMpsClientTerminated"
    description = "the MPS client has been terminated by the server"
    sticky = True


class StreamCaptureUnsupportedError(CudaError):
    """cudaErrorStreamCaptureUnsupported (900): operation not permitted when stream is capturing."""

    code = 900
    name = "cudaErrorStreamCaptureUnsupported"
    description = "operation not permitted when stream is capturing"


class StreamCaptureInvalidatedError(CudaError):
    """cudaErrorStreamCaptureInvalidated (901): operation failed due to a previous error during capture."""

    code = 901
    name = "cudaErrorStreamCaptureInvalidated"
    description = "operation failed due to a previous error during capture"


class StreamCaptureMergeError(CudaError):
    """cudaErrorStreamCaptureMerge (902): operation would result in a merge of separate capture sequences."""

    code = 902
    name = "cudaErrorStreamCaptureMerge"
    description = "operation would result in a merge of separate capture sequences"


class StreamCaptureUnmatchedError(CudaError):
    """cudaErrorStreamCaptureUnmatched (903): capture was not ended in the same stream as it began."""

    code = 903
    name = "cudaErrorStreamCaptureUnmatched"
    description = "capture was not ended in the same stream as it began"


class StreamCaptureUnjoinedError(CudaError):
    """cudaErrorStreamCaptureUnjoined (904): capturing stream has unjoined work."""

    code = 904
    name = "cudaErrorStreamCaptureUnjoined"
    description = "capturing stream has unjoined work"


class StreamCaptureIsolationError(CudaError):
    """cudaErrorStreamCaptureIsolation (905): dependency created on uncaptured work in another stream."""

    code = 905
    name = "cudaErrorStreamCaptureIsolation"
    description = "dependency created on uncaptured work in another stream"


class StreamCaptureImplicitError(CudaError):
    """cudaErrorStreamCaptureImplicit (906): operation would make the legacy stream depend on a capturing blocking
    stream."""

    code = 906
    name = "cudaErrorStreamCaptureImplicit"
    description = "operation would make the legacy stream depend on a capturing blocking stream"


class CapturedEventError(CudaError):
    """cudaErrorCapturedEvent (907): operation not permitted on an event last recorded in a capturing stream."""

    code = 907
    name = "cudaErrorCapturedEvent"
    description = "operation not permitted on an event last recorded in a capturing stream"


class StreamCaptureWrongThreadError(CudaError):
    """cudaErrorStreamCaptureWrongThread (908): attempt to terminate a thread-local capture sequence from another
    thread."""

    code = 908
    name = "cudaErrorStreamCaptureWrongThread"
    description = "attempt to terminate a thread-local capture sequence from another thread"


class GraphExecUpdateFailureError(CudaError):
    """cudaErrorGraphExecUpdateFailure (910): the graph update was not performed because it included changes which
    violated constraints specific to instantiated graph update."""

    code = 910
    name = "cudaErrorGraphExecUpdateFailure"
    description = ("the graph update was not performed because it included changes which violated constraints "
                   "specific to instantiated graph update")
    # What the client's GraphExec.update sets on it: cudaGraphExecUpdateResult's name, and the node at fault.
    result: str
    node: int | None

class UnknownError(CudaError):
    """cudaErrorUnknown (999): unknown error."""

    code = 999
    name = "cudaErrorUnknown"
    description = "unknown error"


ERROR_CLASSES: dict[int, type[CudaError]] = {cls.code: cls for cls in (
    InvalidValueError, OutOfMemoryError, InitializationError, CudartUnloadingError, InvalidConfigurationError,
    InvalidDevicePointerError, DevicesUnavailableError, InvalidDeviceFunctionError, NoDeviceError, InvalidDeviceError,
    InvalidKernelImageError, DeviceUninitializedError, PeerAccessUnsupportedError, KernelFileNotFoundError,
    InvalidResourceHandleError, IllegalStateError, NotFoundError,
    NotReadyError, IllegalAddressError, LaunchOutOfResourcesError, LaunchTimeoutError, ContextIsDestroyedError,
    DeviceAssertError, LaunchFailureError, NotPermittedError, NotSupportedError, MpsConnectionError, MpsRpcFailureError,
    MpsServerNotReadyError, MpsMaxClientsReachedError, MpsMaxConnectionsReachedError, MpsClientTerminatedError,
    StreamCaptureUnsupportedError, StreamCaptureInvalidatedError, StreamCaptureMergeError, StreamCaptureUnmatchedError,
    StreamCaptureUnjoinedError, StreamCaptureIsolationError, StreamCaptureImplicitError, CapturedEventError,
    StreamCaptureWrongThreadError, GraphExecUpdateFailureError, UnknownError,
)}
for _cls in ERROR_CLASSES.values():
    _cls.__module__ = "mpsd_protocol"
_ROWS: dict[int, tuple[str, str, str, bool]] = {
    code: (cls.name, cls.description, cls.__name__, cls.sticky) for code, cls in ERROR_CLASSES.items()
}
CODES_BY_NAME: dict[str, int] = {row[0]: code for code, row in _ROWS.items()}
# The driver API's CUresult shares the runtime's numbers wherever both have the error (CUDA_ERROR_INVALID_CONTEXT
# is 201 as cudaErrorDeviceUninitialized is), so each code has its CUresult enumerator here, or, for a runtime-only
# code, the code the driver reports instead (it has no invalid-configuration error: a bad launch is
# CUDA_ERROR_INVALID_VALUE; a bad function is CUDA_ERROR_INVALID_HANDLE). One entry a class, in code order.
_DRIVER: dict[int, str | int] = {
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    9: 1,
    17: 1,
    46: "CUDA_ERROR_DEVICE_UNAVAILABLE",
    98: 400,
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    200: "CUDA_ERROR_INVALID_IMAGE",
    201: "CUDA_ERROR_INVALID_CONTEXT",
    217: "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
    301: "CUDA_ERROR_FILE_NOT_FOUND",
    400: "CUDA_ERROR_INVALID_HANDLE",
    401: "CUDA_ERROR_ILLEGAL_STATE",
    500: "CUDA_ERROR_NOT_FOUND",
    600: "CUDA_ERROR_NOT_READY",
    700: "CUDA_ERROR_ILLEGAL_ADDRESS",
    701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
    702: "CUDA_ERROR_LAUNCH_TIMEOUT",
    709: "CUDA_ERROR_CONTEXT_IS_DESTROYED",
    710: "CUDA_ERROR_ASSERT",
    719: "CUDA_ERROR_LAUNCH_FAILED",
    800: "CUDA_ERROR_NOT_PERMITTED",
    801: "CUDA_ERROR_NOT_SUPPORTED",
    805: "CUDA_ERROR_MPS_CONNECTION_FAILED",
    806: "CUDA_ERROR_MPS_RPC_FAILURE",
    807: "CUDA_ERROR_MPS_SERVER_NOT_READY",
    808: "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED",
    809: "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED",
    810: "CUDA_ERROR_MPS_CLIENT_TERMINATED",
    900: "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
    901: "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
    902: "CUDA_ERROR_STREAM_CAPTURE_MERGE",
    903: "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
    904: "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
    905: "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
    906: "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
    907: "CUDA_ERROR_CAPTURED_EVENT",
    908: "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
    910: "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE",
    999: "CUDA_ERROR_UNKNOWN",
}
# The driver's side: each CUresult name's code, and where a code is runtime-only, the driver's code.
DRIVER_CODES_BY_NAME: dict[str, int] = {name: code for code, name in _DRIVER.items() if isinstance(name, str)}
_DRIVER_NAMES: dict[int, str] = {code: name for name, code in DRIVER_CODES_BY_NAME.items()}
_DRIVER_INSTEAD: dict[int, int] = {code: other for code, other in _DRIVER.items() if isinstance(other, int)}


# The other way: a code the runtime's module calls do not report, and the one they report instead. A runtime
# given a missing file to load (cudaLibraryLoadFromFile) answers cudaErrorInvalidValue, where the driver's
# cuModuleLoad answers CUDA_ERROR_FILE_NOT_FOUND: the daemon sends the driver's, and the runtime flavour's
# module_load reports it as the runtime does (`runtime_error`).
_RUNTIME_INSTEAD: dict[int, int] = {301: 1}


def _driver_class_name(name: str) -> str:
    return "".join(word.capitalize() for word in name.removeprefix("CUDA_ERROR_").split("_")) + "Error"


# The classes under the driver's names where those differ from the runtime's (InvalidContextError is
# DeviceUninitializedError: one code, one class, so `except` catches it whichever flavour raised it), but for a
# name of Python's own (FileNotFoundError: KernelFileNotFoundError keeps its name), which must never be shadowed.
DRIVER_ALIASES: dict[str, type[CudaError]] = {
    _driver_class_name(name): ERROR_CLASSES[code] for name, code in DRIVER_CODES_BY_NAME.items()
    if _driver_class_name(name) != ERROR_CLASSES[code].__name__ and not hasattr(builtins, _driver_class_name(name))
}


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


def runtime_error(error: CudaError) -> CudaError:
    """`error` as the runtime API's module calls report it: where the runtime has no such answer
    (`_RUNTIME_INSTEAD`), the error of the code it gives instead, with the same detail."""
    code = _RUNTIME_INSTEAD.get(error.code)
    return error if code is None else make_error(code, error.detail)


def driver_error_name(code: int) -> str:
    """``cuGetErrorName``: the CUresult enumerator's name for `code`."""
    if code == 0:
        return "CUDA_SUCCESS"
    return _DRIVER_NAMES.get(_DRIVER_INSTEAD.get(code, code), f"CUDA_ERROR_{code}")


def driver_error_string(code: int) -> str:
    """``cuGetErrorString``: the driver's message for `code` (the runtime's text: the two agree)."""
    return "no error" if code == 0 else make_error(_DRIVER_INSTEAD.get(code, code)).description
