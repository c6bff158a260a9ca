#!/usr/bin/env python3
"""Kimi-K2's tokenizer (issue 17 item 4): our tiktoken loader (common/model/tokenizer.h) against
the `tiktoken` Python package, token ids identical on encode and text identical on decode.

Two checkpoints' tokenizers, each loaded by hmoe-tokenize from a directory holding tiktoken.model
and tokenizer_config.json (no tokenizer.json), as a Kimi-K2 checkpoint ships them:
  1. the one hmoe-make-model --tokenizer kimi writes (BPE ranks trained on English-ish text);
  2. one this script writes: the 256 bytes plus every byte pair and triple of the test texts, in a
     seeded random rank order. Every piece then merges across every byte boundary it has, so a
     piece boundary that differs from tiktoken's (a pre-tokenizer difference) shows in the ids
     even where the first vocabulary would fall back to the same single bytes.
tiktoken gets Kimi-K2's pat_str and special tokens as tokenization_kimi.py builds them
(added_tokens_decoder names, "<|reserved_token_ID|>" for the other 256 slots after the ranks).
Texts: fixed sentences and generated multilingual mixes (CJK and other Han-script characters,
kana, Hangul, Latin with case and contractions, Greek, Cyrillic, Arabic, Devanagari, combining
marks, emoji sequences, Unicode 15/16 characters, digits, whitespace runs, special tokens),
encoded with and without special-token parsing; decode of the encodings, of random ids and of
random byte tokens (ill-formed UTF-8 -> U+FFFD).
The package comes from a venv in the build tree (pinned: tiktoken_requirements.txt), created on
demand; without PyPI the test is skipped (exit 77), except under CI=true, where that fails.
usage: tiktoken_conformance_test.py --bin-dir BUILD/tools --work-dir DIR --venv DIR
       --requirements FILE
"""
import argparse
import base64
import json
import os
import random
import shutil
import subprocess
import sys

SKIP = 77

# tokenization_kimi.py's pat_str (Kimi-K2), the eight alternatives joined by "|".
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED_SPECIAL_TOKENS = 256


def ensure_venv(args):
    """Re-executes this script under the venv's python (tests/python/hmoe_venv.py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import hmoe_venv
    hmoe_venv.ensure_venv(args.venv, args.requirements, "the tiktoken package", "HMOE_TIKTOKEN_IN_VENV")


SENTENCES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing spaces   ",
    "tabs\tand\nnewlines\r\nand\n\n\nblank lines\n",
    "Numbers 1 12 123 1234 12345 3.14159 1,000,000 2025-03-03",
    "I'm sure you're right, they've said we'll see; don't, can't, I'd. IT'S HE'LL WE'RE 'S 'ſ",
    "CamelCase iPhone McDonald's HTTPServer XMLHttpRequest ǅemal ǈubljana ABCdef abcDEF",
    "def f(x):\n    return x * 2  # comment\n",
    "你好，世界！今天天气很好。人々〇〡〥⺀⼀𠀀丽",
    "こんにちは、世界。カタカナ ひらがな ラーメン",
    "안녕하세요 세계",
    "Привет, мир! Γειά σου κόσμε. ΣΊΣΥΦΟΣ",
    "Ça va très bien, merci. Größe über Straße. ¿Qué tal?",
    "Emoji: 😀 😂 👍🏽 👨‍👩‍👧 ❤️ 🇫🇷",
    "Unicode 15/16: \U0001FAE8 \U0001FA89 \U00010D50\U00010D70 \U00011380 \U0001E5D0 "
    "\U00016D40\U00016D43 \U0002EBF0 \U00031350 \U0001CC00",
    "Math: ∑ x² ≤ ∞ ± √2 ≈ 1.414 ½ ⅷ Ⅻ",
    "Fullwidth：ＡＢＣ１２３！",
    "Arabic: مرحبا بالعالم ١٢٣",
    "Hindi: नमस्ते दुनिया",
    "combining: e\u0301 a\u0308 n\u0303 \u0301x !\u0301 \u0301\u0301A",
    "nbsp:\u00a0x ideographic:\u3000y zero-width:\u200bz",
    "[BOS]You are helpful.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>",
    "x<|reserved_token_900|>[EOS] <|im_end|>\n[PAD][UNK]",
    "",
    " ",
    "\n",
    "a",
]

POOL = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") +
        list(" \t\n\r.,;:!?'\"()[]{}<>-_+=*/\\|@#$%^&~`") +
        [" ", " ", " ", "  ", "\n\n", "\r\n", " the", " The", " AND", "ing", "'s", "'S", "'t",
         "'re", "'Ve", "'LL", "'d", "'M", "'ſ", "'x"] +
        list("éèêëàâäîïôöùûüçñßøåæœÉÀÇ") + list("αβγδεζηθΣσς") + list("абвгдежзийДЖ") +
        list("中文字汉语日本語") + ["々", "〇", "〡", "⺀", "⼀", "𠀀", "丽", "〻"] +
        list("ぁあいうえおかきくけこ") + list("アイウエオカキクケコー") +
        list("가나다라마바사") + ["ʰ", "ǅ", "ǈ", "ª", "º", "ⅷ", "Ⅻ", "½", "²"] +
        ["\u0301", "\u0308", "\u200d", "\ufe0f", "\u00a0", "\u3000", "\u2028", "\u0085",
         "\u000b", "\u000c", "\u302a", "\u0345"] +
        list("😀😂👍🔥🚀✨🌍") + ["👍🏽", "👨‍👩‍👧", "❤️", "🇫🇷"] +
        list("，。！？、「」（）：；") + list("０１２３ＡＢＣ") +
        list("∑∞≤≥±×÷√€£¥©®™°§¶•…–—‘’“”") + list("١٢٣مرحبا") + list("नमस्ते") +
        # Unicode 15.0/15.1/16.0: emoji, Garay (cased letters), Tulu-Tigalari, Ol Onal, Kirat Rai,
        # CJK extensions H and I (Han), legacy computing symbols.
        ["\U0001FAE8", "\U0001FA89", "\U00010D50", "\U00010D70", "\U00011380", "\U0001E5D0",
         "\U00016D40", "\U00016D43", "\U0002EBF0", "\U00031350", "\U0001CC00", "\U00011F04"] +
        ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|reserved_token_1000|>", "<|im_"])


def random_texts(n, seed):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 10 == 9:  # long runs of one kind
            piece = rng.choice(["1", " ", "\n", " \n", "a", "A", "中", "😀", "\u0301", "!", "aB"])
            out.append(rng.choice(POOL) + piece * rng.randint(2, 300) + rng.choice(POOL))
            continue
        out.append("".join(rng.choice(POOL) for _ in range(rng.randint(1, 50))))
    return out


def read_config(model_dir):
    with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        return json.load(f)


def kimi_encoding(tiktoken, model_dir):
    """tiktoken.Encoding built as tokenization_kimi.py builds it."""
    from tiktoken.load import load_tiktoken_bpe
    ranks = load_tiktoken_bpe(os.path.join(model_dir, "tiktoken.model"))
    named = {int(k): v["content"]
             for k, v in read_config(model_dir).get("added_tokens_decoder", {}).items()}
    n = len(ranks)
    specials = {named.get(i, "<|reserved_token_%d|>" % i): i
                for i in range(n, n + NUM_RESERVED_SPECIAL_TOKENS)}
    return tiktoken.Encoding(name="kimi", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                             special_tokens=specials)


def write_pair_vocab(src_dir, dst_dir, texts, seed):
    """tiktoken.model with the 256 bytes and every byte pair/triple of `texts`; the config of
    `src_dir` with its special ids moved to follow the new ranks."""
    grams = set()
    for t in texts:
        b = t.encode("utf-8")
        for i in range(len(b)):
            grams.add(b[i:i + 2])
            grams.add(b[i:i + 3])
    grams = sorted(g for g in grams if len(g) >= 2)
    random.Random(seed).shuffle(grams)
    tokens = [bytes([i]) for i in range(256)] + grams
    os.makedirs(dst_dir)
    with open(os.path.join(dst_dir, "tiktoken.model"), "w") as f:
        for rank, tok in enumerate(tokens):
            f.write("%s %d\n" % (base64.b64encode(tok).decode(), rank))
    config = read_config(src_dir)
    with open(os.path.join(src_dir, "tiktoken.model")) as f:
        old_base = sum(1 for line in f if line.strip())
    config["added_tokens_decoder"] = {
        str(int(k) - old_base + len(tokens)): v
        for k, v in config["added_tokens_decoder"].items()}
    with open(os.path.join(dst_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def run_tool(cmd, lines):
    r = subprocess.run(cmd, input="".join(l + "\n" for l in lines).encode(), capture_output=True)
    if r.returncode != 0:
        print("FAILED: %s exited %d: %s" % (" ".join(cmd), r.returncode, r.stderr.decode()[-2000:]))
        sys.exit(1)
    return r.stdout.decode().split("\n")


def check_model(tiktoken, tokenize, model_dir, texts, seed):
    enc = kimi_encoding(tiktoken, model_dir)
    checked = failures = 0
    for parse_special in (True, False):
        got_lines = run_tool([tokenize, "--model", model_dir,
                              "--parse_special=%s" % ("true" if parse_special else "false")],
                             [json.dumps(t) for t in texts])
        for i, text in enumerate(texts):
            want = (enc.encode(text, allowed_special="all") if parse_special else
                    enc.encode(text, disallowed_special=()))
            got = [int(x) for x in got_lines[i].split()]
            checked += 1
            if got != want:
                failures += 1
                if failures <= 20:
                    print("ENCODE MISMATCH (%s, parse_special=%s) %r\n  tiktoken: %s\n  ours:     %s"
                          % (model_dir, parse_special, text, want, got))
                    print("  tiktoken pieces: %r" % [enc.decode_single_token_bytes(t) for t in want])
    rng = random.Random(seed)
    sequences = [enc.encode(t, allowed_special="all") for t in texts]
    sequences += [[rng.randrange(enc.n_vocab) for _ in range(rng.randint(1, 12))]
                  for _ in range(len(texts))]
    sequences += [[rng.randrange(0, 256) for _ in range(rng.randint(1, 8))]
                  for _ in range(len(texts))]
    decoded = run_tool([tokenize, "--model", model_dir, "--decode"],
                       [" ".join(str(i) for i in ids) for ids in sequences])
    for i, ids in enumerate(sequences):
        want = enc.decode(ids)
        got = json.loads(decoded[i])
        checked += 1
        if got != want:
            failures += 1
            if failures <= 40:
                print("DECODE MISMATCH (%s) %s\n  tiktoken: %r\n  ours:     %r"
                      % (model_dir, ids, want, got))
    print("%s: %d encodings and decodings checked, %d mismatches" % (model_dir, checked, failures))
    return checked, failures


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--venv", required=True)
    p.add_argument("--requirements", required=True)
    p.add_argument("--random", type=int, default=3000)
    p.add_argument("--seed", type=int, default=17)
    args = p.parse_args()
    ensure_venv(args)
    import tiktoken

    make_model = os.path.join(args.bin_dir, "hmoe-make-model")
    tokenize = os.path.join(args.bin_dir, "hmoe-tokenize")
    shutil.rmtree(args.work_dir, ignore_errors=True)
    os.makedirs(args.work_dir)
    model = os.path.join(args.work_dir, "kimi-tiny")
    r = subprocess.run([make_model, "--preset", "tiny", "--tokenizer", "kimi", "--out", model,
                        "--threads", "1"], capture_output=True, text=True)
    if r.returncode != 0:
        print("FAILED: hmoe-make-model: " + r.stderr[-2000:])
        return 1
    if os.path.exists(os.path.join(model, "tokenizer.json")):
        print("FAILED: hmoe-make-model --tokenizer kimi wrote a tokenizer.json")
        return 1
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    enc = kimi_encoding(tiktoken, model)
    want_ids = (enc.encode_single_token("[BOS]"), enc.encode_single_token("[EOS]"))
    if (config["bos_token_id"], config["eos_token_id"]) != want_ids:
        print("FAILED: config.json bos/eos %s, the tokenizer's [BOS]/[EOS] are %s" %
              ((config["bos_token_id"], config["eos_token_id"]), want_ids))
        return 1
    texts = SENTENCES + random_texts(args.random, args.seed)
    pairs = os.path.join(args.work_dir, "kimi-pairs")
    write_pair_vocab(model, pairs, texts, args.seed)

    print("tiktoken %s" % tiktoken.__version__)
    checked = failures = 0
    for model_dir in (model, pairs):
        c, f = check_model(tiktoken, tokenize, model_dir, texts, args.seed)
        checked += c
        failures += f
    print("%d passed, %d failed" % (checked - failures, failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
