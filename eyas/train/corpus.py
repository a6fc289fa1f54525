"""The standard-library corpus (`stdlib:` training data, the demo models'): Python's own source, split by a fixed list.

The held-out modules are never trained on; the demo report's prompts come from them.
"""

from __future__ import annotations

import ast
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

# Held-out modules (relative to the stdlib root), present on Python 3.11-3.13; never trained on.
HELDOUT_MODULES = (
    "json/decoder.py", "json/encoder.py", "textwrap.py", "heapq.py", "bisect.py",
    "colorsys.py", "fnmatch.py", "glob.py", "shlex.py", "string.py",
    "graphlib.py", "fractions.py", "calendar.py", "csv.py", "gettext.py",
    "netrc.py", "queue.py", "sched.py", "secrets.py", "tempfile.py",
    "uuid.py", "zipapp.py", "html/parser.py", "http/cookies.py", "email/quoprimime.py",
    "email/base64mime.py", "urllib/parse.py", "concurrent/futures/thread.py", "asyncio/queues.py", "asyncio/locks.py",
    "wsgiref/headers.py", "pprint.py", "reprlib.py", "copy.py", "cmd.py",
    "filecmp.py", "timeit.py", "operator.py", "hmac.py", "base64.py",
)
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
MAX_FILE_BYTES = 300_000


class Doc(NamedTuple):
    path: str  # relative to the stdlib root, with forward slashes
    text: str


class Prompt(NamedTuple):
    id: str  # "<module path>:<qualified function name>"
    text: str


@dataclass
class Corpus:
    root: Path
    train: list[Doc]
    heldout: list[Doc]

    @property
    def heldout_modules(self) -> list[str]:
        return [d.path for d in self.heldout]


def stdlib_root() -> Path:
    """The directory holding this interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _read(path: Path) -> str | None:
    if path.stat().st_size > MAX_FILE_BYTES:
        return None
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def collect(root: str | Path | None = None) -> Corpus:
    """Read every eligible `.py` file under the stdlib root (sorted) and split off the held-out modules.

    `_sysconfigdata_*` files are skipped too: they describe the local build, not Python source.
    """
    root = Path(root) if root is not None else stdlib_root()
    docs = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("_sysconfigdata_"):
            continue
        if (text := _read(path)) is not None:
            docs[rel.as_posix()] = text
    heldout = [Doc(p, docs.pop(p)) for p in HELDOUT_MODULES if p in docs]
    return Corpus(root, [Doc(p, t) for p, t in docs.items()], heldout)


def _functions(tree: ast.AST) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) for every function and method, in source order."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out.append((name, child))
                visit(child, name + ".")

    visit(tree, "")
    return sorted(out, key=lambda f: f[1].lineno)


def _count(tokenizer: Any, text: str) -> int:
    if tokenizer is None:
        return -(-len(text.encode()) // 4)  # ~4 bytes per token for code
    ids = tokenizer.encode(text)
    return len(getattr(ids, "ids", ids))


def _module_prompts(doc: Doc, tokenizer: Any, max_tokens: int, min_body_lines: int) -> list[Prompt]:
    """One prompt per function: preceding source, the `def` header and its docstring (or first body line)."""
    lines = doc.text.split("\n")
    prompts = []
    for name, fn in _functions(ast.parse(doc.text)):
        if fn.end_lineno - fn.lineno < min_body_lines:
            continue
        body = fn.body[0]
        is_doc = isinstance(body, ast.Expr) and isinstance(body.value, ast.Constant) and isinstance(body.value.value, str)
        end = body.end_lineno if is_doc else body.lineno  # 1-based, inclusive
        start = min([fn.lineno] + [d.lineno for d in fn.decorator_list]) - 1
        if _count(tokenizer, "\n".join(lines[start:end])) > max_tokens:
            continue
        while start > 0 and _count(tokenizer, "\n".join(lines[start - 1:end])) <= max_tokens:
            start -= 1
        while not lines[start].strip():
            start += 1
        prompts.append(Prompt(f"{doc.path}:{name}", "\n".join(lines[start:end])))
    return prompts


def heldout_prompts(tokenizer: Any, n: int, max_tokens: int = 100, min_body_lines: int = 6,
                    corpus: Corpus | None = None) -> list[Prompt]:
    """n deterministic prompts from held-out modules, round-robin over modules so that many are covered.

    A prompt is source text ending (without a trailing newline) after a function's header and docstring, of at
    most `max_tokens` tokens (estimated as bytes/4 without a tokenizer); the model continues with the body.
    """
    corpus = corpus or collect()
    per_module = [_module_prompts(d, tokenizer, max_tokens, min_body_lines) for d in corpus.heldout]
    out = []
    for k in range(max(map(len, per_module), default=0)):
        out += [p[k] for p in per_module if k < len(p)]
    if len(out) < n:
        raise ValueError(f"only {len(out)} held-out prompts available, {n} requested")
    return out[:n]
