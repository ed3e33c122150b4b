"""The data plane's descriptors on the wire: the maps workers and the dispatcher have always sent decode
into typed structs and encode back to the same maps; a malformed one is refused naming its field."""

import json

import msgpack
import pytest

from common.run.capture_contract import CAPTURE_POINT, LEGACY_CAPTURE_POINT, CaptureContract
from common.run.descriptors import CudaIpcExport, CudaIpcInfo, NixlExport, NixlInfo, ShmInfo
from common.run.slot_layout import SlotLayout
from common.wire import messages as m

LAYOUT = SlotLayout(tokens_per_batch=64, num_layers=2, hidden_size=8, dtype="float32", max_seqs=4)
# the maps as the data plane wrote them before the descriptors were typed
LAYOUT_MAP = {"tokens_per_batch": 64, "num_layers": 2, "hidden_size": 8, "dtype": "float32", "max_seqs": 4,
              "slot_bytes": LAYOUT.slot_bytes}
TRANSPORT_MAPS = [
    {"kind": "shm", "arena": "hsd_r1_0", "num_slots": 8, "layout": LAYOUT_MAP},
    {"kind": "cuda_ipc", "num_slots": 4, "layout": LAYOUT_MAP},
    {"kind": "nixl", "num_slots": 4, "layout": LAYOUT_MAP, "run_id": "r1", "node": "n0"},
]
CUDA_EXPORT = {"kind": "cuda_ipc", "block_id": "b1", "host": "h", "pid": 7, "device_index": 0, "device_uuid": None,
               "handle": b"\x01\x02", "storage_bytes": 2 * LAYOUT.slot_bytes, "storage_offset": 0, "num_slots": 2,
               "slot_bytes": LAYOUT.slot_bytes}
NIXL_EXPORT = {"kind": "nixl", "node": "n0", "arena": "hsd_r1_t0", "agent": "owner-1", "metadata": b"\x03",
               "base": 4096, "nbytes": 2 * LAYOUT.slot_bytes}
CONTRACT = {"architecture": "Qwen3ForCausalLM", "num_layers": 8, "hidden_size": 64, "layer_ids": [1, 3, 5],
            "dtype": "float32", "final_norm": False, "capture_point": CAPTURE_POINT}


def register_reply(transport: dict, **more) -> bytes:
    return msgpack.packb({"v": m.PROTOCOL_VERSION, "id": 1, "ok": True, "worker_id": "t0.1", "token": "x",
                          "run_id": "r1", "transport": transport, "heartbeat_s": 0.5, "worker_timeout_s": 5.0,
                          "accum_steps": 1, "buckets": [64], "epochs": 1, **more}, use_bin_type=True)


def refused_request(fields: dict) -> str:
    with pytest.raises(m.ProtocolError) as caught:
        m.decode_request(msgpack.packb({"v": m.PROTOCOL_VERSION, "id": 2, "worker_id": "t0.1", **fields},
                                       use_bin_type=True))
    assert caught.value.code == m.ErrorCode.MALFORMED
    return caught.value.message


def refused_reply(frame: bytes) -> str:
    with pytest.raises(m.ProtocolError) as caught:
        m.decode_reply(frame, "register")
    assert caught.value.code == m.ErrorCode.MALFORMED
    return caught.value.message


@pytest.mark.parametrize("kind, sent", list(zip((ShmInfo, CudaIpcInfo, NixlInfo), TRANSPORT_MAPS)))
def test_a_transport_map_of_before_decodes_typed_and_encodes_the_same(kind, sent):
    reply = m.decode_reply(register_reply(sent, contract=CONTRACT), "register")
    assert type(reply.transport) is kind and reply.transport.kind == sent["kind"]
    assert reply.transport.layout == LAYOUT and reply.transport.num_slots == sent["num_slots"]
    assert reply.contract == CaptureContract.from_dict(CONTRACT)
    again = msgpack.unpackb(m.encode(reply))
    assert again["transport"] == sent and again["contract"] == CONTRACT


@pytest.mark.parametrize("kind, sent", [(CudaIpcExport, CUDA_EXPORT), (NixlExport, NIXL_EXPORT)])
def test_a_targets_export_decodes_typed_in_register_slots_and_in_a_job(kind, sent):
    request = m.decode_request(msgpack.packb({"v": m.PROTOCOL_VERSION, "op": "register_slots", "id": 2,
                                              "ipc_block": sent, "num_slots": 2}, use_bin_type=True))
    assert type(request.ipc_block) is kind and request.ipc_block.kind == sent["kind"]
    job = m.Job(job_id=1, epoch=0, bucket=64, seq_len=64, samples=[0], lengths=[64], num_tokens=64, slot=0,
                generation=1, owner="t0.1", ipc=request.ipc_block)
    grant = m.decode_reply(m.encode(m.GrantReply(id=3, job=job, done=False)), "get_hs")
    assert grant.job.ipc == request.ipc_block
    assert msgpack.unpackb(m.encode(grant))["job"]["ipc"] == sent


@pytest.mark.parametrize("ipc_block, named", [
    ({**NIXL_EXPORT, "kind": "tcp"}, "$.ipc_block.kind"),
    ({k: v for k, v in NIXL_EXPORT.items() if k != "kind"}, "`kind`"),
    ({k: v for k, v in NIXL_EXPORT.items() if k != "agent"}, "missing required field `agent` - at `$.ipc_block`"),
    ({**CUDA_EXPORT, "handle": "not bytes"}, "$.ipc_block.handle"),
    ({**CUDA_EXPORT, "num_slots": 0}, "$.ipc_block.num_slots"),
])
def test_a_malformed_export_is_refused_naming_the_field(ipc_block, named):
    message = refused_request({"op": "register_slots", "ipc_block": ipc_block, "num_slots": 2})
    assert message.startswith("register_slots: ") and named in message


@pytest.mark.parametrize("transport, named", [
    ({**TRANSPORT_MAPS[0], "kind": "tcp"}, "Invalid value 'tcp' - at `$.transport.kind`"),
    ({k: v for k, v in TRANSPORT_MAPS[0].items() if k != "arena"}, "missing required field `arena` - at `$.transport`"),
    ({k: v for k, v in TRANSPORT_MAPS[2].items() if k != "node"}, "missing required field `node` - at `$.transport`"),
    ({**TRANSPORT_MAPS[1], "num_slots": 0}, "$.transport.num_slots"),
    ({**TRANSPORT_MAPS[1], "layout": {**LAYOUT_MAP, "slot_bytes": 4096}}, "different hsdispatch versions"),
    ({**TRANSPORT_MAPS[1], "layout": {k: v for k, v in LAYOUT_MAP.items() if k != "dtype"}},
     "missing required field `dtype` - at `$.transport.layout`"),
])
def test_a_malformed_transport_is_refused_naming_the_field(transport, named):
    message = refused_reply(register_reply(transport))
    assert message.startswith("reply to register: ") and named in message


def test_a_malformed_contract_is_refused_naming_the_field():
    register = {"op": "register", "role": "target", "name": "t", "pid": 1, "host": "h"}
    message = refused_request({**register, "contract": {**CONTRACT, "layer_ids": [5, 3]}})
    assert "distinct and ascending" in message and "$.contract" in message
    message = refused_request({**register, "contract": {k: v for k, v in CONTRACT.items() if k != "dtype"}})
    assert "missing required field `dtype` - at `$.contract`" in message


def test_a_contract_recorded_before_loads_and_one_without_a_capture_point_is_the_legacy_one():
    # what an offline capture file's metadata holds (json of the contract's map)
    recorded = CaptureContract.from_dict(json.loads(json.dumps(CONTRACT)))
    assert recorded.layer_ids == (1, 3, 5) and recorded.capture_point == CAPTURE_POINT
    assert recorded.to_dict() == CONTRACT
    older = CaptureContract.from_dict({k: v for k, v in CONTRACT.items() if k not in ("capture_point", "final_norm")})
    assert older.capture_point == LEGACY_CAPTURE_POINT and not older.final_norm
    with pytest.raises(ValueError, match="capture contract: .*`hidden_size`"):
        CaptureContract.from_dict({k: v for k, v in CONTRACT.items() if k != "hidden_size"})
