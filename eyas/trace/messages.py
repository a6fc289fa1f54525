"""The round messages a trace keeps: taken from the bytes that crossed the wire, encoded in process, decoded.

In the service the FlattenedTree is the `tree` field of the VerifyRequest the coordinator sent and
the AcceptanceDecision the `decision` field of the Verification the target worker sent back; both
are cut out of the serialized calls, byte for byte. In process the recorder builds the same messages
with the wire codec (same request reference, same fields), so local and service traces hold the same
bytes. Decoding needs no torch, so the trace tools start quickly.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from ..errors import WireError
from ..treerows import AcceptanceDecision, TreeRows, decision_from_proto, rows_from_proto
from ..v1 import round_pb2 as pb
from .format import Round


def _varint(data: memoryview, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if byte < 0x80:
            return value, i


def sent_field(message: bytes, number: int) -> bytes:
    """The bytes of length-delimited field `number` of a serialized message, exactly as they were sent."""
    data = memoryview(message)
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        kind = key & 7
        if kind == 2:
            length, i = _varint(data, i)
            if key >> 3 == number:
                return bytes(data[i : i + length])
            i += length
        elif kind == 0:
            _, i = _varint(data, i)
        elif kind in (1, 5):
            i += 8 if kind == 1 else 4
        else:
            raise ValueError(f"wire type {kind} is not used by eyas messages")
    raise ValueError(f"field {number} is not in the message")


def verify_exchange(request: bytes, reply: bytes) -> tuple[bytes, bytes]:
    """(FlattenedTree, AcceptanceDecision) bytes out of a serialized VerifyRequest and its Verification reply."""
    return (
        sent_field(request, pb.VerifyRequest.DESCRIPTOR.fields_by_name["tree"].number),
        sent_field(reply, pb.Verification.DESCRIPTOR.fields_by_name["decision"].number),
    )


def decode_round(record: Round) -> tuple[TreeRows, AcceptanceDecision, pb.FlattenedTree, pb.AcceptanceDecision]:
    """The recorded tree (as lists) and decision, and their messages; raises WireError naming a bad field. No torch."""
    try:
        tree_msg = pb.FlattenedTree.FromString(record.tree)
    except DecodeError as exc:
        raise WireError("tree", f"not a FlattenedTree message ({exc})") from None
    try:
        decision_msg = pb.AcceptanceDecision.FromString(record.decision)
    except DecodeError as exc:
        raise WireError("decision", f"not an AcceptanceDecision message ({exc})") from None
    return rows_from_proto(tree_msg), decision_from_proto(decision_msg), tree_msg, decision_msg
