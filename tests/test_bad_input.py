"""Bad input gets a clear error naming the problem, and leaves every cache and committed output unchanged."""

import pytest
import torch
from tests.helpers.tiny import add_tokenizer, make_drafter, make_target
from transformers import AutoTokenizer

from eyas import Engine, TreeError
from eyas.errors import RequestError, VersionError
from eyas.proposer import DraftSession
from eyas.request import RequestState, StopRules, prompt_within
from eyas.rounds import start
from eyas.sampling import SamplingParams
from eyas.target import TargetSession
from eyas.tree import TreePolicy, validate_tree


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    target = make_target(root / "t")
    return Engine.from_pretrained(target, make_drafter(root / "d", target, "eagle1"), tree={"width": 3, "depth": 3, "budget": 8})


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": "w1 w2"}, "prompt"),  # text without a tokenizer
        ({"prompt": [1, 2, 500]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": -5}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"tree": {"width": 0}}, "tree.width"),
        ({"tree": {"stop": 1.5}}, "tree.stop"),
        ({"stop": ["x", ""]}, "stop[1]"),
        ({"tree": {"top_k": 4}}, "tree.top_k"),
    ],
)
def test_nonsense_requests_are_refused_by_field(engine, kwargs, field):
    args = {"prompt": [1, 2, 3], "max_new_tokens": 4, **kwargs}
    with pytest.raises((RequestError, TreeError)) as err:
        engine.generate(**args)
    assert err.value.field == field


class Counting:
    """A tokenizer that counts the characters it was asked to encode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.characters = tokenizer, 0

    def encode(self, text, **options):
        self.characters += len(text)
        return self.tokenizer.encode(text, **options)


def test_a_long_text_prompt_is_blamed_on_the_prompt_and_tokenized_only_as_far_as_the_limit(tmp_path, capfd):
    add_tokenizer(tmp_path)
    tokenizer = Counting(AutoTokenizer.from_pretrained(tmp_path))
    text = "w5 w7 " * 20_000  # 40,000 tokens for 512 positions
    with pytest.raises(RequestError) as err:
        prompt_within(text, tokenizer, 96, 8, 512, "the target's 512 positions")
    assert err.value.field == "prompt" and "more than 511 tokens leave no room" in str(err.value)
    assert tokenizer.characters < len(text) // 10  # it stopped once a prefix held too many
    assert "Token indices sequence length" not in capfd.readouterr().err
    with pytest.raises(RequestError) as err:
        prompt_within("w5 " * 500, tokenizer, 96, 20, 512, "the target's 512 positions")
    assert err.value.field == "max_new_tokens" and "at most 12 fit" in str(err.value)
    assert prompt_within("w5 " * 500, tokenizer, 96, 12, 512, "the target's 512 positions") == [5] * 500


def test_stop_strings_without_a_tokenizer_are_refused(engine):
    with pytest.raises(RequestError, match="stop"):
        engine.generate([1, 2, 3], max_new_tokens=4, stop=["x"])


def snapshot(target: TargetSession, draft: DraftSession):
    return (
        target.committed,
        target.version,
        [target.provisional, target.model.pool.kv[:, :, target.slot, :, : target.committed + target.provisional].clone()],
        draft.committed,
        draft.version,
        [draft.written, draft.model.pool.kv[:, :, draft.slot, :, : draft.written].clone()],
        list(draft.pending_tokens),
    )


def assert_same(a, b):
    assert a[0:2] == b[0:2] and a[3:5] == b[3:5] and a[6] == b[6]
    assert a[2][0] == b[2][0] and torch.equal(a[2][1], b[2][1])
    assert a[5][0] == b[5][0] and torch.equal(a[5][1], b[5][1])


@pytest.fixture
def sessions(engine):
    request = RequestState("r", [4, 5, 6, 7, 8, 9], SamplingParams(), StopRules(32))
    target, draft = TargetSession(engine.target), DraftSession(engine.draft)
    start(request, draft, target)
    return request, target, draft


def test_rejected_messages_change_no_state_and_a_valid_round_follows(engine, sessions):
    request, target, draft = sessions
    policy = engine.tree
    proposal = draft.propose(0, request.root_token, policy)
    before = snapshot(target, draft)

    bad = proposal.tree
    bad.positions = bad.positions + 1
    with pytest.raises(TreeError, match="positions"):
        validate_tree(bad, vocab_size=engine.target.vocab_size, prefix_len=target.committed)
    bad.positions = bad.positions - 1
    with pytest.raises(VersionError, match="future version 3"):
        target.verify(bad, 3, request.sampling)
    with pytest.raises(VersionError):
        draft.reseed(1, torch.zeros(1, engine.target.feature_width), [5])
    with pytest.raises(VersionError):
        draft.propose(2, request.root_token, policy)
    with pytest.raises(TreeError, match="root_token"):
        draft.propose(0, request.root_token + 1, policy)
    with pytest.raises(VersionError):
        request.commit(4, [1])
    after = snapshot(target, draft)
    # the drafter re-proposes from scratch after its own rejected call: the committed part is unchanged
    assert_same(before, after)
    assert request.output == [] and request.version == 0

    target.verify(bad, 0, request.sampling)
    with pytest.raises(ValueError, match="accepted_rows"):
        target.commit(0, (1, 2))  # not a path starting at the root
    assert target.committed == before[0] and target.version == 0


def test_commit_and_reseed_are_idempotent_per_version(engine, sessions):
    request, target, draft = sessions
    proposal = draft.propose(0, request.root_token, engine.tree)
    verification = target.verify(proposal.tree, 0, request.sampling)
    rows = verification.decision.accepted_rows
    target.commit(0, rows)
    state = snapshot(target, draft)
    target.commit(0, rows)  # a retried commit is harmless
    assert_same(state, snapshot(target, draft))
    with pytest.raises(VersionError, match="stale version 0"):
        target.commit(0, rows + (99,))  # but a different commit for an applied version is stale
    tokens = [*verification.decision.accepted_tokens, verification.decision.frontier_token]
    draft.reseed(0, verification.features, tokens)
    draft.reseed(0, verification.features, tokens)
    assert draft.version == 1 and len(draft.pending_tokens) == len(tokens)


def test_verify_of_a_retried_round_replaces_provisional_rows(engine, sessions):
    request, target, draft = sessions
    proposal = draft.propose(0, request.root_token, TreePolicy(3, 3, 8))
    first = target.verify(proposal.tree, 0, request.sampling)
    second = target.verify(proposal.tree, 0, request.sampling)
    assert first.decision == second.decision
    assert target.provisional == proposal.tree.num_rows
