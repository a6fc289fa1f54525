"""The protobuf codec of the wire ABI: engine dataclasses and tensors <-> `eyas.v1` messages.

Tensors travel as raw little-endian bytes with dtype and shape. Decoding checks every field it
reads and raises `WireError` naming it; tree semantics are checked by `eyas.tree.validate_tree`
and decisions by `validate_decision` (both written over lists in `eyas.treerows`, which also decodes
trees and decisions without torch for the trace tools). Imports protobuf only (no gRPC, no Ray), so the engine
package stays usable without the service.
"""

from __future__ import annotations

import numpy as np
import torch
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from .errors import WireError, renamed
from .request import make_sampling
from .rounds import Proposal, Verification
from .treerows import AcceptanceDecision, TreeError, array_from_proto, check_decision, decision_from_proto
from .sampling import SamplingParams
from .tree import ARRAY_FIELDS, DraftTree, FlattenedTree, TreePolicy
from .v1 import round_pb2 as pb
from .v1 import tensor_pb2 as tpb

# dtype name -> (torch dtype, same-width integer view, its little-endian numpy type)
DTYPES = {
    "bool": (torch.bool, torch.uint8, "<u1"),
    "int32": (torch.int32, torch.int32, "<i4"),
    "int64": (torch.int64, torch.int64, "<i8"),
    "float16": (torch.float16, torch.int16, "<i2"),
    "bfloat16": (torch.bfloat16, torch.int16, "<i2"),
    "float32": (torch.float32, torch.int32, "<i4"),
    "float64": (torch.float64, torch.int64, "<i8"),
}
DTYPE_NAMES = {torch_dtype: name for name, (torch_dtype, _, _) in DTYPES.items()}
# numpy value type (native order) -> (dtype name, its little-endian type)
ARRAY_TYPES = {np.dtype(name): (name, np.dtype(name).newbyteorder("<")) for name in ("bool", "int32", "int64", "float32", "float64")}
FLOATS = ("float16", "bfloat16", "float32", "float64")


def check_known(msg: Message, path: str = "") -> None:
    """Refuse a message carrying a field its schema does not define, at any depth (docs/wire.md#receipt-checks):
    raises `WireError` naming the first one by its path and number (`tree.99`)."""
    unknown = UnknownFieldSet(msg)
    if len(unknown):
        number = unknown[0].field_number
        raise WireError(f"{path}{number}", f"field {number} is not defined in {msg.DESCRIPTOR.full_name}; unknown fields are refused")
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            if field.message_type.fields_by_name["value"].message_type is not None:
                for key, item in value.items():
                    check_known(item, f"{path}{field.name}[{key!r}].")
        elif field.is_repeated:
            for i, item in enumerate(value):
                check_known(item, f"{path}{field.name}[{i}].")
        else:
            check_known(value, f"{path}{field.name}.")


def tensor_fields(tensor: torch.Tensor) -> dict:
    """A tensor's `Tensor` fields: its dtype name, shape and raw little-endian bytes. A message built around them
    from this dict writes the bytes once; built around a `Tensor` message, it copies them again (docs/wire.md,
    "Copies")."""
    name = DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise WireError("dtype", f"{tensor.dtype} has no wire encoding")
    _, view, little = DTYPES[name]
    data = tensor.detach().cpu().contiguous().view(view).numpy().astype(little, copy=False).tobytes()
    return {"dtype": name, "shape": list(tensor.shape), "data": data}


def tensor_to_proto(tensor: torch.Tensor) -> tpb.Tensor:
    """Raw little-endian bytes of a CPU tensor, with its dtype name and shape."""
    return tpb.Tensor(**tensor_fields(tensor))


def array_fields(array: np.ndarray) -> dict:
    """`tensor_fields` of a numpy array of a wire value type (bool, int32, int64, float32, float64)."""
    typed = ARRAY_TYPES.get(array.dtype)
    if typed is None:
        raise WireError("dtype", f"{array.dtype} has no wire encoding")
    name, little = typed
    return {"dtype": name, "shape": array.shape, "data": array.astype(little, copy=False).tobytes()}


def tensor_from_proto(msg: tpb.Tensor, field: str, dtypes: tuple[str, ...], ndim: int) -> torch.Tensor:
    """Decode a tensor field, refusing a dtype outside `dtypes`, a rank other than `ndim`, or a wrong byte count."""
    array = array_from_proto(msg, field, dtypes, ndim)
    torch_dtype, view, _ = DTYPES[msg.dtype]
    return torch.from_numpy(array).view(view).view(torch_dtype) if msg.dtype in ("float16", "bfloat16") else torch.from_numpy(array)


def ref(request_id: str, version: int, manifest_id: str) -> tpb.RequestRef:
    return tpb.RequestRef(request_id=request_id, version=version, manifest_id=manifest_id)


def policy_to_proto(policy: TreePolicy) -> pb.TreePolicy:
    return pb.TreePolicy(width=policy.width, depth=policy.depth, budget=policy.budget, stop=policy.stop)


def policy_from_proto(msg: pb.TreePolicy, field: str = "tree") -> TreePolicy:
    """A tree policy; an out-of-range knob raises `TreeError` naming it inside `field` (`tree.width`, `policy.width`)."""
    try:
        return TreePolicy(width=msg.width, depth=msg.depth, budget=msg.budget, stop=msg.stop)
    except TreeError as exc:
        raise renamed(exc, f"{field}.{exc.field.removeprefix('tree.')}") from None


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(**params.to_dict())


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Sampling options from the fields present; bad values raise `RequestError` naming the option (`sampling.seed`)."""
    return make_sampling("sampling.", **{f.name: value for f, value in msg.ListFields()})


def tree_to_proto(tree: FlattenedTree, request: tpb.RequestRef) -> pb.FlattenedTree:
    return pb.FlattenedTree(**tree_fields(tree, request))


def tree_fields(tree: FlattenedTree, request: tpb.RequestRef) -> dict:
    """A tree's `FlattenedTree` fields, for a message that carries it to be built around them in one go."""
    rows = tree.arrays()
    return {"ref": request, "prefix_len": tree.prefix_len, **{name: array_fields(getattr(rows, name)) for name in ARRAY_FIELDS}}


def tree_from_proto(msg: pb.FlattenedTree) -> FlattenedTree:
    """Decode the tensors of a tree; its structure is checked separately with `validate_tree`."""
    ints = ("int64",)
    return FlattenedTree(
        tokens=tensor_from_proto(msg.tokens, "tree.tokens", ints, 1),
        parents=tensor_from_proto(msg.parents, "tree.parents", ints, 1),
        depths=tensor_from_proto(msg.depths, "tree.depths", ints, 1),
        positions=tensor_from_proto(msg.positions, "tree.positions", ints, 1),
        mask=tensor_from_proto(msg.mask, "tree.mask", ("bool",), 2),
        retrieve=tensor_from_proto(msg.retrieve, "tree.retrieve", ints, 2),
        draft_probs=tensor_from_proto(msg.draft_probs, "tree.draft_probs", ("float64",), 1),
        prefix_len=msg.prefix_len,
    )


def features_from_proto(msg: tpb.Tensor, field: str, rows: int, width: int) -> torch.Tensor:
    """Decode a [rows, width] floating-point feature block."""
    features = tensor_from_proto(msg, field, FLOATS, 2)
    if tuple(features.shape) != (rows, width):
        raise WireError(f"{field}.shape", f"{list(features.shape)} is not [{rows}, {width}]")
    return features


def proposal_to_proto(proposal: Proposal, request: tpb.RequestRef, with_records: bool = False) -> pb.Proposal:
    """A proposal's counts (its tree travels on to the target: `proposed_tree_to_proto`); `with_records` adds every
    node the expansion recorded (for `tree: auto`)."""
    msg = pb.Proposal(
        ref=request,
        nodes_expanded=proposal.nodes_expanded,
        nodes_recorded=proposal.nodes_recorded,
        draft_kv_bytes=proposal.draft_kv_bytes,
        tree_seconds=proposal.tree_seconds,
    )
    if with_records and proposal.draft_tree is not None and proposal.row_nodes is not None:
        msg.records.CopyFrom(records_to_proto(proposal.draft_tree, proposal.row_nodes))
    return msg


def proposed_tree_to_proto(proposal: Proposal, request: tpb.RequestRef) -> pb.FlattenedTree:
    """A proposal's tree; one drafted ahead records the outcome it assumed in `assumed`."""
    return pb.FlattenedTree(**proposed_tree_fields(proposal, request))


def proposed_tree_fields(proposal: Proposal, request: tpb.RequestRef) -> dict:
    """`proposed_tree_to_proto`'s fields (`tree_fields`)."""
    fields = tree_fields(proposal.tree, request)
    if proposal.assumed is not None:
        accepted, bonus = proposal.assumed
        fields["assumed"] = {"accepted_tokens": accepted, "frontier_token": bonus}
    return fields


def records_to_proto(tree: DraftTree, row_nodes: list[int]) -> pb.DraftRecords:
    """Every node an expansion recorded and the node of each flattened row."""
    return pb.DraftRecords(
        tokens=tensor_to_proto(torch.tensor(tree.tokens, dtype=torch.int64)),
        parents=tensor_to_proto(torch.tensor(tree.parents, dtype=torch.int64)),
        confidences=tensor_to_proto(torch.tensor(tree.confidences, dtype=torch.float64)),
        row_nodes=tensor_to_proto(torch.tensor(row_nodes, dtype=torch.int64)),
    )


def records_from_proto(msg: pb.DraftRecords, tree: FlattenedTree) -> tuple[DraftTree, list[int]]:
    """The recorded tree and each row's node, checked against the flattened `tree` they came with: row 0 is the
    root, and every row names a distinct recorded node carrying its token."""
    ints = ("int64",)
    tokens = tensor_from_proto(msg.tokens, "records.tokens", ints, 1).tolist()
    parents = tensor_from_proto(msg.parents, "records.parents", ints, 1).tolist()
    confidences = tensor_from_proto(msg.confidences, "records.confidences", ("float64",), 1).tolist()
    row_nodes = tensor_from_proto(msg.row_nodes, "records.row_nodes", ints, 1).tolist()
    try:
        recorded = DraftTree.from_records(tokens, parents, confidences)
    except TreeError as exc:
        raise WireError(f"records.{exc.field}", str(exc).removeprefix(f"{exc.field}: ")) from None
    rows = tree.tokens.tolist()
    if len(row_nodes) != len(rows) or (row_nodes and row_nodes[0] != 0) or len(set(row_nodes)) != len(row_nodes):
        raise WireError("records.row_nodes", f"{len(row_nodes)} nodes for {len(rows)} rows, root first, each once")
    for row, node in enumerate(row_nodes):
        if not 0 <= node < len(recorded) or recorded.tokens[node] != rows[row]:
            raise WireError("records.row_nodes", f"row {row} (token {rows[row]}) names node {node}, which does not carry it")
    return recorded, row_nodes


def proposal_from_proto(msg: pb.Proposal, tree_msg: pb.FlattenedTree) -> Proposal:
    """A proposal from its counts and the tree it sent on (`proposed_tree_to_proto`)."""
    assumed = None
    if tree_msg.HasField("assumed"):
        assumed = (tuple(tree_msg.assumed.accepted_tokens), int(tree_msg.assumed.frontier_token))
    tree = tree_from_proto(tree_msg)
    recorded, row_nodes = records_from_proto(msg.records, tree) if msg.HasField("records") else (None, None)
    return Proposal(
        tree=tree,
        nodes_expanded=msg.nodes_expanded,
        nodes_recorded=msg.nodes_recorded,
        draft_kv_bytes=msg.draft_kv_bytes,
        tree_seconds=msg.tree_seconds,
        draft_tree=recorded,
        row_nodes=row_nodes,
        assumed=assumed,
    )


def decision_fields(d: AcceptanceDecision, features: torch.Tensor, request: tpb.RequestRef) -> dict:
    """An `AcceptanceDecision`'s fields, with the accepted rows' target features [len(accepted_rows), F]."""
    return {
        "ref": request,
        "accepted_rows": d.accepted_rows,
        "accepted_tokens": d.accepted_tokens,
        "frontier_token": d.frontier_token,
        "frontier_prob": d.frontier_prob,
        "accepted_features": tensor_fields(features),
        "token_probs": d.token_probs,
    }


def decision_to_proto(d: AcceptanceDecision, features: torch.Tensor, request: tpb.RequestRef) -> pb.AcceptanceDecision:
    """A decision with the accepted rows' target features [len(accepted_rows), F]."""
    return pb.AcceptanceDecision(**decision_fields(d, features, request))


def verification_to_proto(verification: Verification, request: tpb.RequestRef) -> pb.Verification:
    return pb.Verification(
        ref=request,
        decision=decision_fields(verification.decision, verification.features, request),
        experts=[pb.Expert(layer=layer, expert=expert) for layer, expert in sorted(verification.experts)],
        branch_kv_bytes=verification.branch_kv_bytes,
        row_acceptance=None if verification.row_probs is None else tensor_fields(verification.row_probs),
    )


def verification_from_proto(msg: pb.Verification, feature_width: int, with_features: bool = True) -> Verification:
    """Without `with_features` the decision must carry no features (they stayed with the draft worker that relayed
    it), and the verification's are [rows, 0]."""
    d = msg.decision
    decision = decision_from_proto(d)
    if with_features:
        features = features_from_proto(d.accepted_features, "decision.accepted_features", len(d.accepted_rows), feature_width)
    elif d.HasField("accepted_features"):
        raise WireError("decision.accepted_features", "sent though the round did not ask for them")
    else:
        features = torch.empty(len(d.accepted_rows), 0)
    experts = frozenset((e.layer, e.expert) for e in msg.experts)
    row_probs = None
    if msg.HasField("row_acceptance"):
        array = array_from_proto(msg.row_acceptance, "row_acceptance", ("float64",), 1)
        if array.size and not 0.0 <= array.min() <= array.max() <= 1.0:  # a NaN is the min and the max, and fails
            raise WireError("row_acceptance", "every row's acceptance is a probability")
        row_probs = torch.from_numpy(array)
    return Verification(decision, features, experts, msg.branch_kv_bytes, row_probs)


def validate_decision(decision: AcceptanceDecision, tree: FlattenedTree, vocab_size: int) -> None:
    """Receipt check of a decision against the tree it decides (`eyas.treerows.check_decision`); raises `WireError`."""
    check_decision(decision, tree.arrays(), vocab_size)


def validate_verification(verification: Verification, tree: FlattenedTree, vocab_size: int) -> None:
    """Receipt check of a verification: its decision, and a row acceptance (when sent) for every row of the tree."""
    validate_decision(verification.decision, tree, vocab_size)
    if verification.row_probs is not None and verification.row_probs.shape[0] != tree.num_rows:
        raise WireError("row_acceptance", f"{verification.row_probs.shape[0]} values for a tree of {tree.num_rows} rows")