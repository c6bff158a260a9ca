#!/usr/bin/env python3
"""Cross-checks our tokenizer (common/model/tokenizer.h) against Hugging Face `tokenizers`.

Optional developer check; the test suite does not depend on it. Needs the `tokenizers` package,
e.g. in a throwaway venv:
    /usr/bin/python3 -m venv /tmp/tok-venv && /tmp/tok-venv/bin/pip install tokenizers
    build/tools/hmoe-make-model --preset tiny --out /tmp/tiny
    /tmp/tok-venv/bin/python scripts/check_tokenizer.py --model /tmp/tiny \
        --encoder "build/tools/hmoe-tokenize --model /tmp/tiny" \
        --decoder "build/tools/hmoe-tokenize --model /tmp/tiny --decode"

The encoder command reads one JSON string per line on stdin and prints the token ids of each
(space-separated, no BOS) on one line. Prints every disagreement and a summary; exits 1 if any.
"""
import argparse
import json
import random
import subprocess
import sys

from tokenizers import Tokenizer

SENTENCES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing spaces   ",
    "tabs\tand\nnewlines\r\nand\n\n\nblank lines\n",
    "Numbers 1 12 123 1234 12345 3.14159 1,000,000 2025-03-03",
    "Punctuation!!! ... ?? (parens) [brackets] {braces} \"quotes\" 'apostrophes' don't",
    "def f(x):\n    return x * 2  # comment\n",
    "你好，世界！今天天气很好。",
    "こんにちは、世界。カタカナ ひらがな",
    "안녕하세요 세계",
    "Привет, мир! Γειά σου κόσμε.",
    "Ça va très bien, merci. Größe über Straße. ¿Qué tal?",
    "Emoji: 😀 😂 👍🏽 👨‍👩‍👧 ❤️ 🇫🇷",
    "Math: ∑ x² ≤ ∞ ± √2 ≈ 1.414",
    "Fullwidth：ＡＢＣ１２３！",
    "Arabic: مرحبا بالعالم ١٢٣",
    "Hindi: नमस्ते दुनिया",
    # Unicode 15.0-16.0 (the pre-tokenizer's tables are 16.0, as tokenizers'):
    "Unicode 15/16: a\U0001FAE8b \U00010D50\U00010D70 x\U0002EBF0\U00031350y "
    "1\U00016D70\U00016D71\U00016D72 \U00011380\U000113B8! \U0001FA89 A\U0001CC00,\U0001E5D0",
    "combining: e\u0301 a\u0308 n\u0303",
    "nbsp:\u00a0x ideographic:\u3000y zero-width:\u200bz",
    "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>",
    "x<｜User｜><｜User｜>  <｜Assistant｜>\n",
    "",
    " ",
    "\n",
    "a",
]

ALPHABET = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") +
            list(" \t\n\r.,;:!?'\"()[]{}<>-_+=*/\\|@#$%^&~`") +
            [" ", " ", " ", "  ", "\n\n", " the", " and", "ing", "tion"] +
            list("éèêëàâäîïôöùûüçñßøåæœ") + list("αβγδεζηθ") + list("абвгдежзий") +
            list("中文字汉语日本語") + list("ぁあいうえおかきくけこ") + list("アイウエオカキクケコー") +
            list("가나다라마바사") + ["\u0301", "\u0308", "\u200d", "\ufe0f", "\u00a0", "\u3000",
                                     "\u2028", "\u0085", "\u000b", "\u000c"] +
            list("😀😂👍🔥🚀✨🌍") + list("，。！？、「」（）：；") + list("０１２３ＡＢＣ") +
            list("∑∞≤≥±×÷√€£¥©®™°§¶•…–—‘’“”") + list("١٢٣مرحبا") + list("नमस्ते") +
            ["\U0001FAE8", "\U00010D50", "\U00010D70", "\U0002EBF0", "\U00016D70", "\U000113B8",
             "\U0001CC00", "\U0001E5D0"] +
            ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"])


def random_strings(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(1, 40)
        out.append("".join(rng.choice(ALPHABET) for _ in range(length)))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="directory with tokenizer.json")
    parser.add_argument("--encoder", required=True, help="command: JSON strings in, ids out")
    parser.add_argument("--decoder", default="",
                        help="optional command: lines of ids in, JSON strings out (e.g. "
                             "hmoe-tokenize --decode); compared with Hugging Face decode()")
    parser.add_argument("--random", type=int, default=400, help="number of random strings")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    hf = Tokenizer.from_file(args.model + "/tokenizer.json")
    texts = SENTENCES + random_strings(args.random, args.seed)
    stdin = "".join(json.dumps(t) + "\n" for t in texts)
    result = subprocess.run(args.encoder, shell=True, input=stdin.encode(), capture_output=True,
                            check=True)
    lines = result.stdout.decode().split("\n")
    failures = 0
    for i, text in enumerate(texts):
        want = hf.encode(text, add_special_tokens=False).ids
        got = [int(x) for x in lines[i].split()] if i < len(lines) else None
        if got != want:
            failures += 1
            print("MISMATCH %r\n  hf:   %s\n  ours: %s" % (text, want, got))
            print("  hf tokens: %s" % [hf.id_to_token(t) for t in want])
    checked = len(texts)
    if args.decoder:
        # Encodings of the texts, then random id sequences (byte tokens among them make
        # ill-formed UTF-8, which both sides must replace with U+FFFD the same way).
        rng = random.Random(args.seed)
        sequences = [hf.encode(t, add_special_tokens=False).ids for t in texts]
        vocab = hf.get_vocab_size()
        sequences += [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
                      for _ in range(args.random)]
        sequences += [[rng.randrange(3, 259) for _ in range(rng.randint(1, 8))]
                      for _ in range(args.random)]
        ids_in = "".join(" ".join(str(i) for i in ids) + "\n" for ids in sequences)
        result = subprocess.run(args.decoder, shell=True, input=ids_in.encode(),
                                capture_output=True, check=True)
        decoded = result.stdout.decode().split("\n")
        for i, ids in enumerate(sequences):
            want = hf.decode(ids, skip_special_tokens=False)
            got = json.loads(decoded[i]) if i < len(decoded) and decoded[i] else None
            checked += 1
            if got != want:
                failures += 1
                print("DECODE MISMATCH %s\n  hf:   %r\n  ours: %r" % (ids, want, got))
    print("%d passed, %d failed" % (checked - failures, failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
