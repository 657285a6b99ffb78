"""Hugging Face tokenizers from a local directory, with the chat template on prompts.

    tok = HFTokenizer("checkpoints/Qwen3-30B-A3B")          # tokenizer.json / tokenizer_config.json
    ids = tok.prompt_ids("What is 2+3?", system="Answer in \\\\boxed{}.")
    text = tok.decode(output_ids)                           # up to EOS, special tokens skipped

The same interface as ``CharTokenizer`` (``encode``, ``decode``, ``prompt_ids``, ``vocab_size``,
``pad_id``, ``bos_id``, ``eos_id``), so the RL loop takes either. Nothing is downloaded: the
directory must hold the tokenizer files (``local_files_only``).
"""

from __future__ import annotations

import os


class HFTokenizer:
    def __init__(self, path: str, *, chat_template: bool = True):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"tokenizer directory not found: {path}")
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.use_chat = bool(chat_template and getattr(self.tok, "chat_template", None))
        self.vocab_size = len(self.tok)
        self.eos_id = self.tok.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"{path}: the tokenizer has no eos_token; set one in tokenizer_config.json")
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        self.bos_id = self.tok.bos_token_id

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False)
        return ([self.bos_id] if bos and self.bos_id is not None else []) + list(ids)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tok.decode(ids, skip_special_tokens=True)

    def prompt_ids(self, prompt: str, system: str | None = None) -> list[int]:
        """A prompt as the model sees it: through the chat template (a system message first
        where given, then the generation prompt), or BOS + the text without one."""
        if not self.use_chat:
            return self.encode(prompt, bos=True)
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return list(self.tok.encode(text, add_special_tokens=False))  # the template places any BOS itself
