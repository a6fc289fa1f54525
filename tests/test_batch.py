"""Many requests per forward: `Engine.generate_batch` steps every request together, and a request's output
never depends on its batch-mates (greedy and seeded sampling); the KV pool returns to its baseline and
refuses, with the capacity named, what cannot fit."""

import pytest
import torch
from tests.helpers.tiny import make_drafter, make_target
from transformers import AutoModelForCausalLM

from eyas import Engine
from eyas.errors import RequestError
from eyas.runtime.batch import BACKGROUND, CANCELLED, FOREGROUND, Cancelled, Lockstep, RowsCall, Scheduler, padding_groups
from eyas.runtime.kv import slot_runs
from eyas.steps import Forward
from eyas.target import TargetSession
from eyas.tree import TreeError

PROMPTS = [
    [5, 17, 33, 8, 9, 41, 77, 12],
    [7, 7, 7, 7, 7, 7, 7, 7, 7, 7],
    [5, 9, 5, 9, 5, 9, 5],
    [3],
    list(range(10, 90)),
    [40, 41],
    [11, 22, 33, 44, 55, 66],
    list(range(60, 20, -1)),
]
LIMITS = [24, 40, 8, 31, 16, 40, 3, 20]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    target = make_target(root / "target", "qwen2", init_std=0.1)
    model = AutoModelForCausalLM.from_pretrained(target)
    drafter = make_drafter(root / "eagle3", target, "eagle3")
    return target, drafter, model


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_greedy_batch_of_eight_equals_each_alone_and_hugging_face(world):
    target, drafter, model = world
    engine = Engine.from_pretrained(target, drafter, tree={"width": 4, "depth": 4, "budget": 12})
    references = [hf_greedy(model, p, n) for p, n in zip(PROMPTS, LIMITS)]
    eos = references[1][5]  # one request meets its end-of-sequence token early
    engine.target.generation_config.eos_token_id = eos
    alone = [engine.generate(p, max_new_tokens=n) for p, n in zip(PROMPTS, LIMITS)]
    together = engine.generate_batch(PROMPTS, max_new_tokens=LIMITS)
    for one, many, reference in zip(alone, together, references):
        assert many.token_ids == one.token_ids
        assert many.finish_reason == one.finish_reason
        cut = reference.index(eos) + 1 if eos in reference else len(reference)
        assert many.token_ids == reference[:cut]
    assert together[1].finish_reason == "eos" and len(together[1].token_ids) <= 6
    assert engine.target.pool.free_slots == engine.target.pool.slots
    assert engine.draft.pool.free_slots == engine.draft.pool.slots


def test_seeded_sampling_is_independent_of_batch_mates(world):
    target, drafter, _ = world
    engine = Engine.from_pretrained(target, drafter, tree={"width": 3, "depth": 3, "budget": 8})
    seeds = list(range(100, 108))
    alone = [engine.generate(p, max_new_tokens=12, temperature=0.8, seed=s).token_ids for p, s in zip(PROMPTS, seeds)]
    together = engine.generate_batch(PROMPTS, max_new_tokens=12, temperature=0.8, seed=seeds)
    assert [g.token_ids for g in together] == alone
    other_mates = engine.generate_batch([PROMPTS[0], PROMPTS[5]], max_new_tokens=12, temperature=0.8, seed=[seeds[0], 999])
    assert other_mates[0].token_ids == alone[0]


def test_a_bfloat16_batch_equals_each_alone(world):
    target, drafter, _ = world
    engine = Engine.from_pretrained(target, drafter, tree={"width": 3, "depth": 3, "budget": 8}, dtype="bfloat16")
    alone = [engine.generate(p, max_new_tokens=n).token_ids for p, n in zip(PROMPTS, LIMITS)]
    assert [g.token_ids for g in engine.generate_batch(PROMPTS, max_new_tokens=LIMITS)] == alone


def test_operations_in_flight_together_run_as_one_batch(world):
    """A worker's compute thread: the operations in flight together batch their forwards, whatever their phase,
    and each result equals the operation run alone."""
    target, drafter, _ = world
    engine = Engine.from_pretrained(target, drafter, tree={"width": 3, "depth": 3, "budget": 8})
    requests = [engine.new_request(p, max_new_tokens=4) for p in PROMPTS]
    alone = []
    for request in requests:
        t, d = engine.sessions(request)
        alone.append(t.prefill(0, request.tokens[:-1]))
        t.close(), d.close()
    scheduler = Scheduler("test-compute")
    sessions = [TargetSession(engine.target) for _ in requests]
    try:
        futures = [scheduler.submit(s.prefill_steps(0, r.tokens[:-1])) for s, r in zip(sessions, requests)]
        ops = [f.result(timeout=60) for f in futures]
    finally:
        for s in sessions:
            s.close()
    forwards = sum(len(r.tokens) > 1 for r in requests)  # a one-token prompt has nothing to prefill
    assert scheduler.lockstep.calls == forwards and scheduler.lockstep.batches < forwards
    for one, op in zip(alone, ops):
        assert op.error is None
        assert torch.allclose(one, op.result, atol=1e-5)


def assert_each_as_alone(model, calls, together):
    """Every call's logits and features in `together` equal the call run by itself."""
    for call, many in zip(calls, together):
        one = model.run([call])[0]
        assert torch.allclose(one.logits, many.logits, atol=1e-5)
        assert torch.allclose(one.features, many.features, atol=1e-5)


def test_a_batch_over_scattered_slots_gives_each_call_what_it_gets_alone(world):
    """Calls on slots out of order and with gaps between them (requests that finished leave holes) read each run of
    consecutive slots as one view of the pool: every call's logits and features equal the call run by itself."""
    target, drafter, _ = world
    model = Engine.from_pretrained(target, drafter, kv_slots=8).target
    slots = [model.pool.acquire(64) for _ in range(8)]
    assert slots == list(range(8))  # the lowest free slot first
    generator = torch.Generator().manual_seed(5)
    try:
        calls = []
        for slot, prefix in zip((6, 2, 3, 0, 4), (9, 4, 13, 6, 1)):
            tokens = torch.randint(0, 90, (prefix,), generator=generator)
            model.run([model.call(slot, 0, tokens, torch.arange(prefix), torch.ones(prefix, prefix).tril().bool(), with_logits=False)])
            n = int(torch.randint(1, 6, (), generator=generator))
            rows_mask = torch.ones(n, n).tril().bool()
            rows_mask[n - 1, 0] = n < 3  # a tree row that does not see its elder sibling
            calls.append(model.call(slot, prefix, torch.randint(0, 90, (n,), generator=generator), torch.arange(prefix, prefix + n), rows_mask))
        assert_each_as_alone(model, calls, model.run(calls))
    finally:
        for slot in slots:
            model.pool.release(slot)
    assert slot_runs([6, 2, 3, 0, 4], [9, 4, 13, 6, 1]) == [(6, 1, 9), (2, 2, 13), (0, 1, 6), (4, 1, 1)]
    assert slot_runs([0, 2, 3, 4, 6], [5, 8, 3, 2, 7]) == [(0, 1, 5), (2, 3, 8), (6, 1, 7)]


def test_a_prefill_beside_trees_runs_apart_and_each_call_gets_what_it_gets_alone(world):
    """Calls of very different lengths run as forwards that pad little (a prefill apart from the trees, rather than
    every tree padded to its length), and every call's logits and features equal the call run by itself."""
    target, drafter, _ = world
    model = Engine.from_pretrained(target, drafter).target
    slots = [model.pool.acquire(128) for _ in range(4)]
    generator = torch.Generator().manual_seed(7)
    try:
        for slot in slots[:3]:
            model.run([model.call(slot, 0, torch.randint(0, 90, (6,), generator=generator), torch.arange(6), torch.ones(6, 6).tril().bool())])
        calls = [model.call(slot, 6, torch.randint(0, 90, (3,), generator=generator), torch.arange(6, 9), torch.ones(3, 3).tril().bool()) for slot in slots[:3]]
        calls.insert(1, model.call(slots[3], 0, torch.randint(0, 90, (90,), generator=generator), torch.arange(90), torch.ones(90, 90).tril().bool()))
        entries = []
        forward = model.runtime.forward
        model.runtime.forward = lambda tokens, *args: entries.append(tokens.shape[0]) or forward(tokens, *args)
        together = model.run(calls)
        del model.runtime.forward
        assert sorted(entries) == [1, 3]
        assert_each_as_alone(model, calls, together)
    finally:
        for slot in slots:
            model.pool.release(slot)
    assert padding_groups([20, 60, 100, 150, 200, 250, 300, 40]) == [[6, 5], [4, 3], [2, 1], [7, 0]]
    assert padding_groups([7, 7, 5, 3, 7, 7, 2, 7]) == [[0, 1, 4, 5, 7, 2, 3, 6]]


def test_a_failing_forward_fails_only_its_own_operations(world):
    """A batch that raises raises in each operation it served; the driver and later batches go on."""
    target, drafter, _ = world
    engine = Engine.from_pretrained(target, drafter, tree={"width": 2, "depth": 2, "budget": 4})
    good = TargetSession(engine.target)
    lockstep = Lockstep()

    class Broken:
        def rows(self, call):
            return 1

        def run(self, calls):
            raise RuntimeError("this model is broken")

    def broken_steps():
        yield Forward(Broken(), None)

    try:
        bad = lockstep.add(broken_steps())
        fine = lockstep.add(good.prefill_steps(0, PROMPTS[0]))
        while lockstep.waiting:
            lockstep.step()
    finally:
        good.close()
    assert isinstance(bad.error, RuntimeError) and "broken" in str(bad.error)
    assert fine.error is None and fine.result.shape[0] == len(PROMPTS[0])


def test_a_background_operation_runs_only_in_steps_no_other_operation_waits_for():
    """A background operation (drafting ahead) never joins a batch other operations wait on: it runs when nothing
    else waits; brought to the foreground (its decided outcome's tree) it batches with the others; cancelled, it ends
    at the forward it waits for, which does not run."""

    class Recorder:
        def __init__(self):
            self.batches = []

        def rows(self, call):
            return 1

        def run(self, calls):
            self.batches.append(list(calls))
            return [None] * len(calls)

    model = Recorder()

    def steps(name, n):
        try:
            for i in range(n):
                yield Forward(model, f"{name}{i}")
        except Cancelled:
            return "cancelled"
        return "done"

    lockstep = Lockstep()
    priority = BACKGROUND
    guess = lockstep.add(steps("guess", 4), priority=lambda: priority)
    call = lockstep.add(steps("call", 2))
    lockstep.step(), lockstep.step()
    assert model.batches == [["call0"], ["call1"]] and call.result == "done"  # the guess waited while the call ran
    lockstep.step()
    assert model.batches[-1] == ["guess0"]  # nothing else waits: the guess runs
    lockstep.add(steps("next", 2))
    priority = FOREGROUND
    lockstep.step()
    assert model.batches[-1] == ["guess1", "next0"]  # in the foreground it batches with the others
    priority = CANCELLED
    lockstep.step()
    assert model.batches[-1] == ["next1"] and guess.result == "cancelled"  # guess2 never ran
    assert not lockstep.waiting and len(model.batches) == 5


def test_more_requests_than_slots_wait_for_one(world):
    target, drafter, _ = world
    engine = Engine.from_pretrained(target, drafter, tree={"width": 2, "depth": 2, "budget": 4}, kv_slots=3)
    alone = [engine.generate(p, max_new_tokens=6).token_ids for p in PROMPTS]
    assert [g.token_ids for g in engine.generate_batch(PROMPTS, max_new_tokens=6)] == alone
    assert engine.target.pool.free_slots == 3


def test_a_request_larger_than_the_pool_is_refused_and_changes_nothing(world):
    target, drafter, _ = world
    engine = Engine.from_pretrained(target, drafter, tree={"width": 2, "depth": 2, "budget": 4}, max_seq_len=64)
    with pytest.raises(RequestError, match="KV capacity of 64 positions"):
        engine.generate_batch([PROMPTS[0], list(range(1, 61))], max_new_tokens=8)
    assert engine.target.pool.free_slots == engine.target.pool.slots
    good = engine.generate_batch([PROMPTS[0], PROMPTS[2]], max_new_tokens=8)
    assert [g.token_ids for g in good] == [engine.generate(p, max_new_tokens=8).token_ids for p in (PROMPTS[0], PROMPTS[2])]


def test_a_failing_request_returns_its_slots(world):
    target, drafter, _ = world
    engine = Engine.from_pretrained(target, drafter, tree={"width": 2, "depth": 2, "budget": 4})

    def fail(record):
        raise RuntimeError("stopped by the caller mid-request")

    with pytest.raises(RuntimeError, match="mid-request"):
        engine.generate([3, 4], max_new_tokens=8, on_round=fail)
    with pytest.raises(TreeError, match="budget"):  # more tree rows than a slot keeps for scratch: refused up front
        engine.generate([3, 4], max_new_tokens=4, tree={"width": 16, "depth": 20, "budget": 300})
    assert engine.target.pool.free_slots == engine.target.pool.slots
    assert engine.draft.pool.free_slots == engine.draft.pool.slots
