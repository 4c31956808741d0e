"""mpsd_protocol: the sans-IO wire protocol of mpsd, its one table of calls, and the one CUDA error table.

No socket I/O and no trio here: the daemon, the blocking client and the trio client are thin I/O loops around
`Connection`. (`peer_credentials` and `check_server` read one socket option, so that both ends apply the same
rule about whom to trust.)
"""
from ._brief import brief
from ._calls import (
    CALL,
    CAPTURE_ACTIVE,
    CAPTURE_GLOBAL,
    CAPTURE_INVALIDATED,
    CAPTURE_NONE,
    CAPTURE_RELAXED,
    CAPTURE_THREAD_LOCAL,
    COPY,
    EVENT_EXTERNAL,
    QUERY_EVENT,
    QUERY_STREAM,
    SYNC_DEVICE,
    SYNC_EVENT,
    SYNC_STREAM,
    UNSAFE,
    WORK,
    CALLS,
    CLOCK,
    EVENT_HANDLE,
    LAUNCH,
    NOTHING,
    POOL_ALLOC,
    POOL_FREE,
    POOL_GRAPH_FREE,
    POOL_RELEASE,
    STREAM_HANDLE,
    SYNC,
    Arg,
    Call,
    Calls,
    Kind,
)
from ._control import (CONTROL_PACKET, PROTOCOL_FILE, V3_MODULES, control_packets, read_control_answer,
                       read_control_reply)
from . import _errors
from ._dirs import (
    DEFAULT_LOG_DIRECTORY,
    DEFAULT_PIPE_DIRECTORY,
    LOG_VARIABLES,
    PIPE_VARIABLES,
    log_directory,
    pipe_directory,
)
from ._connection import CLOSED, HEADER, HELLO, IPC_FREED, NEED_DATA, PROTOCOL_ERROR, Connection, Role
from ._errors import (
    CODES_BY_NAME,
    DRIVER_ALIASES,
    DRIVER_CODES_BY_NAME,
    ERROR_CLASSES,
    CudaError,
    driver_error,
    driver_error_name,
    driver_error_string,
    error_class,
    error_from_wire,
    error_name,
    error_string,
    make_error,
    runtime_error,
)
from ._errors import *  # noqa: F403  (the table's classes, InvalidValueError, ...: _errors.__all__ lists them)
from ._fds import ANCILLARY_SIZE, RECV_FLAGS, close_fds, pack_fds, unpack_fds
from ._ipc import EVENT, IPC_HANDLE_SIZE, MEMORY, IpcHandle
from ._launch import PARAM_KINDS, check_args, check_shape, dims
from ._messages import (
    MAX_FDS_PER_FRAME,
    PROTOCOL_VERSION,
    LocalProtocolError,
    Message,
    Notification,
    ProtocolError,
    RemoteProtocolError,
    Reply,
    Request,
)
from ._peer import check_server, peer_credentials
from ._spin import SpinOdds
from ._units import (DEFAULT_CONNECTIONS, MAX_CONNECTIONS, format_size, parse_decimal, parse_integer, parse_mem_limits,
                     parse_percentage, parse_size)

__all__ = [
    "brief", "CALL", "CAPTURE_ACTIVE", "CAPTURE_GLOBAL", "CAPTURE_INVALIDATED", "CAPTURE_NONE", "CAPTURE_RELAXED",
    "CAPTURE_THREAD_LOCAL", "COPY", "EVENT_EXTERNAL", "QUERY_EVENT", "QUERY_STREAM", "SYNC_DEVICE", "SYNC_EVENT",
    "SYNC_STREAM", "UNSAFE", "WORK", "CALLS", "CLOCK", "EVENT_HANDLE", "LAUNCH", "NOTHING", "POOL_ALLOC", "POOL_FREE",
    "POOL_GRAPH_FREE", "POOL_RELEASE",
    "STREAM_HANDLE", "SYNC", "Arg", "Call", "Calls", "Kind", "CONTROL_PACKET", "control_packets", "read_control_answer",
    "read_control_reply", "PROTOCOL_FILE", "V3_MODULES",
    "DEFAULT_LOG_DIRECTORY", "DEFAULT_PIPE_DIRECTORY", "LOG_VARIABLES", "PIPE_VARIABLES", "log_directory",
    "pipe_directory",
    "CLOSED", "HEADER", "HELLO", "IPC_FREED", "NEED_DATA", "PROTOCOL_ERROR", "Connection", "Role",
    "CODES_BY_NAME", "DRIVER_ALIASES", "DRIVER_CODES_BY_NAME", "ERROR_CLASSES", "CudaError", "driver_error",
    "driver_error_name", "driver_error_string", "error_class", "error_from_wire", "error_name",
    "error_string", "make_error", "runtime_error",
    "ANCILLARY_SIZE", "RECV_FLAGS", "close_fds", "pack_fds", "unpack_fds",
    "EVENT", "IPC_HANDLE_SIZE", "MEMORY", "IpcHandle",
    "PARAM_KINDS", "check_args", "check_shape", "dims",
    "MAX_FDS_PER_FRAME", "PROTOCOL_VERSION", "LocalProtocolError", "Message", "Notification", "ProtocolError",
    "RemoteProtocolError", "Reply", "Request",
    "check_server", "peer_credentials", "SpinOdds",
    "DEFAULT_CONNECTIONS", "MAX_CONNECTIONS", "format_size", "parse_decimal", "parse_integer", "parse_percentage",
    "parse_mem_limits", "parse_size",
]
__all__ += _errors.__all__  # one exception class per error code (a form type checkers read as the names it adds)
