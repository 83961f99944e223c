"""A character-level fast tokenizer for the chain task, saved with the model so it loads offline.

One token per character keeps every single-digit fact one token wide: what the model attends to is
exactly what it reasons about, and KV accounting is per character.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from tasks.cot import REVERSED_MINUS

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = [PAD, BOS, EOS]
# "|" (the chain of thought's section separator) has id 3. Problem texts are validated before they are
# tokenized, so there is no unknown-token id: a character outside the vocabulary is an error.
CHARACTERS = ["|"] + list(string.digits + string.ascii_lowercase + "=;?+-*:,#\n ")


def writes_reversed_minus_lines(tokenizer) -> bool:
    """Whether a checkpoint's model writes reversed ``-`` lines: its tokenizer holds ``~`` exactly then
    (``build_tokenizer``), so batches drawn for it (a DMS retrofit) and forecasts of it follow from the tokenizer."""
    return REVERSED_MINUS in tokenizer.get_vocab()


def build_tokenizer(reversed_minus: bool = False) -> PreTrainedTokenizerFast:
    """The tokenizer of a model trained from now; ``reversed_minus`` adds the one character that only models
    writing reversed ``-`` lines need (``tasks.cot.reversed_line``), so that every other model keeps the
    vocabulary, and the initialization, it was trained with."""
    characters = CHARACTERS + ([REVERSED_MINUS] if reversed_minus else [])
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + characters)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    # Every sequence starts with <bos>: a fixed first token that attention can rest on (a sink).
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
