"""A tiny stand-in for the Nemotron text tokenizer and the Nemotron-H LLM ``config.json``.

The release ships no text tokenizer; NeMo loads ``nvidia/NVIDIA-Nemotron-Nano-9B-v2``'s through
``transformers.AutoTokenizer`` (NeMo's ``AutoTokenizer`` wrapper). The EarTTS char-aware encoder
derives its tables from it (``ear_tts_model.build_vocabs``: every single-character token, sorted by
id, is one char-vocabulary row; ``SubwordFlagEmbedding``: a token not starting with 'Ġ', '▁' or '<'
is a continuation; ``BOSEOSEmbedding``: '<s>'/'</s>' flags). This module writes a deterministic
byte-level BPE tokenizer with the same id conventions at ``tiny().llm.vocab_size`` ids:

- ids 0, 1, 2: ``<unk>``, ``<s>``, ``</s>``; ids 3..22: ``<SPECIAL_3>``..``<SPECIAL_22>`` (PAD is
  ``<SPECIAL_12>`` = 12; SOTC/EOTC/EOTR are 20/21/22, docs/model.md §2);
- the next 256 ids: the byte-level alphabet (one token per byte, printable ASCII as itself, the rest
  as GPT-2's shifted characters such as 'Ġ' for the space), so ``build_vocabs`` finds exactly 256
  single-character tokens and the char vocabulary has 257 rows (``tiny().tts.char_vocab``);
- the rest: multi-character subwords built by BPE merges (word starts with 'Ġ', continuations
  without), plus a few '▁'-prefixed pieces, so the continuation flags vary.
"""

from __future__ import annotations

import itertools
import json
import os

from voicechat_jax.config import PAD_ID, ModelConfig
from voicechat_jax.release_config import llm_config

N_SPECIAL = 23  # <unk>, <s>, </s>, <SPECIAL_3> .. <SPECIAL_22>
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
PAD = f"<SPECIAL_{PAD_ID}>"

# Words whose byte-level BPE merges fill the subword part of the vocabulary, in this order.
_WORD_TEXT = (
    "the and that have for not with you this but his from they say her she will one all would "
    "there their what out about who get which when make can like time just him know take people "
    "into year your good some could them see other than then now look only come its over think "
    "also back after use two how our work first well way even new want because any these give day "
    "most hello world voice chat speech model token frame audio music weather tool call today "
    "morning evening question answer number"
)
_WORDS = tuple(_WORD_TEXT.split())
_SUFFIXES = ("ing", "ed", "er", "ly", "tion", "ness", "ment", "est", "able", "ful")
_SENTENCEPIECE_PIECES = ("▁the", "▁and", "▁to", "▁of", "▁a", "▁in", "▁is", "▁it")


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> unicode table (``tokenizers`` ByteLevel), in byte order."""
    keep = list(range(ord("!"), ord("~") + 1))
    keep += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = {}
    shift = 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + shift)
            shift += 1
    return [chars[b] for b in range(256)]


def _filler():
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    for n in itertools.count(2):
        for combo in itertools.product(letters, repeat=n):
            yield "".join(combo)


def tiny_vocab(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The token -> id table and the BPE merges, deterministic for a given size."""
    vocab: dict[str, int] = {UNK: 0, BOS: 1, EOS: 2}
    for i in range(3, N_SPECIAL):
        vocab[f"<SPECIAL_{i}>"] = i
    for ch in _byte_alphabet():
        vocab[ch] = len(vocab)
    merges: list[tuple[str, str]] = []

    def add_chain(word: str) -> None:
        # left-to-right merges: w+o, wo+r, wor+d ... each piece is a vocabulary entry
        piece = word[0]
        for ch in word[1:]:
            if len(vocab) >= vocab_size - len(_SENTENCEPIECE_PIECES):
                return
            nxt = piece + ch
            if nxt not in vocab:
                vocab[nxt] = len(vocab)
                merges.append((piece, ch))
            piece = nxt

    for word in _WORDS:
        add_chain("Ġ" + word)
        if word in ("the", "and", "that", "for", "with"):
            add_chain(word)
    for suffix in _SUFFIXES:
        add_chain(suffix)
    filler = _filler()
    while len(vocab) < vocab_size - len(_SENTENCEPIECE_PIECES):
        # deterministic continuation pieces; only the two-letter ones get merges (longer ones are
        # vocabulary entries the encoder never produces, enough to fill a full-size vocabulary)
        piece = next(filler)
        if piece not in vocab:
            vocab[piece] = len(vocab)
            if len(piece) == 2:
                merges.append((piece[0], piece[1]))
    for piece in _SENTENCEPIECE_PIECES:
        # '▁' pieces (SentencePiece word starts): never produced by the byte-level encoder, present
        # only so that word-start flags come from both markers, as in NeMo's flag rule
        vocab[piece] = len(vocab)
    if len(vocab) != vocab_size:
        raise ValueError(f"tiny vocabulary needs at least {len(vocab)} ids, got {vocab_size}")
    return vocab, merges


def make_tiny_tokenizer(directory: str | os.PathLike, vocab_size: int = 512) -> str:
    """Writes ``tokenizer.json`` + ``tokenizer_config.json`` into ``directory``; returns it.

    Loadable offline by ``transformers.AutoTokenizer.from_pretrained(directory)`` and by NeMo's
    ``AutoTokenizer`` wrapper. ``len(tokenizer) == vocab_size``.
    """
    vocab, merges = tiny_vocab(vocab_size)
    specials = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for tok, i in vocab.items()
        if i < N_SPECIAL
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": specials,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": True,
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[a, b] for a, b in merges],
        },
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
    }
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False, indent=1)
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
    with open(os.path.join(directory, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}, f)
    return str(directory)


def make_tiny_llm_config(cfg: ModelConfig) -> dict:
    """The Nemotron-H ``config.json`` of the LLM stand-in (HF ``NemotronHConfig`` keys).

    Laid out like ``nvidia/NVIDIA-Nemotron-Nano-9B-v2``'s config with sizes from ``cfg.llm``;
    ``time_step_min`` is tiny so that HF does not clamp dt (docs/model.md §8 "Mamba dt"). The same
    dict ``release_config.config_to_release`` returns as its second element.
    """
    return llm_config(cfg)
