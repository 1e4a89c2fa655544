"""Tokenizers (sentencepiece tokenizer.model, or Hugging Face tokenizer.json) and chat formatting.

The checkpoint's own chat_template (tokenizer_config.json) is rendered with jinja2; LLaMA-2-chat and
Vicuna templates are built in for checkpoints that have none.
"""
import json
import re
from datetime import datetime
from pathlib import Path

from model import EagletError

LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set sys = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}{% set msgs = messages[1:] %}"
    "{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
    "{% for m in msgs %}{% if m['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + (sys if loop.first else '') + m['content'].strip() + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'].strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
VICUNA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + ' ' }}"
    "{% else %}A chat between a curious user and an artificial intelligence assistant. The assistant gives "
    "helpful, detailed, and polite answers to the user's questions. {% endif %}"
    "{% for m in messages if m['role'] != 'system' %}{% if m['role'] == 'user' %}{{ 'USER: ' + m['content'] + ' ' }}"
    "{% else %}{{ 'ASSISTANT: ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
BUILTIN_TEMPLATES = {"llama2": LLAMA2_CHAT_TEMPLATE, "vicuna": VICUNA_CHAT_TEMPLATE}


def read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EagletError(f"{path} is not valid JSON: {e}")


def token_content(token) -> str:
    return token.get("content") if isinstance(token, dict) else token


class Tokenizer:
    """encode / decode / eos_ids / apply_chat_template over either tokenizer format."""

    def __init__(self, path, chat_template: str = "auto"):
        """path: a checkpoint folder, or a tokenizer.json / sentencepiece .model file itself."""
        path = Path(path)
        checkpoint_dir = path.parent if path.is_file() else path
        json_file = path if path.is_file() and path.suffix == ".json" else checkpoint_dir / "tokenizer.json"
        sp_file = path if path.is_file() and path.suffix == ".model" else checkpoint_dir / "tokenizer.model"
        tok_config = read_json(checkpoint_dir / "tokenizer_config.json")
        if json_file.is_file():
            from tokenizers import Tokenizer as HFTokenizer
            self.hf = HFTokenizer.from_file(str(json_file))
            self.sp = None
            self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        elif sp_file.is_file():
            import sentencepiece
            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_file))
            self.hf = None
            self.vocab_size = self.sp.get_piece_size()
        else:
            raise EagletError(f"no tokenizer.json or tokenizer.model in {checkpoint_dir}")
        self.bos_token = token_content(tok_config.get("bos_token")) or (self.sp and self.sp.id_to_piece(self.sp.bos_id()))
        self.eos_token = token_content(tok_config.get("eos_token")) or (self.sp and self.sp.id_to_piece(self.sp.eos_id()))
        self.eos_ids = self._eos_ids(checkpoint_dir)
        self.chat_template = self._pick_template(checkpoint_dir, tok_config, chat_template)

    def _eos_ids(self, checkpoint_dir: Path) -> set:
        ids = set()
        for config in (read_json(checkpoint_dir / "config.json"), read_json(checkpoint_dir / "generation_config.json")):
            eos = config.get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.eos_token and self.token_id(self.eos_token) is not None:
            ids.add(self.token_id(self.eos_token))
        return ids

    def _pick_template(self, checkpoint_dir: Path, tok_config: dict, choice: str) -> str:
        if choice in BUILTIN_TEMPLATES:
            return BUILTIN_TEMPLATES[choice]
        if choice != "auto":
            raise EagletError(f"unknown chat template {choice!r} (auto, {', '.join(BUILTIN_TEMPLATES)})")
        template = tok_config.get("chat_template") or read_json(checkpoint_dir / "chat_template.json").get("chat_template")
        if isinstance(template, list):  # a list of named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        if template:
            return template
        return VICUNA_CHAT_TEMPLATE if "vicuna" in str(checkpoint_dir).lower() else LLAMA2_CHAT_TEMPLATE

    def token_id(self, piece: str):
        if self.hf is not None:
            return self.hf.token_to_id(piece)
        i = self.sp.piece_to_id(piece)
        return None if i == self.sp.unk_id() and piece != self.sp.id_to_piece(i) else i

    def encode(self, text: str, bos: bool = True) -> list:
        if self.hf is not None:
            return self.hf.encode(text, add_special_tokens=bos).ids
        return ([self.sp.bos_id()] if bos else []) + self.sp.encode(text)

    def decode(self, ids) -> str:
        if self.hf is not None:
            return self.hf.decode(list(ids), skip_special_tokens=True)
        return self.sp.decode(list(ids))

    def encode_chat(self, messages: list) -> list:
        """Token ids of a conversation rendered with the chat template, ready for the assistant's reply."""
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise EagletError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
        try:
            text = env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token or "",
                eos_token=self.eos_token or "")
        except jinja2.TemplateError as e:
            raise EagletError(f"chat template: {e}")
        return self.encode_with_specials(text)

    def encode_with_specials(self, text: str) -> list:
        """Encode text in which special tokens appear as strings (as chat templates write them)."""
        if self.hf is not None:
            return self.hf.encode(text, add_special_tokens=False).ids
        specials = [t for t in (self.bos_token, self.eos_token) if t]
        ids = []
        for part in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
            if part in specials:
                ids.append(self.token_id(part))
            elif part:
                ids.extend(self.sp.encode(part))
        return ids
