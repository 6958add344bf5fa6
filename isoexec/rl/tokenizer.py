"""A tiny word-level tokenizer for the arithmetic task, built locally with ``tokenizers``.

Vocabulary (ids in this order): ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, the ten digits,
``-``, every word / punctuation token of :mod:`isoexec.rl.task`'s templates and of DAPO-Math-17k's
instruction (:mod:`isoexec.rl.data`), sorted, then filler tokens ``<extra_i>`` up to the next
multiple of ``multiple`` (64). The filler makes the tokenizer's vocabulary
exactly the model's ``vocab_size``, so any id the model samples decodes (vLLM detokenizes every
sampled id, including ones that no training example ever used).

Pre-tokenization: split on whitespace, punctuation alone, and numbers digit by digit, so
``"17 apples."`` is ``["1", "7", "apples", "."]``. Saved in Hugging Face format (``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json``) through ``PreTrainedTokenizerFast`` so that
transformers and vLLM load it from the checkpoint directory.

Chat template (:data:`CHAT_TEMPLATE`): ``<bos>`` then the messages' contents, no role markup, so
``apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)`` gives exactly
:func:`encode_prompt` ``(tok, p)``. Chat-format data (DAPO-Math-17k's ``prompt`` column, SkyRL's
generator) and plain prompts therefore reach the model as the same tokens.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from isoexec.rl.data import INSTRUCTION_PREFIX, INSTRUCTION_SUFFIX
from isoexec.rl.task import template_texts

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]
DIGITS = [str(i) for i in range(10)]
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Whitespace split, punctuation alone, numbers digit by digit."""
    return pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(), pre_tokenizers.Digits(individual_digits=True)]
    )


def template_words() -> list[str]:
    """Every word / punctuation token of the task's templates and DAPO's instruction (sorted)."""
    pre = pre_tokenizer()
    words = {w for text in [*template_texts(), INSTRUCTION_PREFIX, INSTRUCTION_SUFFIX]
             for w, _ in pre.pre_tokenize_str(text)}
    return sorted(words)


def vocab_list(multiple: int = 64) -> list[str]:
    """The vocabulary in id order, padded with ``<extra_i>`` to a multiple of ``multiple``."""
    words = SPECIALS + DIGITS + ["-"] + [w for w in template_words() if w not in DIGITS and w != "-"]
    size = -(-len(words) // multiple) * multiple
    return words + [f"<extra_{i}>" for i in range(size - len(words))]


def build_tokenizer(multiple: int = 64) -> PreTrainedTokenizerFast:
    """Build the task tokenizer (prepends ``<bos>`` when ``add_special_tokens=True``; chat template
    :data:`CHAT_TEMPLATE`)."""
    vocab = {w: i for i, w in enumerate(vocab_list(multiple))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=4096,
        padding_side="right",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load the tokenizer saved next to a checkpoint."""
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def encode_prompt(tok: PreTrainedTokenizerFast, prompt: str) -> list[int]:
    """Token ids of ``prompt`` with ``<bos>`` prepended (what the engine receives)."""
    return tok(prompt, add_special_tokens=True)["input_ids"]
