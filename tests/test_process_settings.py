"""Importing eyas changes no process-wide torch setting: an engine or worker sets what its forwards need when it
starts (`eyas.runtime.device.prepare`), and a forward runs TorchScript unoptimized on its own thread only."""

import gc
import platform
import subprocess
import sys
import threading
import weakref

import pytest
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


def run_python(code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", SWITCHES + code, *args], capture_output=True, text=True, timeout=300)
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


FREED = """
import ctypes, resource, sys, threading, torch
from eyas import wire
from eyas.v1 import round_pb2 as pb
from eyas.runtime.device import keep_freed_memory


class MallInfo2(ctypes.Structure):
    names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    _fields_ = [(n, ctypes.c_size_t) for n in names]


libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
before = libc.mallinfo2().hblkhd
buffer = bytearray(30 << 20)
mapped = libc.mallinfo2().hblkhd - before  # bytes of the buffer in a mapping of its own
free = libc.mallinfo2().fordblks
del buffer
kept_free = libc.mallinfo2().fordblks - free  # bytes of it the heap keeps once freed
torch.set_num_threads(1)
features = torch.randn(31, 24576).bfloat16()  # a 31-token prompt's EAGLE-3 features of a 70B target: 1.5 MB


def calls(n):
    for _ in range(n):  # what a Prefill costs in buffers: encoded, sent, decoded, copied into the Start, read
        raw = pb.PrefillReply(features=wire.tensor_to_proto(features)).SerializeToString()
        start = pb.DraftStart()
        start.features.CopyFrom(pb.PrefillReply.FromString(raw).features)
        torch.cat([wire.features_from_proto(start.features, "features", 31, 24576)])


thread = threading.Thread(target=calls, args=(10,))  # a worker's buffers come from its threads' arenas too
thread.start()
thread.join()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
calls(100)
print(kept, mapped >> 20, kept_free >> 20, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 100)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc allocator setting")
def test_freed_memory_stays_for_the_next_calls_buffers():
    """`prepare` has glibc serve buffers up to 32 MiB from the heap and keep what is freed there (glibc's defaults map a
    fresh 30 MiB buffer apart and unmap it when freed), so a call's megabyte buffers reuse pages: repeated Prefill-sized
    copies fault in few fresh pages, under half of one copy's."""
    kept, mapped, kept_free, faults = run_python(FREED, "keep").split()
    assert (kept, mapped, kept_free) == ("True", "0", "30")
    assert float(faults) < 31 * 24576 * 2 / 4096 / 2, faults
    _, mapped, kept_free, _ = run_python(FREED, "default").split()
    assert (mapped, kept_free) == ("30", "0")



FROZEN = """
import gc
from eyas.runtime.device import freeze_startup_objects
alive = len(gc.get_objects())  # what importing eyas, torch and the rest left
freeze_startup_objects()
class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a  # a cycle made after start
del a, b
print(gc.get_freeze_count() >= alive > 100_000, len(gc.get_objects()) < 1000, gc.collect() >= 2)
"""


def test_a_full_collection_in_a_started_worker_walks_only_what_serving_allocated():
    """A worker or the coordinator moves the objects alive once it has started (the imports and models: some 400,000)
    out of the cyclic collector's generations: a full collection no longer walks them (it cost 0.1-0.2 s every few
    seconds of a batch of 64), and cycles made later are still collected."""
    assert run_python(FROZEN) == "True True True"


def test_an_engine_freezes_nothing_so_a_dropped_engine_frees_its_kv(tmp_path):
    """An engine lives in its caller's process: freezing there would keep a dropped engine's KV pool (it sits in a
    reference cycle) for good."""
    engine = Engine.emulated("null", tree={"width": 2, "depth": 2, "budget": 4})
    engine.generate([1, 2, 3], max_new_tokens=4)
    kv = weakref.ref(engine.target.pool.kv)
    del engine
    gc.collect()
    assert kv() is None
