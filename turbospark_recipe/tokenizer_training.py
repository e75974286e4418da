"""The recipe's tokenizer: byte-level BPE trained on the corpus' training split.

Any text round-trips because every byte is in the base alphabet and nothing is normalised.
Ids 0, 1, 2 are ``<|bos|>``, ``<|eos|>``, ``<|pad|>``; ``encode`` prepends ``<|bos|>`` as the
training documents start with it. The recipe trains base code models, which have never seen a
conversation, so the chat template renders one as a Python file: after ``<|bos|>``, each user
(or system) message becomes a block of ``#`` comment lines and each reply follows as code, then
a blank line before the next message. A second turn thus starts on a line of its own after the
first reply, and the model answers a comment with code, as code models do.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from turbospark_jax.errors import BadInputError
from turbospark_jax.io.tokenizer import Tokenizer

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
#: In id order: the trainer puts special tokens first, so these are ids 0, 1, 2.
SPECIAL_TOKENS = (BOS, EOS, PAD)

#: Base models: a chat is a Python file, user messages as comment blocks, replies as code
#: followed by a blank line (see the module docstring).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ message['content'] }}{% if not message['content'].endswith('\\n') %}{{ '\\n' }}"
    "{% endif %}{{ '\\n' }}{% else %}{% for line in message['content'].split('\\n') %}"
    "{{ ('# ' + line).rstrip() }}{{ '\\n' }}{% endfor %}{% endif %}{% endfor %}"
)


def train_tokenizer(texts: Sequence[str], vocab_size: int = 8192) -> Tokenizer:
    """Train a byte-level BPE tokenizer with the recipe's special tokens.

    Args:
      texts: the training texts.
      vocab_size: the target vocabulary size, special tokens included (a small corpus may
        yield fewer merges, hence a smaller vocabulary).

    Returns:
      The tokenizer; ``encode`` prepends ``<|bos|>``.

    Raises:
      BadInputError: ``vocab_size`` is too small to hold the 256 byte tokens and specials.
    """
    base = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if vocab_size <= base:
        raise BadInputError(f"vocab_size must exceed {base} (bytes plus specials)")
    backend = BackendTokenizer(models.BPE())
    # No normaliser and no prefix space: the bytes of the text are the text, so decode(encode)
    # is the identity. The GPT-2 split regex keeps runs of indentation together.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer, length=len(texts))
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0",
        pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, backend.token_to_id(BOS))],
    )
    return Tokenizer(
        backend,
        special_tokens={"bos_token": BOS, "eos_token": EOS, "pad_token": PAD},
        chat_template=CHAT_TEMPLATE,
        # add_bos_token makes transformers rebuild the same BOS post-processor; no clean-up so
        # decoding keeps spaces before punctuation, which code is full of.
        config={
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 2048,
        },
    )
