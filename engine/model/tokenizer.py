"""Text <-> token ids, and the chat template, from the same file as the weights."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2.sandbox
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.core.errors import LoaderError

GGUF_CONTROL_TOKEN = 3


class Tokenizer:
    def __init__(self, backend: HFTokenizer, chat_template: str | None,
                 bos_token: str | None = None, eos_token: str | None = None) -> None:
        self._backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise LoaderError("this model has no chat template; pass the prompt as raw text")
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = environment.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        """A byte-level BPE (GGUF `tokenizer.ggml.model == "gpt2"`) rebuilt from the file's vocab and merges."""
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise LoaderError(f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2')")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        merges = [tuple(merge.split(" ", 1)) for merge in fields["tokenizer.ggml.merges"]]
        backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                         fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        backend.decoder = decoders.ByteLevel()
        types = fields.get("tokenizer.ggml.token_type") or []
        specials = [AddedToken(tokens[i], special=True, normalized=False)
                    for i, kind in enumerate(types) if kind == GGUF_CONTROL_TOKEN]
        backend.add_special_tokens(specials)
        bos = fields.get("tokenizer.ggml.bos_token_id")
        eos = fields.get("tokenizer.ggml.eos_token_id")
        return cls(backend, fields.get("tokenizer.chat_template"),
                   tokens[bos] if bos is not None else None, tokens[eos] if eos is not None else None)

    @classmethod
    def from_hf_folder(cls, folder: Path) -> Tokenizer | None:
        """`tokenizer.json` (+ `tokenizer_config.json` for the chat template); None if the folder has none."""
        path = folder / "tokenizer.json"
        if not path.exists():
            return None
        backend = HFTokenizer.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}

        def token_text(value: Any) -> str | None:
            return value.get("content") if isinstance(value, dict) else value

        return cls(backend, config.get("chat_template"), token_text(config.get("bos_token")),
                   token_text(config.get("eos_token")))
