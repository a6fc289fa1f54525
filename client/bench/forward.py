"""`eyas bench forward`: one forward's cost on a random-weight Llama of a given size (default ~1B parameters).

A plain Hugging Face decode step (one token on a KV cache of the context) against eyas's runtime running 1 row (its
own plain step) and a chain tree of `--rows` rows (a verification) on the same committed context, with CUDA graphs
off and on (on a CPU, "on" runs the graphs' fixed-shape batches eagerly). Each eyas forward's logits are checked
against Hugging Face's for the same tokens, and graphs on against off.
"""

from __future__ import annotations

import platform

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eyas.manifest import FeatureAddress
from eyas.runtime.device import resolve_device, resolve_dtype
from eyas.runtime.model import CausalLM
from eyas.target import TargetModel, TargetSession

from .runtime import PlainStep, chain_tree, median_ms

SIZES = {  # Llama shapes: ~1.1B parameters, and a tiny one for tests
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256},
}


def random_llama(size: str, context: int, dtype: torch.dtype, device: torch.device) -> tuple[LlamaForCausalLM, CausalLM]:
    """A random-weight Llama of `size` as a Hugging Face model and as eyas's runtime over the same weights."""
    config = LlamaConfig(**SIZES[size], max_position_embeddings=context + 512)
    torch.manual_seed(0)
    with torch.device(device):
        hf = LlamaForCausalLM(config).to(dtype).eval()
    state = {name.removeprefix("model."): tensor for name, tensor in hf.state_dict().items()}
    return hf, CausalLM(config, state, dtype, device)


def compare(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    """How far `logits` [N, V] are from `reference` [N, V]: the largest difference relative to the largest logit, and
    the share of rows whose argmax agrees."""
    reference = reference.float()
    return {
        "max_rel_diff": float((logits - reference).abs().max() / reference.abs().max()),
        "argmax_agree": float((logits.argmax(-1) == reference.argmax(-1)).float().mean()),
    }


def run(args) -> dict:
    """The whole forward benchmark as one JSON record."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    hf, runtime = random_llama(args.size, args.context, dtype, device)
    params = sum(t.numel() for t in hf.parameters())
    context = torch.randint(hf.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(1)).tolist()
    record = {
        "machine": {"platform": platform.platform(), "device": str(device),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "config": {"size": args.size, "parameters": params, "dtype": str(dtype).removeprefix("torch."), "context": args.context},
        "hf_plain_step_ms": median_ms(PlainStep(hf, context), args.repeats),
        "graphs": {},
    }
    logits = {}
    for graphs in (False, True):
        target = TargetModel(runtime, FeatureAddress.eagle1(), kv_slots=1, max_seq_len=args.context + max(args.rows), graphs=graphs)
        session = TargetSession(target)
        session.prefill(0, context)
        entries = []
        for rows in args.rows:
            tree = chain_tree(context[-1], rows, len(context))
            call = target.call(session.slot, session.committed, tree.tokens, tree.positions, tree.mask)
            ms = median_ms(lambda: target.run([call]), args.repeats)
            out = target.run([call])[0].logits  # [rows, V]
            with torch.no_grad():
                reference = hf(torch.tensor([context + tree.tokens.tolist()], device=device)).logits[0, -rows:]  # the rows follow the context
            logits[graphs, rows] = out
            entries.append({"rows": rows, "ms": ms, "over_hf_plain_step": ms / record["hf_plain_step_ms"], "vs_hf": compare(out, reference)})
        session.close()
        record["graphs"]["on" if graphs else "off"] = entries
    record["graphs_on_vs_off"] = {rows: compare(logits[True, rows], logits[False, rows]) for rows in args.rows}
    for on, off in zip(record["graphs"]["on"], record["graphs"]["off"]):
        on["speedup_over_graphs_off"] = off["ms"] / on["ms"]
    return record
