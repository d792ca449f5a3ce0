"""Exceptions: one class per kind of end, all under tdpipe.Error.

Every exception carries the library's error code (``code``, negative int),
its name (``errname``, e.g. ``"ECONNRESET"``) and message.
"""
import builtins

from . import _tdpipe


class Error(Exception):
    """Base of every tdpipe error."""

    code = None
    errname = None


class ClosedError(Error):
    """The peer ended the stream cleanly after its last message (ECLOSED)."""


class PeerError(Error, builtins.ConnectionResetError):
    """The peer died or vanished (ECONNRESET)."""


class TimeoutError(Error, builtins.TimeoutError):
    """A deadline passed (ETIMEDOUT); the pipe stays usable after a receive timeout."""


class ProtocolError(Error):
    """The peer sent something invalid or speaks another version
    (EPROTO, ESCHEMA, EMISMATCH, EVERSION, EMSGSIZE); the pipe is closed."""


class SchemaError(Error, builtins.ValueError):
    """What this side tried to send breaks a rule of the schema (a key with
    '.', an empty key, a sub-dict named like a reserved field, a value or
    key over its size limit, ...): raised by send before anything goes out;
    the message names the key and the rule. The pipe stays usable."""


class RefusedError(Error, builtins.ConnectionRefusedError):
    """Nobody listens there, or a server turned this client away
    (ECONNREFUSED, ELIMIT)."""


class CanceledError(Error):
    """The operation was canceled: this side closed or freed the pipe (ECANCELED)."""


class AuthError(Error, builtins.PermissionError):
    """The shared secret did not match, or one side had none (EAUTH, with
    libraries that have shared-secret authentication)."""


class ChecksumError(Error):
    """A message arrived with a payload that does not match its checksum
    (ECHECKSUM, pipes with the payload checksum): it was dropped; the pipe
    goes on and the next receive returns the next message."""


_BY_NAME = {
    "EAUTH": AuthError,
    "ECHECKSUM": ChecksumError,
    "ECLOSED": ClosedError,
    "ECONNRESET": PeerError,
    "ETIMEDOUT": TimeoutError,
    "EPROTO": ProtocolError,
    "ESCHEMA": ProtocolError,
    "EMISMATCH": ProtocolError,
    "EVERSION": ProtocolError,
    "EMSGSIZE": ProtocolError,
    "ECONNREFUSED": RefusedError,
    "ELIMIT": RefusedError,
    "ECANCELED": CanceledError,
}


def error_for(code):
    """The exception object for a library error code (as the Server passes
    to on_close), or None for TDP_OK."""
    if code == 0:
        return None
    name = _tdpipe.errname(code)
    return _make_error(code, name, "%s (%s)" % (_tdpipe.strerror(code), name))


def _make_error(code, name, message):
    exc = _BY_NAME.get(name, Error)(message)
    exc.code = code
    exc.errname = name
    return exc


_tdpipe._set_error_factory(_make_error)
