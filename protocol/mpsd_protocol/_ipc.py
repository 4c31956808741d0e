# IPC handles: 64 opaque bytes, as cudaIpcMemHandle_t and cudaIpcEventHandle_t are. Ours hold a magic, a
# version, what the handle is for, the device, the daemon's export id and a 128-bit random secret: the
# secret is what makes a handle unguessable, so only a process that was given one can open the export.
from __future__ import annotations

import struct
from dataclasses import dataclass

from ._errors import InvalidValueError

IPC_HANDLE_SIZE = 64
MEMORY, EVENT = 1, 2
_MAGIC = b"MPSD"
_VERSION = 1
_LAYOUT = struct.Struct("<4sBBHQ16s")  # magic, version, kind, device, export id, secret; zero padding after


@dataclass(frozen=True, slots=True)
class IpcHandle:
    """The fields of a handle."""

    kind: int
    device: int
    export_id: int
    secret: bytes

    def to_bytes(self) -> bytes:
        body = _LAYOUT.pack(_MAGIC, _VERSION, self.kind, self.device, self.export_id, self.secret)
        return body + bytes(IPC_HANDLE_SIZE - len(body))

    @classmethod
    def from_bytes(cls, data: object, kind: int) -> IpcHandle:
        """Parse a handle of `kind`.

        Raises:
            InvalidValueError: not 64 bytes, not one of ours, or a handle of another kind.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) != IPC_HANDLE_SIZE:
            raise InvalidValueError(f"an IPC handle is {IPC_HANDLE_SIZE} bytes")
        magic, version, found, device, export_id, secret = _LAYOUT.unpack_from(bytes(data))
        if magic != _MAGIC or version != _VERSION:
            raise InvalidValueError("not an mpsd IPC handle (or one from an incompatible version)")
        if found != kind:
            raise InvalidValueError(f"an IPC {'event' if found == EVENT else 'memory'} handle used as the other kind")
        return cls(found, device, export_id, secret)
