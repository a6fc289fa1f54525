"""Importing eyas changes no process-wide torch setting: an engine or worker sets what its forwards need when it
starts (`eyas.runtime.device.prepare`), and a forward runs TorchScript unoptimized on its own thread only."""

import subprocess
import sys
import threading

import torch
from tests.helpers.tiny import make_drafter, make_target

from eyas import Engine

SWITCHES = """
import torch
def switches():
    cuda = torch.backends.cuda
    return {
        "sdp": (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()),
        "graph_executor_optimize": torch._C._get_graph_executor_optimize(),
        "threads": torch.get_num_threads(),
        "grad": torch.is_grad_enabled(),
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "tf32": (cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32),
        "mkldnn": torch.backends.mkldnn.enabled,
    }
"""


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", SWITCHES + code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_eyas_changes_no_torch_setting_and_prepare_only_what_its_device_needs():
    out = run_python(
        """
before = switches()
import importlib, pkgutil
import eyas, eyas.runtime, eyas.engine, eyas.target, eyas.proposer
for module in pkgutil.iter_modules(eyas.runtime.__path__):
    importlib.import_module(f"eyas.runtime.{module.name}")
imported = switches()
from eyas.runtime.device import prepare
prepare(torch.device("cpu"))
on_cpu = switches()
prepare(torch.device("cuda"))
on_cuda = switches()
print(imported == before, on_cpu == before, {k for k in before if on_cuda[k] != before[k]}, on_cuda["sdp"][0])
"""
    )
    assert out == "True True {'sdp'} False"


def test_a_forward_runs_torchscript_unoptimized_on_its_thread_and_leaves_the_setting(tmp_path):
    target = make_target(tmp_path / "t")
    engine = Engine.from_pretrained(target, make_drafter(tmp_path / "e1", target, "eagle1"), tree={"width": 2, "depth": 2, "budget": 3})
    runtime = engine.target.runtime
    seen = []
    forward = runtime.forward
    runtime.forward = lambda *args: seen.append(torch._C._get_graph_executor_optimize()) or forward(*args)
    after = []

    def generate() -> None:
        engine.generate([5, 6, 7], max_new_tokens=4)
        after.append(torch._C._get_graph_executor_optimize())

    thread = threading.Thread(target=generate)
    thread.start()
    thread.join()
    assert seen and not any(seen) and after == [True]
