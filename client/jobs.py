"""Batch generation jobs: a JSONL file of requests in, a JSONL file of results out.

Input, one JSON object per line: `prompt` (text or a list of token ids) and optionally `id`
(default: the line number), `max_new_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop`,
`ignore_eos`. Output, one line per finished request, in completion order: `id`, `request_id`,
`token_ids`, `text`, `finish_reason`, `stats`. A rerun skips ids already in the output, so an
interrupted job resumes where it stopped. A bad line (not UTF-8, not JSON, unknown option, larger
than the service takes, or a request the service refuses) is reported and the job goes on.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from tqdm import tqdm

from eyas.v1 import service_pb2 as spb

from .client import Client, EyasError, build_request, message_to_dict

OPTIONS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")


@dataclass
class JobReport:
    """What a job did: results written, ids skipped as already done, and every line that failed."""

    written: int = 0
    skipped: int = 0
    errors: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def parse_line(raw: bytes, number: int) -> tuple[str, spb.GenerateRequest]:
    """One input line -> (id, request); raises ValueError naming the problem."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"invalid UTF-8 at byte {exc.start}") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - {"id", "prompt", *OPTIONS})
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown option (expected prompt, id, {', '.join(OPTIONS)})")
    item_id = str(record.get("id", number))
    prompt = record.get("prompt")
    if not isinstance(prompt, str) and not (isinstance(prompt, list) and all(type(t) is int for t in prompt)):
        raise ValueError("prompt: must be a string or a list of token ids")
    stop = record.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ValueError("stop: must be a string or a list of strings")
    for name, kinds, kind in (
        ("max_new_tokens", int, "an integer"),
        ("top_k", int, "an integer"),
        ("seed", int, "an integer"),
        ("temperature", (int, float), "a number"),
        ("top_p", (int, float), "a number"),
    ):
        value = record.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise ValueError(f"{name}: must be {kind}, got {value!r}")
    if not isinstance(record.get("ignore_eos", False), bool):
        raise ValueError("ignore_eos: must be true or false")
    options = {name: record.get(name) for name in ("max_new_tokens", "temperature", "top_p", "top_k", "seed")}
    try:
        request = build_request(prompt, stop=stop, ignore_eos=record.get("ignore_eos", False), **options)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"a value is out of range ({exc})") from None
    return item_id, request


def finished_ids(out_path: Path) -> set[str]:
    """Ids already in an output file; a torn last line (from an interrupted run) is cut off."""
    if not out_path.exists():
        return set()
    data = out_path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        out_path.write_bytes(data)
    done = set()
    for line in data.splitlines():
        try:
            done.add(str(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError):
            continue
    return done


def run_job(client: Client, in_jsonl: str | Path, out_jsonl: str | Path, progress: bool = True) -> JobReport:
    """Stream every pending line to the service (one RunJob call) and append results as they finish."""
    out_path = Path(out_jsonl)
    report = JobReport()
    done = finished_ids(out_path)
    items: list[spb.JobItem] = []
    lines: dict[str, int] = {}
    for number, raw in enumerate(Path(in_jsonl).read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            item_id, request = parse_line(raw, number)
        except ValueError as exc:
            report.errors.append({"line": number, "id": None, "code": "INVALID_ARGUMENT", "message": str(exc)})
            continue
        if item_id in done:
            report.skipped += 1
            continue
        if item_id in lines:
            report.errors.append({"line": number, "id": item_id, "code": "INVALID_ARGUMENT", "message": f"id: duplicate of line {lines[item_id]}"})
            continue
        item = spb.JobItem(id=item_id, request=request)
        refusal = client.oversize(item, request)  # sent, it would end the whole job's call
        if refusal is not None:
            report.errors.append({"line": number, "id": item_id, "code": refusal.code, "field": refusal.field, "message": refusal.details})
            continue
        lines[item_id] = number
        items.append(item)
    if not items:
        return report

    call = client.stub.RunJob(iter(items), timeout=client.timeout, metadata=client.metadata)
    bar = tqdm(total=len(items), unit="req", file=sys.stderr, disable=not progress, desc="eyas job")
    try:
        with out_path.open("a", encoding="utf-8") as out:
            for result in call:
                if result.HasField("error"):
                    error = result.error
                    report.errors.append(
                        {"line": lines.get(result.id), "id": result.id, "code": error.code, "field": error.field, "message": error.message}
                    )
                else:
                    record = {
                        "id": result.id,
                        "request_id": result.ref.request_id,
                        "token_ids": list(result.token_ids),
                        "text": result.text,
                        "finish_reason": result.finish_reason,
                        "stats": message_to_dict(result.stats),
                    }
                    out.write(json.dumps(record) + "\n")
                    out.flush()
                    report.written += 1
                bar.update(1)
    except grpc.RpcError as error:
        raise EyasError.from_rpc(error, client.address) from None
    finally:
        bar.close()
    return report
