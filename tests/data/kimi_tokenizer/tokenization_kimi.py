"""A tokenizer shipped as code, laid out as Kimi K2's release lays it out (`tiktoken.model` read
by this file, named in tokenizer_config.json's auto_map), for trillora's tests: our own small
tiktoken BPE, not Moonshot's file or vocabulary."""

import base64

import tiktoken
from transformers import PreTrainedTokenizer

PATTERN = r"""[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
SPECIALS = ("[BOS]", "[EOS]", "<|im_start|>", "<|im_end|>")


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", **kwargs):
        with open(vocab_file) as f:
            ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in f if line.strip())}
        specials = {s: len(ranks) + i for i, s in enumerate(SPECIALS)}
        self.model = tiktoken.Encoding("trillora-test", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=specials)
        self.pieces = {i: t.decode("latin-1") for t, i in ranks.items()} | {i: s for s, i in specials.items()}
        self.ids = {p: i for i, p in self.pieces.items()}
        kwargs.pop("additional_special_tokens", None)
        super().__init__(
            bos_token=bos_token, eos_token=eos_token, additional_special_tokens=list(SPECIALS[2:]), **kwargs
        )

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict:
        return dict(self.ids)

    def _tokenize(self, text, **kwargs):
        return [self.pieces[i] for i in self.model.encode(text, allowed_special="all")]

    def _convert_token_to_id(self, token):
        return self.ids[token]

    def _convert_id_to_token(self, index):
        return self.pieces[index]

    def convert_tokens_to_string(self, tokens):
        return b"".join(t.encode("latin-1") if t not in SPECIALS else t.encode() for t in tokens).decode(
            "utf-8", "replace"
        )

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
