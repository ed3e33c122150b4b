"""The control protocol's error codes, and the exception an error reply (or a message that breaks
the protocol) is raised as on either end."""

from __future__ import annotations


class ErrorCode:
    MALFORMED = "malformed"            # not a msgpack map, missing or ill-typed fields
    BAD_VERSION = "bad_version"        # protocol version differs
    UNKNOWN_OP = "unknown_op"
    TOO_LARGE = "too_large"            # message over dispatcher.max_message_bytes
    UNAUTHORIZED = "unauthorized"      # missing or wrong shared secret
    UNKNOWN_WORKER = "unknown_worker"  # not registered, or declared dead: register again
    BAD_STATE = "bad_state"            # the job is not in the state the op expects (stale lease)
    INCOMPATIBLE = "incompatible"      # the worker cannot serve this run (transport, capture contract)
    GROUP_CHANGED = "group_changed"    # the rank's membership version ended: drop the step, join_group again
    READ_ONLY = "read_only"            # a control op sent to the stats socket
    INTERNAL = "internal"


class ProtocolError(Exception):
    """An error reply from the peer, or a message that breaks the protocol."""

    def __init__(self, code: str, message: str, request_id: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id  # of the offending request, when it could be read
