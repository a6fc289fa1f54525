"""A byte-level BPE tokenizer for the demo models, trained on the train documents only."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

EOT = "<|endoftext|>"  # separates documents; bos and eos
PAD = "<|pad|>"  # never occurs in text, so `generate` can tell padding from a real end of text
# The demo target's chat template (chat_template.jinja beside it; docs/http.md#chat): the target is a base model of Python
# source with no chat training, so a conversation renders as one file, each message's content on its own line in order,
# and the reply continues it.
CHAT_TEMPLATE = (
    "{#- eyas demo target: a base model of Python source with no chat training. A conversation renders as one file: "
    "each message's content on its own line, in order; the reply continues it. -#}\n"
    '{%- for message in messages %}{% if not loop.first %}{{ "\\n" }}{% endif %}{{ message["content"] }}{% endfor %}\n'
)


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


def add_chat_template(model_dir: str | Path) -> None:
    """Give a demo model's tokenizer the demo chat template (part of its tokenizer, so of a target's fingerprint)."""
    Path(model_dir, "chat_template.jinja").write_text(CHAT_TEMPLATE)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a saved demo tokenizer (offline)."""
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
