"""The typed wire: what a decoded request refuses, and that every reply type round-trips."""

import msgpack
import msgspec
import pytest

from common.wire import messages as m


def pack(fields: dict) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def plain(value):
    """A decoded field as the plain msgpack values it travelled as (a struct as its map)."""
    return msgpack.unpackb(m.encode(value)) if isinstance(value, msgspec.Struct) else value


def refused(fields) -> tuple[str, int | None, str]:
    with pytest.raises(m.ProtocolError) as caught:
        m.decode_request(pack(fields))
    return caught.value.code, caught.value.request_id, caught.value.message


def test_a_request_round_trips_as_the_struct_it_was():
    sent = m.CommitStep(id=7, worker_id="d0.1", token="t", model="m", step=3, job_ids=[4, 5], busy_s=1,
                        metrics={"loss": 2.5, "step": 2}, rank_jobs=[1, 1], rank_busy_s=[0.5, 0.5])
    got = m.decode_request(m.encode(sent))
    assert got == sent and isinstance(got, m.CommitStep) and m.op_of(got) == "commit_step"
    assert msgpack.unpackb(m.encode(sent))["op"] == "commit_step"  # the wire keeps the op as a map field


def test_bad_requests_get_the_code_and_the_field_they_broke():
    v = m.PROTOCOL_VERSION
    assert refused({"v": 99, "op": "get_job", "id": 3})[:2] == (m.ErrorCode.BAD_VERSION, 3)
    assert refused({"v": v, "op": "launch_missiles", "id": 4})[:2] == (m.ErrorCode.UNKNOWN_OP, 4)
    code, rid, message = refused({"v": v, "op": "get_job", "id": 5})
    assert (code, rid) == (m.ErrorCode.MALFORMED, 5) and "wait_ms" in message
    code, _, message = refused({"v": v, "op": "get_job", "id": 6, "wait_ms": True})  # a bool is no integer
    assert code == m.ErrorCode.MALFORMED and "$.wait_ms" in message
    code, _, message = refused({"v": v, "op": "register", "id": 8, "role": "boss", "name": "x", "pid": 1, "host": "h"})
    assert code == m.ErrorCode.MALFORMED and "$.role" in message
    code, _, message = refused({"v": v, "op": "commit_step", "id": 9, "model": "m", "step": 1, "job_ids": [1],
                                "busy_s": 0.1, "rank_jobs": [1], "rank_busy_s": []})
    assert code == m.ErrorCode.MALFORMED and "equal length" in message
    code, _, message = refused({"v": v, "op": "checkpoint", "id": 10, "model": "m", "step": 1,
                                "metrics": {f"k{i}": 1.0 for i in range(m.MAX_STEP_METRICS + 1)}})
    assert code == m.ErrorCode.MALFORMED and "$.metrics" in message
    assert refused([1, 2])[0] == m.ErrorCode.MALFORMED
    with pytest.raises(m.ProtocolError) as caught:
        m.decode_request(b"\xc1 not msgpack")
    assert caught.value.code == m.ErrorCode.MALFORMED
    with pytest.raises(m.ProtocolError) as caught:
        m.decode_request(b"x" * 100, max_bytes=10)
    assert caught.value.code == m.ErrorCode.TOO_LARGE


def test_unknown_fields_of_a_newer_peer_are_ignored():
    got = m.decode_request(pack({"v": m.PROTOCOL_VERSION, "op": "consumed", "id": 1, "worker_id": "d0.1",
                                 "job_id": 3, "comes_later": [1, 2]}))
    assert got == m.Consumed(id=1, worker_id="d0.1", job_id=3)


def test_every_op_has_a_reply_type_and_an_error_reply_raises():
    assert m.REQUEST_TYPES.keys() == m.REPLY_TYPES.keys()
    job = m.Job(job_id=1, epoch=0, bucket=2, seq_len=64, samples=[3, 4], lengths=[60, 64], num_tokens=124, slot=5,
                generation=9, grant=1)
    frame = m.encode(m.GrantReply(id=12, job=job, done=False, flush=True))
    assert m.reply_id(frame) == 12
    assert m.decode_reply(frame, "get_hs") == m.GrantReply(id=12, job=job, done=False, flush=True)
    with pytest.raises(m.ProtocolError) as caught:
        m.decode_reply(m.encode(m.error_reply(13, m.ErrorCode.BAD_STATE, "job 1 is not extracting")), "job_ready")
    assert (caught.value.code, caught.value.message) == (m.ErrorCode.BAD_STATE, "job 1 is not extracting")
    with pytest.raises(m.ProtocolError) as caught:  # a reply without the op's fields breaks the protocol
        m.decode_reply(m.encode(m.Ack(id=14)), "commit_step")
    assert caught.value.code == m.ErrorCode.MALFORMED


# -- every request: its required fields, version, op and id ---------------------------------------

# a nixl target's export of its slots, as it travels
NIXL_EXPORT = {"kind": "nixl", "node": "n0", "arena": "hsd_r_1", "agent": "a", "metadata": b"\x01", "base": 0,
               "nbytes": 8192}
# a minimal valid value for every required request field
FIELD_VALUES = {"role": "target", "name": "w", "pid": 123, "host": "h", "wait_ms": 10, "job_id": 5, "generation": 1,
                "busy_s": 0.5, "job_ids": [1, 2], "holding": [], "model": "m", "step": 3,
                "ipc_block": NIXL_EXPORT, "num_slots": 2, "after": 1, "membership": 2}


def required(kind: type) -> list[str]:
    return [f.name for f in msgspec.structs.fields(kind) if f.required]


@pytest.mark.parametrize("op", sorted(m.REQUEST_TYPES))
def test_every_op_decodes_with_its_required_fields(op):
    fields = {name: FIELD_VALUES[name] for name in required(m.REQUEST_TYPES[op])}
    got = m.decode_request(pack({"v": m.PROTOCOL_VERSION, "op": op, "id": 11, **fields}))
    assert type(got) is m.REQUEST_TYPES[op] and got.id == 11
    assert {name: plain(getattr(got, name)) for name in fields} == fields


@pytest.mark.parametrize("op", sorted(op for op, kind in m.REQUEST_TYPES.items() if required(kind)))
def test_every_missing_field_is_named(op):
    names = required(m.REQUEST_TYPES[op])
    for missing in names:
        fields = {name: FIELD_VALUES[name] for name in names if name != missing}
        code, request_id, message = refused({"v": m.PROTOCOL_VERSION, "op": op, "id": 4, **fields})
        assert (code, request_id) == (m.ErrorCode.MALFORMED, 4) and missing in message and op in message


@pytest.mark.parametrize("version", [m.PROTOCOL_VERSION + 1, 0, "1", None])
def test_wrong_or_missing_version(version):
    assert refused({"v": version, "op": "heartbeat", "id": 9, "holding": []})[:2] == (m.ErrorCode.BAD_VERSION, 9)
    assert refused({"op": "heartbeat", "id": 1, "holding": []})[0] == m.ErrorCode.BAD_VERSION


@pytest.mark.parametrize("op", ["reboot", "", None, 3, ["get_job"]])
def test_unknown_op(op):
    assert refused({"v": m.PROTOCOL_VERSION, "op": op, "id": 2})[:2] == (m.ErrorCode.UNKNOWN_OP, 2)


@pytest.mark.parametrize("request_id", ["1", 1.0, True, None, [1]])
def test_non_int_id_is_malformed(request_id):
    assert refused({"v": m.PROTOCOL_VERSION, "op": "stats", "id": request_id})[0] == m.ErrorCode.MALFORMED


def test_missing_id_defaults_to_zero():
    assert m.decode_request(pack({"v": m.PROTOCOL_VERSION, "op": "stats"})).id == 0


# -- what a field's type refuses (the dispatcher's checks of old) -----------------------------------

REGISTER = {"v": m.PROTOCOL_VERSION, "op": "register", "id": 3, "role": "drafter", "name": "d", "pid": 1, "host": "h"}


@pytest.mark.parametrize("fields, path", [
    ({"op": "heartbeat", "holding": [1, True]}, "$.holding[1]"),
    ({"op": "heartbeat", "holding": [], "seen_grant": "7"}, "$.seen_grant"),
    ({"op": "commit_step", "model": "m", "step": 1, "job_ids": [1, "2"], "busy_s": 0.1}, "$.job_ids[1]"),
    ({"op": "commit_step", "model": "m", "step": 1, "job_ids": [1], "busy_s": 0.1, "rank_jobs": [-1],
      "rank_busy_s": [0.1]}, "$.rank_jobs[0]"),
    ({"op": "commit_step", "model": "m", "step": 1, "job_ids": [1], "busy_s": 0.1, "cost_jobs": [None]},
     "$.cost_jobs[0]"),
    ({"op": "get_hs", "wait_ms": 0, "membership": 1.5}, "$.membership"),
    ({"op": "register_slots", "ipc_block": NIXL_EXPORT, "num_slots": -1}, "$.num_slots"),
    ({**REGISTER, "contract": [1]}, "$.contract"),
    ({**REGISTER, "model": "m"}, "$.model"),
    ({**REGISTER, "model": {"id": "", "step": 0}}, "$.model.id"),
    ({**REGISTER, "model": {"id": "m", "step": -1}}, "$.model.step"),
    ({**REGISTER, "model": {"id": "m", "step": 0, "pending": {"step": 1, "job_ids": [True]}}},
     "$.model.pending.job_ids[0]"),
    ({**REGISTER, "model": {"id": "m", "step": 0, "group": {"size": "2"}}}, "$.model.group.size"),
    ({**REGISTER, "model": {"id": "m", "step": 0, "group": {"size": 2, "balance": 1}}}, "$.model.group.balance"),
])
def test_an_ill_typed_field_is_malformed_naming_its_path(fields, path):
    code, _, message = refused({"v": m.PROTOCOL_VERSION, "id": 3, "worker_id": "d0.1", **fields})
    assert code == m.ErrorCode.MALFORMED and path in message


def test_a_checkpoint_past_the_models_own_step_is_malformed():
    code, _, message = refused({**REGISTER, "model": {"id": "m", "step": 0, "checkpoint": 2}})
    assert code == m.ErrorCode.MALFORMED and "model.checkpoint" in message
