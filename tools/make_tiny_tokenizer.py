"""Train the tiny byte-level BPE tokenizer shipped as package data (run once; output committed).

    python tools/make_tiny_tokenizer.py [--data /work/shared/data/spec_bench_questions.jsonl]
                                        [--vocab 2048] [--out swiftspec_mpi/data]

Writes tiny_tokenizer.json (a `tokenizers` file: GPT-2 style byte-level pre-tokenizer and
decoder, special tokens <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2) and
tiny_tokenizer_config.json (ChatML chat template, eos <|im_end|>) into --out. `swiftspec
tiny-checkpoint` copies both into every tiny model folder. Byte-level: any text encodes.
"""
from __future__ import annotations

import argparse
import json
import os

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def texts(path):
    """The questions' user turns, plus the chat scaffolding words (so that 'system', 'user',
    'assistant' become single tokens)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                rec = json.loads(line)
                for turn in rec.get("turns", []):
                    yield turn
    for _ in range(50):
        yield "system\nYou are a helpful assistant.\nuser\nassistant\n"


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="/work/shared/data/spec_bench_questions.jsonl")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--out", default=os.path.join(here, "..", "swiftspec_mpi", "data"))
    args = ap.parse_args()

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, min_frequency=2, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts(args.data), trainer=trainer)
    for i, s in enumerate(SPECIAL):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    os.makedirs(args.out, exist_ok=True)
    tok.save(os.path.join(args.out, "tiny_tokenizer.json"), pretty=False)
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(args.out, "tiny_tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    print(f"vocab {tok.get_vocab_size()} -> {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
