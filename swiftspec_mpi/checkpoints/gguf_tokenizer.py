"""The tokenizer a GGUF file embeds, rebuilt as a Hugging Face fast tokenizer:

    tokenizer_from_gguf(path) -> TextTokenizer (byte-level BPE rebuilt from tokenizer.ggml.*)
    gguf_tokenizer_files(path) -> (tokenizer.json text, tokenizer_config dict, generation_config
                              dict) for writing a Hugging Face folder (registry.prepare_folder)
    build_tokenizer(meta, path) -> tokenizers.Tokenizer from the GGUF metadata
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from swiftspec_mpi.checkpoints.gguf_config import FIX, TOKEN_CONTROL, TOKEN_USER_DEFINED, eos_ids
from swiftspec_mpi.checkpoints.gguf_loader import Header, read_header
from swiftspec_mpi.checkpoints.tokenizer import TextTokenizer
from swiftspec_mpi.core.errors import CheckpointError

# llama.cpp pre-tokenizer names (tokenizer.ggml.pre) -> split regex, as in the HF tokenizers
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_QWEN2 = ("qwen2", "deepseek-r1-qwen")
_PRE_LLAMA3 = ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe")
_PRE_DIGITS = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")
_PRE_GPT2 = ("default", "gpt2", "gpt-2")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tokenizer(meta: dict, path: str = "<gguf>"):
    """A `tokenizers.Tokenizer` equal to the model's fast tokenizer, from GGUF metadata.

    Byte-level BPE (tokenizer.ggml.model == "gpt2"): vocab (tokens outside the byte alphabet
    re-spelled in it), merges, control tokens as special added tokens, user-defined ones as plain
    added tokens (both matched whole), the split regex named by tokenizer.ggml.pre, byte-level
    decoder. Two deliberate differences from transformers' GGUF tokenizer, both following the
    upstream tokenizer.json and llama.cpp: qwen2 gets the NFC normalizer, smollm/starcoder split
    digits one by one.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"{path}: GGUF tokenizer type {kind!r} is not supported (only "
                              "byte-level BPE, 'gpt2', as Qwen/Llama-3/SmolLM use); use the "
                              "model's Hugging Face folder with its tokenizer.json")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise CheckpointError(f"{path}: GGUF lacks tokenizer.ggml.tokens/merges; {FIX}")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = meta.get("tokenizer.ggml.pre", "default")

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, t in enumerate(tokens):
        vocab[t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))] = i
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:   # corrupt tokens/merges: tokenizers raises a bare Exception ("out of vocabulary")
        tok = Tokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False))
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{path}: corrupt GGUF tokenizer ({str(exc)!r}); {FIX}") from None
    if pre in _PRE_QWEN2:
        tok.normalizer = normalizers.NFC()
        split = _QWEN2_SPLIT
    elif pre in _PRE_LLAMA3:
        split = _LLAMA3_SPLIT
    elif pre in _PRE_DIGITS:
        split = None
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in _PRE_GPT2:
        split = None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        known = ", ".join(_PRE_QWEN2 + _PRE_LLAMA3 + _PRE_DIGITS + _PRE_GPT2)
        raise CheckpointError(f"{path}: GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not "
                              f"supported (known: {known}); use the model's Hugging Face folder "
                              "with its tokenizer.json")
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # control tokens spelled outside the byte alphabet are llama.cpp mislabels: adding them would
    # grow the vocabulary past the embedding, so skip them (as transformers does)
    special = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL and set(t) <= alphabet]
    if special:
        tok.add_special_tokens(special)
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise CheckpointError(f"{path}: the GGUF tokenizer rebuilt to "
                              f"{tok.get_vocab_size(with_added_tokens=True)} tokens, the file "
                              f"lists {len(tokens)} (duplicate token strings?); {FIX}")
    return tok


def _tokenizer_info(h: Header) -> dict:
    meta = h.meta
    tokens = meta.get("tokenizer.ggml.tokens") or []

    def text(key):
        i = meta.get(key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    eos = eos_ids(meta)
    if not eos:
        raise CheckpointError(f"{h.path}: GGUF has no tokenizer.ggml.eos_token_id; {FIX}")
    return {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_ids": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "bos_token": text("tokenizer.ggml.bos_token_id"),
        "eos_token": text("tokenizer.ggml.eos_token_id"),
        "pad_token": text("tokenizer.ggml.padding_token_id"),
        "unk_token": text("tokenizer.ggml.unknown_token_id"),
        "add_bos": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template"),
        "context_length": meta.get(f"{meta.get('general.architecture')}.context_length"),
    }


def tokenizer_from_gguf(path):
    """The TextTokenizer embedded in a GGUF file."""
    h = read_header(path)
    info = _tokenizer_info(h)
    tok = build_tokenizer(h.meta, h.path)
    return TextTokenizer(tok, info["eos_token_ids"], info["bos_token_id"], info["chat_template"],
                         info["add_bos"])


def gguf_tokenizer_files(path) -> tuple[str, dict, dict]:
    """(tokenizer.json text, tokenizer_config.json dict, generation_config.json dict) that make a
    Hugging Face folder's tokenizer equal to the GGUF's."""
    h = read_header(path)
    info = _tokenizer_info(h)
    tok = build_tokenizer(h.meta, h.path)
    eos = list(info["eos_token_ids"])
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": info["bos_token"], "eos_token": info["eos_token"],
        "pad_token": info["pad_token"], "unk_token": info["unk_token"],
        "add_bos_token": info["add_bos"], "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(info["context_length"] or 4096),
    }
    if info["chat_template"]:
        tok_cfg["chat_template"] = info["chat_template"]
    gen_cfg = {"bos_token_id": info["bos_token_id"],
               "eos_token_id": eos if len(eos) > 1 else eos[0],
               "pad_token_id": info["pad_token_id"]}
    return tok.to_str(), tok_cfg, gen_cfg
