"""common/wire/protocol.py: codec, request parsing and field checks."""

import msgpack
import pytest

from common.wire.protocol import (PROTOCOL_VERSION, REQUESTS, ErrorCode, ProtocolError, Request, error_reply, field_of,
                             ok_reply, pack, parse_request, parse_store_address, parse_tcp_store,
                             store_address, tcp_store_name, unpack)


def request(op: str, request_id: int, **fields) -> dict:
    """A request map as a client sends it."""
    return {"v": PROTOCOL_VERSION, "op": op, "id": request_id, **fields}


# a minimal valid value for every required request field
FIELD_VALUES = {"role": "target", "name": "w", "pid": 123, "host": "h", "worker_id": "t0", "wait_ms": 10,
                "job_id": 5, "generation": 1, "busy_s": 0.5, "reason": "oom", "job_ids": [1, 2],
                "token": "t", "holding": [], "model": "m", "step": 3, "ipc_block": {"handle": b"\x01"}, "num_slots": 2,
                "after": 1, "membership": 2}


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


def test_parse_request_ok():
    req = parse_request(unpack(pack(request("get_job", 7, worker_id="t0", token="k", wait_ms=100, extra="x"))))
    assert req == Request(op="get_job", id=7, fields={"worker_id": "t0", "token": "k", "wait_ms": 100, "extra": "x"})


@pytest.mark.parametrize("op", sorted(REQUESTS))
def test_every_op_parses_with_its_required_fields(op):
    fields = {name: FIELD_VALUES[name] for name in REQUESTS[op]}
    req = parse_request(unpack(pack(request(op, 11, **fields))))
    assert req.op == op and req.id == 11 and req.fields == fields


@pytest.mark.parametrize("op", sorted(op for op in REQUESTS if REQUESTS[op]))
def test_every_missing_field_is_named(op):
    for missing in REQUESTS[op]:
        fields = {name: FIELD_VALUES[name] for name in REQUESTS[op] if name != missing}
        with pytest.raises(ProtocolError) as info:
            parse_request(request(op, 4, **fields))
        assert info.value.code == ErrorCode.MALFORMED
        assert missing in info.value.message
        assert info.value.request_id == 4


@pytest.mark.parametrize("version", [PROTOCOL_VERSION + 1, 0, "1", None])
def test_wrong_version(version):
    message = request("heartbeat", 9, worker_id="t0")
    message["v"] = version
    with pytest.raises(ProtocolError) as info:
        parse_request(message)
    assert info.value.code == ErrorCode.BAD_VERSION
    assert info.value.request_id == 9


def test_missing_version():
    with pytest.raises(ProtocolError) as info:
        parse_request({"op": "heartbeat", "id": 1, "worker_id": "t0"})
    assert info.value.code == ErrorCode.BAD_VERSION


@pytest.mark.parametrize("op", ["reboot", "", None, 3, ["get_job"]])
def test_unknown_op(op):
    with pytest.raises(ProtocolError) as info:
        parse_request({"v": PROTOCOL_VERSION, "op": op, "id": 2})
    assert info.value.code == ErrorCode.UNKNOWN_OP
    assert info.value.request_id == 2


@pytest.mark.parametrize("request_id", ["1", 1.0, True, None, [1]])
def test_non_int_id_is_malformed(request_id):
    with pytest.raises(ProtocolError) as info:
        parse_request({"v": PROTOCOL_VERSION, "op": "stats", "id": request_id})
    assert info.value.code == ErrorCode.MALFORMED


def test_missing_id_defaults_to_zero():
    assert parse_request({"v": PROTOCOL_VERSION, "op": "stats"}).id == 0


def test_replies():
    ok = ok_reply(5, step=3)
    assert ok == {"v": PROTOCOL_VERSION, "id": 5, "ok": True, "step": 3}
    err = error_reply(None, ErrorCode.UNKNOWN_OP, "nope")
    assert err["ok"] is False and err["id"] is None
    assert err["error"] == {"code": ErrorCode.UNKNOWN_OP, "message": "nope"}
    assert unpack(pack(err)) == err


def test_protocol_error_carries_code_and_message():
    exc = ProtocolError(ErrorCode.BAD_STATE, "stale", 8)
    assert exc.code == ErrorCode.BAD_STATE and exc.message == "stale" and exc.request_id == 8
    assert "bad_state" in str(exc) and "stale" in str(exc)


# -- field_of -------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, kind", [
    (3, int), (0, int), (-1, int), ("x", str), (True, bool), (False, bool), ([1], list), ({}, dict),
    (1.5, (int, float)), (2, (int, float)), (True, (int, bool)),
])
def test_field_of_accepts(value, kind):
    assert field_of({"f": value}, "f", kind) is value


@pytest.mark.parametrize("fields, kind", [
    ({"f": True}, int), ({"f": False}, int),          # a bool is not an int
    ({"f": True}, (int, float)), ({"f": "3"}, int), ({"f": 3.0}, int), ({"f": None}, int),
    ({}, int), ({}, str), ({"f": 1}, str), ({"f": 1}, bool), ({"f": (1,)}, list),
])
def test_field_of_rejects(fields, kind):
    with pytest.raises(ProtocolError) as info:
        field_of(fields, "f", kind)
    assert info.value.code == ErrorCode.MALFORMED
    assert "'f'" in info.value.message


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
