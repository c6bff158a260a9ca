#!/usr/bin/env python3
"""Writes the golden logits of tests/data/golden from Hugging Face transformers (FP32).

Run by `scripts/conformance.sh --golden` (which builds hmoe-make-model and provides the pinned
virtual environment); see docs/conformance.md "Golden logits from transformers".

For every configuration of tests/data/golden/configs.json: hmoe-make-model writes the checkpoint
(FP8, the configuration's preset, seed and --config-override), this script dequantizes it and
loads it into transformers' DeepseekV3ForCausalLM (float32, eager; scripts/conformance.py's
loader, nothing of ours), runs the prompt once and writes NAME.json.gz with
  * what regenerates the checkpoint (preset, seed, dtype, override) and an FNV-1a 64 hash of every
    file hmoe-make-model wrote that the model reads (config.json and the safetensors shards), so
    the test knows it runs the very same weights;
  * the prompt ids, the package versions, HF's cos/sin factor and softmax scale;
  * per prompt position the top-K logits (ids and values, HF's order) and the logsumexp of the
    row; full logit rows at a few positions (first, middle, last, and around 1,000 for long
    prompts).
"""

import argparse
import gzip
import json
import math
import os
import platform
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DeepseekV3ForCausalLM  # noqa: E402

import conformance  # noqa: E402

TOP_K = 8
FORMAT = "hmoe-golden-logits-1"


def fnv1a64(data):
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def file_hashes(model_dir):
    out = {}
    for name in sorted(os.listdir(model_dir)):
        if name == "config.json" or name.endswith(".safetensors"):
            with open(os.path.join(model_dir, name), "rb") as f:
                out[name] = f"{fnv1a64(f.read()):016x}"
    return out


def prompt_ids(count, seed, vocab):
    """BOS (0) then ids in [2, 2 + span) from the 31-bit LCG of scripts/conformance.sh."""
    span = min(1000, vocab - 2)
    ids, x = [0], seed
    while len(ids) < count:
        x = (x * 1103515245 + 12345) % 2147483648
        ids.append(2 + (x >> 8) % span)
    return ids


def full_positions(n):
    pos = {0, 1, n // 2, n - 2, n - 1}
    if n > 1060:
        pos |= {998, 999, 1000, 1001, 1024, 1050, n - 40}
    return sorted(p for p in pos if 0 <= p < n)


def golden_for(entry, make_model, work):
    name = entry["name"]
    out_dir = os.path.join(work, name)
    override_path = os.path.join(work, f"{name}.override.json")
    with open(override_path, "w") as f:
        json.dump(entry["config_override"], f)
    cmd = [make_model, "--preset", entry["preset"], "--seed", str(entry["seed"]), "--dtype", "fp8",
           "--config-override", override_path, "--out", out_dir, "--force", "--threads", "2"]
    subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)

    raw, config = conformance.make_config(out_dir)
    model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    tensors, _ = conformance.load_checkpoint(out_dir)
    state, missing, unexpected, _ = conformance.build_state_dict(tensors, model, config)
    if missing or unexpected:
        raise conformance.SetupError(f"{name}: missing {missing}, unexpected {unexpected}")
    model.load_state_dict(state, strict=True)

    vocab = raw["vocab_size"]
    prompt = prompt_ids(entry["prompt_tokens"], entry["prompt_seed"], vocab)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].to(torch.float32)
    if not torch.all(torch.isfinite(logits)):
        raise conformance.SetupError(f"{name}: HF logits are not finite")
    values, ids = torch.topk(logits, TOP_K, dim=-1)
    lse = torch.logsumexp(logits.double(), dim=-1)
    positions = full_positions(len(prompt))
    f9 = lambda v: float(f"{float(v):.9g}")  # noqa: E731  (float32 round-trips in 9 digits)
    attn = model.model.layers[0].self_attn
    golden = {
        "format": FORMAT,
        "name": name,
        "generator": "scripts/conformance.sh --golden (scripts/conformance_golden.py)",
        "checkpoint": {"tool": "hmoe-make-model", "preset": entry["preset"],
                       "seed": entry["seed"], "dtype": "fp8",
                       "config_override": entry["config_override"],
                       "fnv1a64": file_hashes(out_dir)},
        "config": raw,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "safetensors": safetensors.__version__, "numpy": np.__version__,
                     "python": platform.python_version()},
        "hf": {"cos_sin_factor": float(model.model.rotary_emb.attention_scaling),
               "softmax_scale": float(attn.scaling),
               "rope_type": config.rope_parameters.get("rope_type")
               if getattr(config, "rope_parameters", None) else "default"},
        "vocab_size": vocab,
        "prompt_ids": prompt,
        "top_k": TOP_K,
        "topk_ids": ids.tolist(),
        "topk_logits": [[f9(v) for v in row] for row in values.tolist()],
        "logsumexp": [f9(v) for v in lse.tolist()],
        "full_positions": positions,
        "full_logits": [[f9(v) for v in logits[p].tolist()] for p in positions],
    }
    return golden


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--make-model", required=True, help="the hmoe-make-model binary")
    parser.add_argument("--configs", required=True, help="tests/data/golden/configs.json")
    parser.add_argument("--out-dir", required=True, help="where NAME.json.gz go")
    parser.add_argument("--work", required=True, help="scratch directory for the checkpoints")
    parser.add_argument("--only", default="", help="comma-separated names (default: all)")
    args = parser.parse_args()
    torch.manual_seed(0)
    conformance.check_fp8_table()
    with open(args.configs) as f:
        configs = json.load(f)["configs"]
    only = set(filter(None, args.only.split(",")))
    for entry in configs:
        if only and entry["name"] not in only:
            continue
        golden = golden_for(entry, args.make_model, args.work)
        path = os.path.join(args.out_dir, f"{entry['name']}.json.gz")
        text = json.dumps(golden, separators=(",", ":")).encode()
        with open(path, "wb") as raw_file:
            # mtime 0 and no file name: the same logits give the same bytes.
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw_file, mtime=0,
                               compresslevel=9) as f:
                f.write(text)
        print(f"golden: {entry['name']}: {len(golden['prompt_ids'])} tokens, vocab "
              f"{golden['vocab_size']}, HF cos/sin factor {golden['hf']['cos_sin_factor']:.9g}, "
              f"softmax scale {golden['hf']['softmax_scale']:.9g} -> {path} "
              f"({os.path.getsize(path)} bytes)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except conformance.SetupError as e:
        print(f"golden: error: {e}", file=sys.stderr)
        sys.exit(2)
