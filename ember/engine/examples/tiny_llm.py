"""A tiny Llama built offline for the vLLM path: no hub, no download, seeded.

The artifact directory holds what ``ember models push`` uploads and the vLLM engine
reads: ``model.safetensors`` (a 2-layer Llama, hidden 128, vocab 2048, random weights),
``config.json``, ``generation_config.json`` and the tokenizer (a byte-level BPE trained
with ``tokenizers`` on procedurally generated English, wrapped as
``PreTrainedTokenizerFast``, with a chat template so chat completions work).

The text it generates is noise — the weights are random — but every layer of the
serving path (tokenizer, weights through Ember's loader, vLLM's scheduler, the OpenAI
routes, token counts) is real. Build it with::

    python -m ember.engine.examples.tiny_llm OUT_DIR [--shards]

``--shards`` (``build_tiny_llm(dir, sharded=True)``) writes the weights the way every large
model ships them: transformers' own ``save_pretrained(max_shard_size=SHARD_SIZE)`` splits
them into ``model-0000i-of-0000n.safetensors`` shards (four at this size) with a
``model.safetensors.index.json`` beside the config, generation config and tokenizer.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SEED = 1234
VOCAB_SIZE = 2048
MAX_POSITIONS = 512
SHARD_SIZE = "1MB"
"""``max_shard_size`` of the sharded layout (3.3 MB of weights): four shards, the 1 MiB
embedding and output matrices each in one of their own, a layer split across two."""
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
# Keyword arguments of the tokenizer (names ending in _token are not secrets).
_SPECIAL_ARGS = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "pad_token": "<pad>",
}

# A minimal ChatML-like template: vLLM's chat route refuses a tokenizer without one.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|> ' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)

_SUBJECTS = ["the model", "a replica", "the router", "every request", "the cache",
             "a worker", "the scheduler", "our team", "the loader", "a small lamp",
             "the old river"]  # fmt: skip
_VERBS = ["serves", "streams", "loads", "answers", "batches", "keeps", "warms", "measures",
          "sends", "reads", "writes", "carries", "follows", "counts"]  # fmt: skip
_OBJECTS = ["weights", "tokens", "the queue", "a version", "many prompts", "the night shift",
            "bright embers", "every byte", "a warm pool", "its own tier",
            "the green hills"]  # fmt: skip
_TAILS = ["quickly", "before dawn", "at the edge of memory", "without a pause", "in order",
          "one batch at a time", "under load", "for the user", "with care", ""]  # fmt: skip


def corpus(sentences: int = 4000, seed: int = SEED) -> Iterator[str]:
    """Seeded, procedurally generated sentences (plus digits and punctuation)."""
    rng = random.Random(seed)
    for i in range(sentences):
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
        tail = rng.choice(_TAILS)
        text = " ".join([*words, tail]).strip()
        if rng.random() < 0.3:
            text += f", {rng.randint(0, 9999)} times"
        yield text[0].upper() + text[1:] + rng.choice([".", "!", "?", "."]) + f" ({i % 97})"


def build_tokenizer(out_dir: Path) -> Any:
    """Train a byte-level BPE on the corpus; save it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=_SPECIAL_ARGS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tokenizer_class: Any = PreTrainedTokenizerFast  # untyped in transformers
    fast = tokenizer_class(tokenizer_object=tok, model_max_length=MAX_POSITIONS, **_SPECIAL_ARGS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    # Readable by any transformers (4.x or 5.x): name the class by its portable name and
    # keep the chat template inside the config, not only in chat_template.jinja.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return fast


def build_tiny_llm(out_dir: Path, *, sharded: bool = False) -> Path:
    """Write the tiny LLM artifact (weights, config, tokenizer) into ``out_dir``: one
    ``model.safetensors``, or with ``sharded`` shards and their index (``SHARD_SIZE``)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(SEED)
    model: Any = LlamaForCausalLM(config)
    model.eval()
    shard_size = SHARD_SIZE if sharded else "50GB"  # transformers' default: one file here
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size=shard_size)
    generation_config: Any = GenerationConfig
    generation_config(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)
    return out_dir


def main(argv: list[str]) -> int:
    sharded = "--shards" in argv
    args = [a for a in argv if a != "--shards"]
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m ember.engine.examples.tiny_llm OUT_DIR [--shards]",
              file=sys.stderr)  # fmt: skip
        return 2
    out = build_tiny_llm(Path(args[0]), sharded=sharded)
    for path in sorted(out.iterdir()):
        print(f"{path.stat().st_size:>10}  {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
