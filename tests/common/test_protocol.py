"""common/wire/protocol.py: the plain-map codec (requests as the typed structs: test_messages.py)."""

import msgpack
import pytest

from common.wire.protocol import (PROTOCOL_VERSION, ErrorCode, ProtocolError, error_reply, pack, parse_store_address,
                                  parse_tcp_store, request, store_address, tcp_store_name, unpack)


def test_pack_unpack_round_trip():
    message = {"v": 1, "op": "x", "id": 3, "nested": {"a": [1, 2.5, None, True]}, "blob": b"\x00\xff", "s": "é"}
    assert unpack(pack(message)) == message


def test_unpack_size_limit():
    frame = pack({"v": 1, "pad": "x" * 100})
    assert unpack(frame, max_bytes=len(frame))["pad"] == "x" * 100
    with pytest.raises(ProtocolError) as info:
        unpack(frame, max_bytes=len(frame) - 1)
    assert info.value.code == ErrorCode.TOO_LARGE


@pytest.mark.parametrize("frame", [b"\xc1", b"", b"\x92\x01", pack({"a": 1}) + b"\x01", b"\xde\xad\xbe\xef" * 4,
                                   msgpack.packb({1: "int key"})])
def test_garbage_is_malformed(frame):
    with pytest.raises(ProtocolError) as info:
        unpack(frame)
    assert info.value.code == ErrorCode.MALFORMED


@pytest.mark.parametrize("value", [[1, 2], "text", 3, None, True])
def test_non_map_is_malformed(value):
    with pytest.raises(ProtocolError) as info:
        unpack(pack(value))
    assert info.value.code == ErrorCode.MALFORMED


def test_requests_and_error_replies():
    assert request("get_job", 5, wait_ms=3) == {"v": PROTOCOL_VERSION, "op": "get_job", "id": 5, "wait_ms": 3}
    err = error_reply(None, ErrorCode.UNKNOWN_OP, "nope")
    assert err["ok"] is False and err["id"] is None
    assert err["error"] == {"code": ErrorCode.UNKNOWN_OP, "message": "nope"}
    assert unpack(pack(err)) == err


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
