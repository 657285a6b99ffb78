"""A character tokenizer for the verifiable tasks (digits, operators, a few letters)."""

from __future__ import annotations

PAD, BOS, EOS = 0, 1, 2
_CHARS = "0123456789+-*/=()., :abcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    def __init__(self, chars: str = _CHARS):
        self.chars = chars
        self._id = {c: i + 3 for i, c in enumerate(chars)}
        self.vocab_size = len(chars) + 3
        self.pad_id, self.bos_id, self.eos_id = PAD, BOS, EOS

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        bad = sorted({c for c in text if c not in self._id})
        if bad:
            raise ValueError(f"text: characters {bad} are not in the tokenizer's alphabet {self.chars!r}")
        return ([BOS] if bos else []) + [self._id[c] for c in text]

    def prompt_ids(self, prompt: str, system: str | None = None) -> list[int]:
        """BOS + the prompt (the toy tasks have no chat template or system prompt)."""
        return self.encode(prompt, bos=True)

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            if i >= 3 and i - 3 < len(self.chars):
                out.append(self.chars[i - 3])
        return "".join(out)
