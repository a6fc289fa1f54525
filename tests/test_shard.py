"""A 2-rank tensor-parallel target (two processes, gloo on loopback) against the 1-rank model: logits and features
for prefill, a tree, a commit and a tree after it; Llama with GQA (4 heads and 2 kv heads: one kv head per rank),
Llama with tied embeddings, Mixtral (two whole experts per rank). Weights and KV per rank halve.

Tolerance: float32; partial sums meet in a different order than one matmul's, so 1e-5 absolute on logits
and features (of magnitude ~1).
"""

import datetime
import io
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tests.helpers.tiny import make_target, random_tree
from transformers import AutoConfig

from eyas.manifest import FeatureAddress
from eyas.runtime.shard import ShardError, check_shardable, join_group, open_rendezvous
from eyas.sampling import SamplingParams
from eyas.target import TargetModel, TargetSession

PROMPT = [5, 17, 33, 8, 9, 41]
ATOL = 1e-5
FAMILIES = {"llama-gqa": ("llama", {}), "llama-tied": ("llama", {"tie_word_embeddings": True}), "mixtral": ("mixtral", {})}


def script(model: TargetModel) -> dict:
    """Prefill, verify a tree, commit its deepest path (KV rows move on every rank), run a second tree: every logit
    and feature on the way."""
    session = TargetSession(model)
    out = {"prefill": session.prefill(0, PROMPT[:-1])}
    first = random_tree(PROMPT[-1], len(PROMPT) - 1, seed=0)
    out["tree1"] = model.run([model.call(session.slot, session.committed, first.tokens, first.positions, first.mask)])[0]
    session.verify(first, 0, SamplingParams())
    path = [first.num_rows - 1]
    while path[-1]:
        path.append(int(first.parents[path[-1]]))
    session.commit(0, tuple(reversed(path)))
    second = random_tree(7, session.committed, seed=1)
    out["tree2"] = model.run([model.call(session.slot, session.committed, second.tokens, second.positions, second.mask)])[0]
    out["weight_bytes"] = sum(t.numel() * t.element_size() for t in model.runtime.tensors())
    out["kv_bytes"] = model.pool.reserved_bytes
    session.close()
    return out


def rank_main(rank: int, directory: str, ports, results) -> None:
    torch.set_num_threads(1)
    store = open_rendezvous("127.0.0.1") if rank == 0 else None
    if rank == 0:
        ports.put(store.port)
        port = store.port
    else:
        port = ports.get()
    shard = join_group("127.0.0.1", port, rank, 2, torch.device("cpu"), datetime.timedelta(seconds=60), store)
    model = TargetModel.from_pretrained(directory, FeatureAddress.eagle3(4), kv_slots=2, shard=shard)
    try:
        if rank == 0:
            out = script(model)
            model.stop()
            buffer = io.BytesIO()  # plain bytes: shared-memory tensors would not outlive this process
            torch.save({k: (v.logits, v.features) if hasattr(v, "features") else v for k, v in out.items()}, buffer)
            results.put(buffer.getvalue())
        else:
            model.follow()
    finally:
        dist.destroy_process_group()
    # Leave without running C++ destructors: gloo's store and pair threads may still be joinable at interpreter
    # exit and abort the process after its work is done; the result is flushed first.
    results.close()
    results.join_thread()
    os._exit(0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_ranks_equal_one(tmp_path, family):
    model_type, overrides = FAMILIES[family]
    directory = make_target(tmp_path / family, model_type, **overrides)
    whole = script(TargetModel.from_pretrained(directory, FeatureAddress.eagle3(4), kv_slots=2))
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    ranks = [ctx.Process(target=rank_main, args=(r, str(directory), ports, results)) for r in range(2)]
    for p in ranks:
        p.start()
    sharded = torch.load(io.BytesIO(results.get(timeout=120)))
    for p in ranks:
        p.join(60)
        assert p.exitcode == 0
    torch.testing.assert_close(sharded["prefill"], whole["prefill"], atol=ATOL, rtol=0)
    for key in ("tree1", "tree2"):
        logits, features = sharded[key]
        torch.testing.assert_close(logits, whole[key].logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(features, whole[key].features, atol=ATOL, rtol=0)
    assert sharded["kv_bytes"] * 2 == whole["kv_bytes"]
    norms = 2 * 4 + 1  # per-layer input/post norms and the final norm stay whole on every rank
    replicated = (norms * 64 + (4 * 4 * 64 if model_type == "mixtral" else 0)) * 4  # and Mixtral's routers [E, d]
    assert sharded["weight_bytes"] * 2 == whole["weight_bytes"] + replicated


def test_splits_that_do_not_divide_are_refused(tmp_path):
    config = AutoConfig.for_model("llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=48, vocab_size=96)
    with pytest.raises(ShardError, match="tensor_parallel: 4 ranks do not divide the target's 6 attention heads"):
        check_shardable(config, 4)
    with pytest.raises(ShardError, match="tensor_parallel: 3 ranks do not divide the target's 2 key/value heads"):
        check_shardable(config, 3)
    moe = AutoConfig.for_model("mixtral", num_local_experts=6, num_attention_heads=4, num_key_value_heads=4, hidden_size=64, vocab_size=96)
    with pytest.raises(ShardError, match="4 ranks do not divide the target's 6 experts"):
        check_shardable(moe, 4)
    check_shardable(config, 2)
