"""common/wire/messages.py at the frame level: what is no request at all, error replies, the
protocol error, and a group's rendezvous store names (the requests' fields: test_messages.py)."""

import msgpack
import pytest

from common.wire.messages import (PROTOCOL_VERSION, ErrorCode, ProtocolError, decode_any, decode_request, encode,
                                  error_reply)
from common.wire.store_names import parse_store_address, parse_tcp_store, store_address, tcp_store_name


@pytest.mark.parametrize("frame", [b"\xc1", b"", b"\x92\x01", msgpack.packb({"a": 1}) + b"\x01", b"\xde\xad\xbe\xef" * 4,
                                   msgpack.packb({1: "int key"})])
def test_garbage_is_malformed(frame):
    with pytest.raises(ProtocolError) as info:
        decode_request(frame)
    assert info.value.code == ErrorCode.MALFORMED


@pytest.mark.parametrize("value", [[1, 2], "text", 3, None, True])
def test_non_map_is_malformed(value):
    with pytest.raises(ProtocolError) as info:
        decode_request(msgpack.packb(value))
    assert info.value.code == ErrorCode.MALFORMED


def test_an_error_reply_on_the_wire():
    frame = encode(error_reply(None, ErrorCode.UNKNOWN_OP, "nope"))
    assert decode_any(frame) == {"v": PROTOCOL_VERSION, "id": None, "ok": False, "error": {"code": ErrorCode.UNKNOWN_OP, "message": "nope"}}


def test_protocol_error_carries_code_and_message():
    exc = ProtocolError(ErrorCode.BAD_STATE, "stale", 8)
    assert exc.code == ErrorCode.BAD_STATE and exc.message == "stale" and exc.request_id == 8
    assert "bad_state" in str(exc) and "stale" in str(exc)


# -- a group's rendezvous store -------------------------------------------------------------------

@pytest.mark.parametrize("host, port", [("10.0.0.7", 29500), ("node-b.cluster", 1), ("::1", 65535)])
def test_a_tcp_store_name_round_trips(host, port):
    address = store_address(host, port)
    assert parse_store_address(address) == (host, port)
    assert parse_tcp_store(tcp_store_name(address, "m/i2-v7")) == (host, port, "m/i2-v7")


def test_a_file_store_path_is_no_tcp_store():
    assert parse_tcp_store("/runs/x/groups/m/i0-v1") is None


@pytest.mark.parametrize("value", ["10.0.0.7", "10.0.0.7:0", "10.0.0.7:65536", ":29500", "h:port", "a b:1", 29500,
                                   None, "tcp://h:1"])
def test_a_bad_store_address_is_malformed_naming_the_field(value):
    with pytest.raises(ProtocolError) as info:
        parse_store_address(value)
    assert info.value.code == ErrorCode.MALFORMED and "model.group.store" in info.value.message
