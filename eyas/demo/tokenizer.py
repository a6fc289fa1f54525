"""A byte-level BPE tokenizer for the demo models, trained on the train documents only."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

EOT = "<|endoftext|>"  # separates documents; bos and eos
PAD = "<|pad|>"  # never occurs in text, so `generate` can tell padding from a real end of text


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, out_dir: str | Path | None = None,
                    model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (lossless on any text) and wrap it for `transformers`; saved to out_dir if given."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=PAD,
                                   model_max_length=model_max_length, clean_up_tokenization_spaces=False)
    if out_dir is not None:
        fast.save_pretrained(out_dir)
    return fast


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a saved demo tokenizer (offline)."""
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
