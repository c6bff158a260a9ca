#!/usr/bin/env python3
"""Greedy-token agreement with the FP32 reference, teacher-forced (the rule of the agreement
tests, tests/decode_worker/decode_test_util.h): the reference's logits over prompt + generated
tokens (hmoe-generate --dump-logits: raw float32 [positions, vocab]) decide, at each generated
position, whether the served token is the reference's argmax or within TOLERANCE logits of it (a
near-tie that BF16 activations may resolve the other way).

  token_agreement.py LOGITS VOCAB PROMPT_LEN TOKENS TOLERANCE
TOKENS: the served tokens, comma- or space-separated. Exit 0 when every step agrees.
"""
import array
import sys


def main() -> int:
    path, vocab, prompt_len, tokens, tol = sys.argv[1:6]
    vocab, prompt_len, tol = int(vocab), int(prompt_len), float(tol)
    toks = [int(t) for t in tokens.replace(",", " ").split()]
    logits = array.array("f")
    with open(path, "rb") as f:
        logits.frombytes(f.read())
    rows = len(logits) // vocab
    exact = 0
    worst = 0.0
    bad = []
    for j, tok in enumerate(toks):
        r = prompt_len - 1 + j
        if r >= rows:
            print(f"only {rows} logit rows for {len(toks)} tokens after a {prompt_len}-token prompt")
            return 2
        row = logits[r * vocab:(r + 1) * vocab]
        best = max(range(vocab), key=row.__getitem__)
        if best == tok:
            exact += 1
            continue
        margin = row[best] - row[tok]
        worst = max(worst, margin)
        if margin > tol:
            bad.append(f"step {j}: token {tok} vs reference {best} (margin {margin:.3f})")
    verdict = "AGREE" if not bad else "DIFFER"
    print(f"{verdict}: {exact}/{len(toks)} steps the reference's argmax, worst margin "
          f"{worst:.3f} (tolerance {tol}){'; ' + '; '.join(bad) if bad else ''}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
