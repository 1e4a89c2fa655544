"""Tokenizers (sentencepiece tokenizer.model, or Hugging Face tokenizer.json) and chat formatting.

The checkpoint's own chat template (chat_template.jinja, as recent transformers save it, or the
chat_template of tokenizer_config.json / chat_template.json) is rendered with jinja2; LLaMA-2-chat and
Vicuna templates are built in for checkpoints that have none, and `chat_template_source` says which is used.
"""
import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Optional

from checkpoint import EagletError, read_json_object

LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set sys = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}{% set msgs = messages[1:] %}"
    "{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
    "{% for m in msgs %}{% if m['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + (sys if loop.first else '') + m['content'].strip() + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'].strip() + ' ' + eos_token }}"
    "{% else %}{{ raise_exception('the llama2 template takes a system message first, then user and assistant turns; '"
    " + 'not a ' + m['role'] + ' message there') }}{% endif %}{% endfor %}")
VICUNA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + ' ' }}"
    "{% else %}A chat between a curious user and an artificial intelligence assistant. The assistant gives "
    "helpful, detailed, and polite answers to the user's questions. {% endif %}"
    "{% for m in messages if m['role'] != 'system' %}{% if m['role'] == 'user' %}{{ 'USER: ' + m['content'] + ' ' }}"
    "{% else %}{{ 'ASSISTANT: ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
BUILTIN_TEMPLATES = {"llama2": LLAMA2_CHAT_TEMPLATE, "vicuna": VICUNA_CHAT_TEMPLATE}


def read_json(path: Path) -> dict:
    """An optional JSON file of the checkpoint's folder: {} when it is not there."""
    return read_json_object(path) if path.is_file() else {}


def read_tokenizer(load, path: Path):
    try:
        return load(str(path))
    except Exception as e:  # sentencepiece and tokenizers raise plain RuntimeError / Exception
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise EagletError(f"cannot read the tokenizer {path}: {first_line}")


def token_content(token) -> str:
    return token.get("content") if isinstance(token, dict) else token


class Tokenizer:
    """encode / decode / eos_ids / apply_chat_template over either tokenizer format."""

    def __init__(self, path, chat_template: str = "auto", template_kwargs: Optional[dict] = None):
        """path: a checkpoint folder, or a tokenizer.json / sentencepiece .model file itself.
        chat_template: auto, a built-in name, or a .jinja file; template_kwargs: extra variables it reads."""
        path = Path(path)
        checkpoint_dir = path.parent if path.is_file() else path
        json_file = path if path.is_file() and path.suffix == ".json" else checkpoint_dir / "tokenizer.json"
        sp_file = path if path.is_file() and path.suffix == ".model" else checkpoint_dir / "tokenizer.model"
        tok_config = read_json(checkpoint_dir / "tokenizer_config.json")
        self.hf = self.sp = None
        self.tool_template = None  # a checkpoint's template named tool_use, rendered when a request gives tools
        if json_file.is_file():
            from tokenizers import Tokenizer as HFTokenizer
            self.hf = read_tokenizer(HFTokenizer.from_file, json_file)
            self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        elif sp_file.is_file():
            import sentencepiece
            self.sp = read_tokenizer(lambda f: sentencepiece.SentencePieceProcessor(model_file=f), sp_file)
            self.vocab_size = self.sp.get_piece_size()
        else:
            raise EagletError(f"no tokenizer.json or tokenizer.model in {checkpoint_dir}")
        self.bos_token = token_content(tok_config.get("bos_token")) or (self.sp and self.sp.id_to_piece(self.sp.bos_id()))
        self.eos_token = token_content(tok_config.get("eos_token")) or (self.sp and self.sp.id_to_piece(self.sp.eos_id()))
        self.eos_ids = self._eos_ids(checkpoint_dir)
        self.chat_template, self.chat_template_source = self._pick_template(checkpoint_dir, tok_config, chat_template)
        self.template_kwargs = dict(template_kwargs or {})
        taken = set(self.template_kwargs) & {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"}
        if taken:
            raise EagletError(f"chat template variables {sorted(taken)} are set by eaglet itself, not by kwargs")

    def _eos_ids(self, checkpoint_dir: Path) -> set:
        ids = set()
        for name in ("config.json", "generation_config.json"):
            eos = read_json(checkpoint_dir / name).get("eos_token_id")
            eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
            wrong = [i for i in eos if type(i) is not int or not 0 <= i < self.vocab_size]
            if wrong:  # a reply would never end there, or end at a token the text cannot show
                raise EagletError(f"{checkpoint_dir / name}: eos_token_id {wrong[0]!r} is not a token id of the "
                                  f"tokenizer ({self.vocab_size} tokens)")
            ids.update(eos)
        if self.eos_token and self.token_id(self.eos_token) is not None:
            ids.add(self.token_id(self.eos_token))
        return ids

    def _pick_template(self, checkpoint_dir: Path, tok_config: dict, choice: str) -> tuple:
        """(template, where it came from)."""
        if choice in BUILTIN_TEMPLATES:
            return BUILTIN_TEMPLATES[choice], f"built-in {choice} (--chat_template {choice})"
        if choice != "auto" and Path(choice).is_file():
            try:
                return Path(choice).read_text(encoding="utf-8"), f"{choice} (--chat_template)"
            except (OSError, UnicodeDecodeError) as e:
                raise EagletError(f"cannot read the chat template {choice}: {e}")
        if choice != "auto" and (choice.endswith(".jinja") or "/" in choice):
            raise EagletError(f"chat template file not found: {choice}")
        if choice != "auto":
            raise EagletError(f"unknown chat template {choice!r} (auto, {', '.join(BUILTIN_TEMPLATES)}, or a .jinja "
                              "file)")
        jinja_file = checkpoint_dir / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8", errors="replace"), str(jinja_file)
        for name, config in [("tokenizer_config.json", tok_config),
                             ("chat_template.json", read_json(checkpoint_dir / "chat_template.json"))]:
            template = config.get("chat_template")
            if isinstance(template, list):  # named templates: the default one; tool_use for requests with tools
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                self.tool_template = named.get("tool_use")
                template = named.get("default") or template[0]["template"]
            if template:
                return template, str(checkpoint_dir / name)
        name = "vicuna" if "vicuna" in str(checkpoint_dir).lower() else "llama2"
        return BUILTIN_TEMPLATES[name], (f"built-in {name}, as the checkpoint has no chat template of its own "
                                         "(--chat_template llama2 or vicuna picks one)")

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
        unknown = [i for i in ids if not 0 <= i < self.vocab_size]
        if unknown:
            raise EagletError(f"token id {unknown[0]} is beyond the tokenizer's {self.vocab_size} tokens: "
                              "the model and its tokenizer do not belong together")
        if self.hf is not None:
            return self.hf.decode(list(ids), skip_special_tokens=True)
        return self.sp.decode(list(ids))

    def encode_chat(self, messages: list, tools: Optional[list] = None) -> list:
        """Token ids of a conversation rendered with the chat template, ready for the assistant's reply; tools:
        OpenAI's function tools, for a template that reads them (takes_tools)."""
        return self.encode_with_specials(self.render_chat(messages, tools))

    def render_chat(self, messages: list, tools: Optional[list] = None, add_generation_prompt: bool = True) -> str:
        """The conversation as the chat template writes it, with the variables transformers' apply_chat_template
        gives: tools and documents are defined (None when not given) whether or not there are any."""
        template = self.tool_template if tools is not None and self.tool_template else self.chat_template
        try:
            return compiled_template(template).render(
                **{"documents": None, **self.template_kwargs}, tools=tools, messages=messages,
                add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except EagletError:
            raise
        except Exception as e:  # a template is code: whatever it raises (a TypeError as well) is the template's
            raise EagletError(f"chat template: {type(e).__name__}: {e}")

    def takes_tools(self) -> bool:
        """Whether the chat template reads a tools variable (templates with tool support do)."""
        import jinja2
        from jinja2 import meta
        try:
            template = self.tool_template or self.chat_template
            return "tools" in meta.find_undeclared_variables(template_environment().parse(template))
        except jinja2.TemplateError:
            return False

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


def raise_exception(message):
    raise EagletError(f"chat template: {message}")


@lru_cache(maxsize=8)
def compiled_template(source: str):
    """A chat template compiled once (a server renders it for every request), with the functions templates call."""
    env = template_environment()
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env.from_string(source)


def template_environment():
    """The sandboxed jinja2 environment chat templates are rendered in, as Hugging Face renders them: its tojson is
    json.dumps (jinja2's own escapes < > & as \\u003c..., text no template was trained on); {% generation %} blocks
    (transformers' mark of the assistant's text, for training masks) render as their body, in a scope of their own."""
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("render_body"), [], [], body).set_lineno(lineno)

        def render_body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return env
