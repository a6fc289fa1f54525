"""The OpenAI-compatible HTTP endpoint end to end: the official `openai` client and raw HTTP (httpx) against one
`eyas serve` subprocess (tiny models, a shared token, the HTTP endpoint on a free port), checked token for token
against the gRPC client and the in-process engine; plus the error mapping and the text shaping on their own.
"""

import asyncio
import json
import re
import subprocess

import grpc
import httpx
import openai
import pytest
from tests.helpers.servicekit import EYAS, TREE, free_port, start_serve, wait_until
from tests.helpers.tiny import add_tokenizer, make_drafter, make_target

from eyas import Engine
from eyas.actors.errors import ServiceError
from eyas.actors.http_api import ApiError, Choice, choice_seed
from eyas.actors.job import Chunk
from eyas.actors.limits import MAX_STOP_STRINGS
from eyas.client.client import Client
from eyas.runtime.kv import KVCapacityError

pytestmark = pytest.mark.slow  # one `eyas serve` for the module: about a minute on 2 cores

TOKEN = "http-test-token"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
PROMPTS = [[5, 17, 33, 8, 9], [40, 41, 7], [60, 12, 88, 3, 19, 22], [71]]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("http")
    target = make_target(root / "target")
    add_tokenizer(target)
    (target / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # before the drafter: it is part of the target's fingerprint
    drafter = make_drafter(root / "eagle1", target, "eagle1")
    http_port = free_port()
    serve = start_serve(root, target, drafter, network={"token": TOKEN, "http_port": http_port})
    engine = Engine.from_pretrained(target, drafter, tree=TREE)
    base = f"http://127.0.0.1:{http_port}"
    with Client(serve.address, token=TOKEN) as grpc_client:
        yield {
            "serve": serve,
            "root": root,
            "engine": engine,
            "grpc": grpc_client,
            "base": base,
            "http_port": http_port,
            "openai": openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0),
            "http": httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60),
        }
    if serve.proc.poll() is None:
        serve.proc.kill()


def chat_ids(engine: Engine, messages: list[dict]) -> list[int]:
    """A conversation's prompt tokens as the service makes them: the chat template, no special tokens added."""
    tokenizer = engine.target.tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)


def sse(response: httpx.Response) -> list[str]:
    """The data fields of a server-sent event stream, checking its framing: `data: ...` lines, each followed by a blank line."""
    text = response.read().decode()
    assert text.endswith("\n\n"), text[-200:]
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events[:3]
    return [e.removeprefix("data: ") for e in events]


def sessions(client: Client) -> dict[str, tuple[int, int]]:
    """Per pool: sessions and KV bytes summed over its workers."""
    return {p["name"]: (sum(w["sessions"] for w in p["workers"]), sum(w["kv_bytes"] for w in p["workers"])) for p in client.status()["pools"]}


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 1234}])
def test_completions_equal_the_grpc_client_and_the_engine_token_for_token(served, sampling):
    engine, client = served["engine"], served["openai"]
    for prompt in PROMPTS:
        reference = engine.generate(prompt, max_new_tokens=12, **sampling)
        grpc_result = served["grpc"].generate(prompt, max_new_tokens=12, **sampling)
        extra = {"return_token_ids": True, **({"top_k": sampling["top_k"]} if "top_k" in sampling else {})}
        options = {k: v for k, v in sampling.items() if k != "top_k"}
        whole = client.completions.create(model="target", prompt=prompt, max_tokens=12, extra_body=extra, **options)
        choice = whole.choices[0]
        assert choice.token_ids == grpc_result.token_ids == reference.token_ids
        assert choice.finish_reason == ("length" if reference.finish_reason == "length" else "stop")
        assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == len(reference.token_ids)
        assert choice.eyas["rounds"] == reference.stats.rounds and choice.eyas["tokens"] == len(reference.token_ids)
        if reference.finish_reason == "length":
            assert choice.text == grpc_result.text
        streamed = list(client.completions.create(model="target", prompt=prompt, max_tokens=12, stream=True, extra_body=extra, **options))
        assert [t for chunk in streamed for t in chunk.choices[0].token_ids] == reference.token_ids
        assert "".join(chunk.choices[0].text for chunk in streamed) == choice.text
        assert [c.choices[0].finish_reason for c in streamed] == [None] * (len(streamed) - 1) + [choice.finish_reason]


def test_a_text_prompt_and_a_stop_string_follow_the_openai_conventions(served):
    engine, client = served["engine"], served["openai"]
    full = engine.generate("w5 w17 w33", max_new_tokens=10)
    words = engine.target.tokenizer.decode(full.token_ids[3:5])  # a stop string the output reaches at its 5th token
    stopped = engine.generate("w5 w17 w33", max_new_tokens=10, stop=[words])
    text = engine.target.tokenizer.decode(stopped.token_ids)
    whole = client.completions.create(model="target", prompt="w5 w17 w33", max_tokens=10, temperature=0, stop=words, extra_body={"return_token_ids": True})
    assert whole.choices[0].token_ids == stopped.token_ids
    assert whole.choices[0].finish_reason == "stop" and whole.choices[0].text == text[: text.index(words)]
    pieces = [c.choices[0].text for c in client.completions.create(model="target", prompt="w5 w17 w33", max_tokens=10, temperature=0, stop=words, stream=True)]
    assert "".join(pieces) == whole.choices[0].text and all(words not in "".join(pieces[:i]) for i in range(len(pieces)))


def test_chat_completions_render_the_tokenizer_chat_template(served):
    engine, client = served["engine"], served["openai"]
    messages = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": [{"type": "text", "text": "w5 w17"}, {"type": "text", "text": "w33"}]}]
    flat = [messages[0], {"role": "user", "content": "w5 w17\nw33"}]
    reference = engine.generate(chat_ids(engine, flat), max_new_tokens=8, temperature=0.7, seed=5)
    whole = client.chat.completions.create(model="target", messages=messages, max_completion_tokens=8, temperature=0.7, seed=5, extra_body={"return_token_ids": True})
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].token_ids == reference.token_ids
    assert whole.usage.prompt_tokens == len(chat_ids(engine, flat))
    chunks = list(client.chat.completions.create(model="target", messages=messages, max_tokens=8, temperature=0.7, seed=5, stream=True))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n_samples_have_derived_seeds_and_each_is_reproducible(served):
    engine, client = served["engine"], served["openai"]
    ask = dict(model="target", prompt=PROMPTS[0], max_tokens=10, temperature=1.0, seed=99, n=3, extra_body={"return_token_ids": True})
    first, again = client.completions.create(**ask), client.completions.create(**ask)
    outputs = [c.token_ids for c in sorted(first.choices, key=lambda c: c.index)]
    assert outputs == [c.token_ids for c in sorted(again.choices, key=lambda c: c.index)]
    assert outputs == [engine.generate(PROMPTS[0], max_new_tokens=10, temperature=1.0, seed=choice_seed(99, i)).token_ids for i in range(3)]
    assert outputs[0] == engine.generate(PROMPTS[0], max_new_tokens=10, temperature=1.0, seed=99).token_ids
    assert len({tuple(o) for o in outputs}) == 3
    assert first.usage.prompt_tokens == len(PROMPTS[0]) and first.usage.completion_tokens == sum(map(len, outputs))
    streamed = client.completions.create(**{**ask, "stream": True})
    tokens = {i: [] for i in range(3)}
    for chunk in streamed:
        tokens[chunk.choices[0].index] += chunk.choices[0].token_ids
    assert [tokens[i] for i in range(3)] == outputs


def test_the_raw_stream_is_one_event_per_round_then_usage_then_done(served):
    body = {"prompt": PROMPTS[1], "max_tokens": 9, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    with served["http"].stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        data = sse(response)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    usage, rounds, final = chunks[-1], chunks[:-2], chunks[-2]
    reference = served["engine"].generate(PROMPTS[1], max_new_tokens=9)
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": len(reference.token_ids), "total_tokens": 3 + len(reference.token_ids)}
    assert all(c["usage"] is None and c["object"] == "text_completion" and c["id"] == usage["id"] for c in chunks[:-1])
    assert len(rounds) == reference.stats.rounds and all(c["choices"][0]["token_ids"] for c in rounds)
    assert final["choices"][0]["token_ids"] == [] and final["choices"][0]["eyas"]["rounds"] == reference.stats.rounds


def test_32_concurrent_streams_complete_with_exact_outputs(served):
    engine = served["engine"]
    prompts = [[(7 * i + j) % 90 + 3 for j in range(4 + i % 5)] for i in range(32)]
    seeds = [None if i % 2 else 1000 + i for i in range(32)]  # half greedy, half sampled
    references = [engine.generate(p, max_new_tokens=16, temperature=0.0 if s is None else 0.8, seed=s or 0).token_ids for p, s in zip(prompts, seeds)]

    async def run() -> list[list[int]]:
        client = openai.AsyncOpenAI(base_url=f"{served['base']}/v1", api_key=TOKEN, max_retries=0, timeout=300)

        async def one(prompt, seed):
            sampling = {"temperature": 0.0} if seed is None else {"temperature": 0.8, "seed": seed}
            stream = await client.completions.create(model="target", prompt=prompt, max_tokens=16, stream=True, extra_body={"return_token_ids": True}, **sampling)
            return [t async for chunk in stream for t in chunk.choices[0].token_ids]

        try:
            return await asyncio.gather(*(one(p, s) for p, s in zip(prompts, seeds)))
        finally:
            await client.close()

    assert asyncio.run(run()) == references


def test_a_client_that_disconnects_mid_stream_frees_its_kv_on_both_workers(served):
    grpc_client = served["grpc"]
    before = grpc_client.status()["cancelled"]
    body = {"prompt": PROMPTS[2], "max_tokens": 480, "ignore_eos": True, "temperature": 0, "stream": True}
    with served["http"].stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        held = sessions(grpc_client)
        assert all(count == 1 and kv > 0 for count, kv in held.values()), held
    wait_until(lambda: grpc_client.status()["cancelled"] == before + 1, 60, "the request cancelled")
    wait_until(lambda: all(s == (0, 0) for s in sessions(grpc_client).values()), 60, "both workers to free the request's KV")
    status = subprocess.run([*EYAS, "status", "--server", served["serve"].address, "--token", TOKEN, "--json"], capture_output=True, text=True, timeout=120)
    workers = [w for pool in json.loads(status.stdout)["pools"] for w in pool["workers"]]
    assert [(w["sessions"], w["kv_bytes"]) for w in workers] == [(0, 0), (0, 0)]

    with pytest.raises(httpx.ReadTimeout):  # a non-streaming request's client gone is cancelled as well
        served["http"].post("/v1/completions", json={**body, "stream": False}, timeout=0.5)
    wait_until(lambda: grpc_client.status()["cancelled"] == before + 2, 60, "the second request cancelled")
    wait_until(lambda: all(s == (0, 0) for s in sessions(grpc_client).values()), 60, "its KV freed")


BAD = [  # (endpoint, body, status, param)
    ("completions", {"prompt": [5], "model": 7}, 400, "model"),
    ("completions", {"prompt": 12}, 400, "prompt"),
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": ["w5", "w6"]}, 400, "prompt"),
    ("completions", {"prompt": [5, 500]}, 400, "prompt"),
    ("completions", {"prompt": [5], "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"prompt": [5], "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": [5], "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": [5], "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": [5], "top_p": [1]}, 400, "top_p"),
    ("completions", {"prompt": [5], "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": [5], "top_k": 0.5}, 400, "top_k"),
    ("completions", {"prompt": [5], "seed": "x"}, 400, "seed"),
    ("completions", {"prompt": [5], "seed": -1}, 400, "seed"),
    ("completions", {"prompt": [5], "stop": 5}, 400, "stop"),
    ("completions", {"prompt": [5], "stop": ["w1", ""]}, 400, "stop[1]"),
    ("completions", {"prompt": [5], "n": "3"}, 400, "n"),
    ("completions", {"prompt": [5], "n": 0}, 400, "n"),
    ("completions", {"prompt": [5], "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": [5], "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completions", {"prompt": [5], "stream": True, "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage"),
    ("completions", {"prompt": [5], "ignore_eos": 1}, 400, "ignore_eos"),
    ("completions", {"prompt": [5], "logprobs": 2}, 400, "logprobs"),
    ("completions", {"prompt": [5], "max_tokens": 600}, 400, "max_tokens"),  # beyond the target's 512 positions
    ("completions", {"prompt": [5], "stop": ["w1"] * (MAX_STOP_STRINGS + 1)}, 400, "stop"),
    ("completions", {"prompt": [5], "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": "hi"}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("chat/completions", {"messages": [{"content": "w5"}]}, 400, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "w5"}], "max_completion_tokens": 1.5}, 400, "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "w5"}], "max_completion_tokens": 600}, 400, "max_completion_tokens"),
]


def test_bad_input_gets_its_status_and_param_and_the_service_keeps_serving(served):
    http, grpc_client = served["http"], served["grpc"]
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "stream": True, "return_token_ids": True}) as running:
        for endpoint, body, status, param in BAD:
            response = http.post(f"/v1/{endpoint}", json=body)
            error = response.json()["error"]
            assert (response.status_code, error["param"]) == (status, param), (endpoint, body, response.text)
            assert error["message"] and error["type"] == ("invalid_request_error") and error["code"] in ("INVALID_ARGUMENT", "NOT_FOUND")
        oversized = http.post("/v1/completions", content=b'{"prompt": "' + b"w5 " * 400_000 + b'"}', headers={"Content-Type": "application/json"})
        assert oversized.status_code == 413 and oversized.json()["error"]["code"] == "RESOURCE_EXHAUSTED"
        not_json = http.post("/v1/completions", content=b"{prompt", headers={"Content-Type": "application/json"})
        assert not_json.status_code == 400 and not_json.json()["error"]["message"].startswith("the body is not JSON")
        assert http.post("/v1/no-such-thing", json={}).status_code == 404
        tokens = [t for d in sse(running)[:-1] for t in json.loads(d)["choices"][0].get("token_ids", [])]
    assert tokens == served["engine"].generate(PROMPTS[0], max_new_tokens=40).token_ids
    assert http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 4}).status_code == 200
    wait_until(lambda: all(s == (0, 0) for s in sessions(grpc_client).values()), 60, "no session left behind")
    metrics = grpc_client.status()["metrics"]
    assert metrics["eyas_http_requests_total{endpoint=completions,status=400}"] >= sum(1 for b in BAD if b[0] == "completions" and b[2] == 400)
    assert metrics["eyas_http_requests_total{endpoint=completions,status=404}"] == 1
    assert metrics["eyas_http_requests_total{endpoint=completions,status=413}"] == 1
    assert metrics["eyas_http_requests_total{endpoint=completions,status=200}"] >= 2


def test_calls_without_the_shared_token_are_refused(served):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        response = httpx.post(f"{served['base']}/v1/completions", json={"prompt": [5]}, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{served['base']}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served['base']}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{served['base']}/health").status_code == 200  # a liveness probe carries no key, as with vLLM


def test_models_lists_the_target_with_its_drafter(served):
    models = served["openai"].models.list().data
    assert [m.id for m in models] == ["target"]
    assert models[0].eyas["drafter"] == "eagle1" and models[0].max_model_len == 512
    assert models[0].eyas["manifest_id"] == served["grpc"].health()["manifest_id"]


def test_a_second_serve_on_the_same_http_port_is_refused_at_once_naming_it(served):
    port = served["http_port"]
    done = subprocess.run([*EYAS, "serve", "--config", str(served["root"] / "service.yaml"), "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"eyas serve: error: network.http_port: 127.0.0.1:{port} is in use (another eyas serve?); choose another with --http-port (0: no HTTP endpoint)"
    ]


def test_serve_names_its_http_endpoint_on_stderr_and_prints_only_its_grpc_ready_line(served):
    log = (served["root"] / "serve.log").read_text()
    assert f"eyas serve: http: the OpenAI-compatible API at http://127.0.0.1:{served['http_port']}/v1 (model 'target')" in log, log
    assert served["serve"].lines.empty()


def test_service_errors_map_to_http_statuses_and_an_internal_one_leaks_nothing():
    full = ApiError.of(KVCapacityError("slots", "all 16 slots of the target pool are in use; retry when a request finishes"))
    assert (full.status, full.code, full.param) == (429, "RESOURCE_EXHAUSTED", None)
    down = ApiError.of(ServiceError(grpc.StatusCode.UNAVAILABLE, "pools.target", "no ready worker"))
    assert (down.status, down.body()["error"]["type"]) == (503, "server_error")
    internal = ApiError.of(RuntimeError("secret at /home/me/model.py line 7"))
    assert internal.status == 500 and not re.search("secret|home|RuntimeError", json.dumps(internal.body()))


def test_text_is_held_back_while_it_could_begin_a_stop_string_and_cut_before_it():
    choice = Choice(0, ["STOP"], {2: "</s>"})
    shown = [choice.add(Chunk("r", v, [v + 10], text)) for v, text in enumerate(["Hello S", "TO", "P and more"])]
    shown.append(choice.add(Chunk("r", 3, [], "", "stop", {"rounds": 3, "target_forwards": 4, "tokens": 3, "mean_accept_length": 1.0})))
    assert shown == ["Hell", "o ", "", ""] and choice.finish_reason == "stop"
    eos = Choice(0, [], {2: "</s>"})
    assert eos.add(Chunk("r", 0, [7, 2], "ab</s>")) == "ab" and eos.tokens == [7, 2]


def test_the_http_bench_sends_the_same_requests_through_each_door(served, tmp_path):
    out = tmp_path / "bench.json"
    models = ["--target", str(served["root"] / "target"), "--drafter", str(served["root"] / "eagle1")]
    sizes = ["--requests", "2", "--prompt-tokens", "5", "--max-new-tokens", "4", "--repeats", "1", "--tree", "4,4,12"]
    done = subprocess.run([*EYAS, "bench", "service", "--http", *models, *sizes, "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["identical_outputs"] is True
    for level in ("at_1", "at_2", "at_1_one_token"):
        assert set(record[level]) == {"grpc", "http", "http_stream", "http_over_grpc"}
        assert all(record[level][system]["tokens_per_s"] > 0 for system in ("grpc", "http", "http_stream"))
    assert set(record["goals_met"]) == {"http", "http_stream"}
