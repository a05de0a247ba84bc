"""`TextTokenizer` (encode, decode, chat template, EOS ids, vocab fingerprint) over a `tokenizers`
Tokenizer, and `StreamDecoder` (incremental detokenization for streaming text).

HF folder layout read by `from_hf_folder`: tokenizer.json (required), tokenizer_config.json
(chat_template, bos/eos tokens, add_bos_token), chat_template.jinja (transformers 5.x puts the
template there), config.json and generation_config.json (eos_token_id, int or list).
"""
from __future__ import annotations

import hashlib
import json
import os

from swiftspec_mpi.core.errors import CheckpointError


def _token_content(tok) -> str | None:
    if tok is None:
        return None
    if isinstance(tok, dict):
        return tok.get("content")
    return str(tok)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        return d if isinstance(d, dict) else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}); re-download or re-convert the "
                              "checkpoint") from None


def _ids(v) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return [int(i) for i in v]
    return [int(v)]


class TextTokenizer:
    """Text <-> token ids for one model.

    encode(text) -> list[int]: no special tokens added except BOS when `add_bos` (and the text
    does not already start with it, as a rendered Llama-3 chat template does).
    decode(ids, skip_special_tokens=True) -> str.
    apply_chat_template(user_text) -> str: the prompt text for one user turn (the template's
    generation prompt appended); the text itself when the model has no template.
    render_conversation(messages) -> str: the same for a whole conversation (--interactive --chat).
    """

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], bos_token_id: int | None = None,
                 chat_template: str | None = None, add_bos: bool = False):
        self.tok = tokenizer
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.add_bos = bool(add_bos) and bos_token_id is not None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._fingerprint: str | None = None
        self._template = None

    # ---------------------------------------------------------------------------- construction
    @classmethod
    def from_hf_folder(cls, folder) -> "TextTokenizer":
        """The tokenizer of a Hugging Face folder (tokenizer.json, its config and generation config)."""
        from tokenizers import Tokenizer
        folder = os.fspath(folder)
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing; the model folder needs the fast-tokenizer "
                                  "file tokenizer.json (save it with the model, or convert the "
                                  "model to GGUF which embeds its tokenizer)")
        try:
            tok = Tokenizer.from_file(path)
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot be parsed as a tokenizers file ({exc}); "
                                  "re-download or re-save the tokenizer") from None
        tcfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
        mcfg = _read_json(os.path.join(folder, "config.json"))
        gcfg = _read_json(os.path.join(folder, "generation_config.json"))

        template = tcfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if not template and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        if not template:
            template = _read_json(os.path.join(folder, "chat_template.json")).get("chat_template")

        eos: list[int] = []
        for i in _ids(mcfg.get("eos_token_id")) + _ids(gcfg.get("eos_token_id")):
            if i not in eos:
                eos.append(i)
        eos_text = _token_content(tcfg.get("eos_token"))
        if eos_text is not None:
            tid = tok.token_to_id(eos_text)
            if tid is not None and tid not in eos:
                eos.append(tid)
        bos_text = _token_content(tcfg.get("bos_token"))
        bos_id = tok.token_to_id(bos_text) if bos_text else None
        if bos_id is None and mcfg.get("bos_token_id") is not None and bos_text is None \
                and "add_bos_token" in tcfg:
            bos_id = int(mcfg["bos_token_id"])
        if "add_bos_token" in tcfg:
            add_bos = bool(tcfg["add_bos_token"])
        else:  # does the tokenizer's post-processor prepend BOS (Llama 3 does)?
            add_bos = False
            if bos_id is not None:
                with_sp = tok.encode("a", add_special_tokens=True).ids
                add_bos = bool(with_sp) and with_sp[0] == bos_id
        if not eos:
            raise CheckpointError(f"{folder}: no EOS token found (config.json eos_token_id, "
                                  "generation_config.json or tokenizer_config.json eos_token); "
                                  "add eos_token_id to config.json")
        return cls(tok, tuple(eos), bos_id, template, add_bos)

    # ---------------------------------------------------------------------------- text
    def encode(self, text: str) -> list[int]:
        """text -> token ids (with the BOS token first when the model adds one)."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """token ids (any int sequence) -> text."""
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, i: int) -> str | None:
        """The vocabulary entry of token id i (None if it has none)."""
        return self.tok.id_to_token(int(i))

    def apply_chat_template(self, user_text: str) -> str:
        """Render the chat template (sandboxed jinja2, as transformers does) for one user turn,
        with add_generation_prompt=True. Without a template, returns user_text unchanged."""
        return self.render_conversation([{"role": "user", "content": user_text}])

    def render_conversation(self, messages: list[dict]) -> str:
        """The chat template over `messages` ([{"role": "user" | "assistant" | "system",
        "content": str}, ...], ending with a user turn), add_generation_prompt=True: the prompt
        text of the conversation's next reply. Without a template, the contents joined by
        newlines (a plain transcript to continue)."""
        if not self.chat_template:
            return "\n".join(m["content"] for m in messages)
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        bos = self.tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.tok.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        return self._template.render(messages=messages, add_generation_prompt=True, bos_token=bos or "",
                                     eos_token=eos or "", tools=None, documents=None)

    def fingerprint(self) -> str:
        """sha256 of the vocabulary (token string -> id, added tokens included): two models can
        be a draft/target pair only when their fingerprints are equal."""
        if self._fingerprint is None:
            vocab = self.tok.get_vocab(with_added_tokens=True)
            h = hashlib.sha256()
            for token, i in sorted(vocab.items(), key=lambda kv: kv[1]):
                h.update(f"{i}\t{token}\n".encode("utf-8", "surrogatepass"))
            self._fingerprint = h.hexdigest()
        return self._fingerprint


def _compile_template(source: str):
    """A jinja2 template in an immutable sandbox, with the helpers HF chat templates use."""
    from datetime import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise CheckpointError(f"the model's chat template does not compile ({exc})") from None


class StreamDecoder:
    """Incremental detokenization: `push(ids)` returns the new printable text since the last
    push. Text that ends in an incomplete UTF-8 sequence is held back until it completes;
    `flush()` returns whatever is still held (at the end of generation). Special tokens are
    skipped. Work per push is bounded by a small window of recent tokens."""

    def __init__(self, tok: TextTokenizer):
        self.tok = tok
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, ids) -> str:
        """Append token ids; -> the text they complete (held back while a character is split)."""
        self.ids.extend(int(i) for i in ids)
        prefix_text = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self.tok.decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """The text still held back, at the end of the stream."""
        prefix_text = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self.tok.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):]
