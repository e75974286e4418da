"""Train small real models on the Python standard library: tokenizer, target and draft.

This is the recipe behind the embedded default models. Everything runs from one command on
one GPU in a few minutes (``recipe``), and every piece is usable alone (``tokenizer``,
``train``, ``pack``, ``unpack``)::

    python -m turbospark_recipe recipe --out runs/stdlib --max-seconds 480 --pack-out parts/
    python -m turbospark_recipe unpack parts/ --to models/

The pieces, in the order the recipe runs them, each in its own module:

* :mod:`~turbospark_recipe.corpus`: the files, their train/held-out split, the token
  stream, packed rows and the data order;
* :mod:`~turbospark_recipe.tokenizer_training`: the byte-level BPE tokenizer;
* :mod:`~turbospark_recipe.train`: model shapes, the optimizer and step, checkpoints and
  the training loop;
* :mod:`~turbospark_recipe.card` and :mod:`~turbospark_recipe.export`: sample
  completions, the model card, the Hugging Face folder;
* :mod:`~turbospark_recipe.pack`: the folders as parts of at most 15 MiB;
* ``__main__``: the command line.

Training needs ``optax`` (the ``train`` extra).
"""

from turbospark_recipe.card import (
    CARD_PROMPTS,
    Provenance,
    card_samples,
    command_line,
    model_card,
)
from turbospark_recipe.corpus import (
    Corpus,
    DataOrder,
    Document,
    encode_documents,
    fingerprint,
    is_heldout,
    list_corpus_files,
    load_corpus,
    pack_rows,
    stdlib_root,
)
from turbospark_recipe.export import export_model
from turbospark_recipe.pack import pack_folders, unpack_parts
from turbospark_recipe.tokenizer_training import SPECIAL_TOKENS, train_tokenizer
from turbospark_recipe.train import (
    CHECKPOINT_META,
    CHECKPOINT_STATE,
    PRESETS,
    TrainConfig,
    TrainResult,
    TrainState,
    count_params,
    evaluate,
    init_state,
    load_checkpoint,
    make_optimizer,
    model_config,
    save_checkpoint,
    train_model,
)

__all__ = [
    "CARD_PROMPTS",
    "CHECKPOINT_META",
    "CHECKPOINT_STATE",
    "PRESETS",
    "SPECIAL_TOKENS",
    "Corpus",
    "DataOrder",
    "Document",
    "Provenance",
    "TrainConfig",
    "TrainResult",
    "TrainState",
    "card_samples",
    "command_line",
    "count_params",
    "encode_documents",
    "evaluate",
    "export_model",
    "fingerprint",
    "init_state",
    "is_heldout",
    "list_corpus_files",
    "load_checkpoint",
    "load_corpus",
    "make_optimizer",
    "model_card",
    "model_config",
    "pack_folders",
    "pack_rows",
    "save_checkpoint",
    "stdlib_root",
    "train_model",
    "train_tokenizer",
    "unpack_parts",
]
