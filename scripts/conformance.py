#!/usr/bin/env python3
"""Compares our FP32 reference forward pass with Hugging Face transformers' DeepSeek-V3 model.

Run by scripts/conformance.sh (which builds the tools, writes the tiny checkpoint and runs
hmoe-generate); usable on its own with torch, transformers and safetensors installed:

    python scripts/conformance.py --model DIR --prompt-ids 0,5,17,... \
        --ours-logits absorbed=FILE [--ours-logits naive=FILE2] \
        [--ours-continuation 12,7,...] [--ours-step-logits FILE3]

--ours-logits FILE: hmoe-generate --dump-logits output, raw little-endian float32
[num_prompt_tokens, vocab_size]. --ours-continuation: the ids hmoe-generate printed for
--max-new-tokens N (greedy). --ours-step-logits: hmoe-generate --print-logits stdout (the
"logits <step>: ..." lines, i.e. the logits each continuation token was chosen from, computed
incrementally with our KV cache).

What this script does on the Hugging Face side (nothing of ours is reused):
  * config.json -> DeepseekV3Config via DeepseekV3Config.from_dict (HF's own parsing, as
    from_pretrained does; transformers 4.x keeps `rope_scaling`, 5.x converts it to
    `rope_parameters`); quantization_config is dropped because the weights are dequantized
    here; attn_implementation / experts_implementation "eager", float32.
  * The effective YaRN settings HF ended up with are checked against config.json, and HF's
    rotary inv_freq, cos/sin attention factor and softmax scale against MODEL-SPEC.md §3.4/§3.6
    computed independently below.
  * Safetensors shards are read with the `safetensors` package. FP8 E4M3 weights are decoded
    with a 256-entry table built from the format definition (MODEL-SPEC §4.1; cross-checked with
    torch's float8_e4m3fn conversion) and multiplied by weight_scale_inv per 128x128 block,
    partial edge blocks included (§4.2). BF16 -> float32 is exact.
  * Per-expert tensors are fused into mlp.experts.gate_up_proj / down_proj when the installed
    transformers stores experts that way. load_state_dict(strict=True).

Figures (all prompt positions, all vocab entries; a = ours, b = HF):
  max_abs            = max |a - b|
  max_rel_row        = max over positions t of  max_v |a[t,v] - b[t,v]| / max_v |b[t,v]|
  max_rel_elem       = max |a - b| / (|b| + eps), eps = 1e-3 (logits are O(1)..O(10))
  top1_agreement     = fraction of positions whose arg-max ids agree
Sensitivity: the same comparison is repeated with a few one-line bugs switched on in the HF model
(rotate_half on the interleaved rope channels, no mscale^2 in the softmax scale, router bias
ignored, routed_scaling_factor ignored); each must exceed 100x the abs tolerance, so a pass cannot
come from a comparison that cannot fail.
Exit code 0 when every form passes the tolerance (--max-abs, --max-rel-row), top-1 agrees
everywhere, the continuation ids match and every sensitivity bug is detected; 1 otherwise; 2 for
a setup error.
"""

import argparse
import json
import math
import os
import re
import sys

import numpy as np
import torch
import transformers
from safetensors import safe_open
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

ELEM_EPS = 1e-3
BLOCK = 128


class SetupError(Exception):
    pass


# --------------------------------------------------------------------------------------- FP8


def fp8_e4m3fn_table():
    """The float value of every E4M3FN byte (MODEL-SPEC §4.1): bias 7, no infinities, NaN only
    for 0x7F/0xFF, subnormals (m/8)*2^-6."""
    table = np.zeros(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp = (code >> 3) & 0xF
        man = code & 0x7
        if exp == 0xF and man == 0x7:
            value = float("nan")
        elif exp == 0:
            value = sign * (man / 8.0) * 2.0**-6
        else:
            value = sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)
        table[code] = value
    return torch.from_numpy(table)


FP8_TABLE = fp8_e4m3fn_table()


def check_fp8_table():
    codes = torch.arange(256, dtype=torch.uint8)
    by_torch = codes.view(torch.float8_e4m3fn).to(torch.float32)
    same = (by_torch == FP8_TABLE) | (torch.isnan(by_torch) & torch.isnan(FP8_TABLE))
    if not bool(same.all()):
        bad = [int(c) for c in torch.nonzero(~same).flatten()]
        raise SetupError(f"FP8 table disagrees with torch.float8_e4m3fn for codes {bad}")
    assert FP8_TABLE[0x7E] == 448.0 and FP8_TABLE[0x38] == 1.0 and FP8_TABLE[0x01] == 2.0**-9


def dequantize_fp8(weight, scale_inv, name):
    """W[i, j] = fp8(W8[i, j]) * S[i // 128, j // 128] in float32 (MODEL-SPEC §4.2)."""
    if weight.dim() != 2:
        raise SetupError(f"{name}: FP8 weight of rank {weight.dim()}")
    rows, cols = weight.shape
    want = (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    if tuple(scale_inv.shape) != want:
        raise SetupError(f"{name}: weight_scale_inv shape {tuple(scale_inv.shape)}, want {want}")
    values = FP8_TABLE[weight.view(torch.uint8).to(torch.int64)]
    scale = scale_inv.to(torch.float32)
    scale = scale.repeat_interleave(BLOCK, dim=0)[:rows].repeat_interleave(BLOCK, dim=1)[:, :cols]
    return values * scale


def load_checkpoint(model_dir):
    """{name: float32 tensor} of every tensor of the checkpoint, FP8 weights dequantized."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        single = "model.safetensors"
        with safe_open(os.path.join(model_dir, single), framework="pt") as f:
            weight_map = {k: single for k in f.keys()}
    raw = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(os.path.join(model_dir, shard), framework="pt") as f:
            for name in f.keys():
                if weight_map.get(name) == shard:
                    raw[name] = f.get_tensor(name)
    if set(raw) != set(weight_map):
        raise SetupError(f"tensors missing from shards: {sorted(set(weight_map) - set(raw))[:5]}")

    tensors = {}
    num_fp8 = 0
    for name, t in raw.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale_name = name + "_scale_inv"
            if scale_name not in raw:
                raise SetupError(f"{name}: FP8 without {scale_name}")
            tensors[name] = dequantize_fp8(t, raw[scale_name], name)
            num_fp8 += 1
        elif t.dtype in (torch.bfloat16, torch.float16, torch.float32):
            tensors[name] = t.to(torch.float32)
        else:
            raise SetupError(f"{name}: unexpected dtype {t.dtype}")
    orphans = [n for n in raw if n.endswith("_scale_inv") and n[: -len("_scale_inv")] not in raw]
    if orphans:
        raise SetupError(f"scale without weight: {orphans[:5]}")
    return tensors, num_fp8


# --------------------------------------------------------------------------------------- config


def make_config(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    if raw.get("model_type") != "deepseek_v3":
        raise SetupError(f"model_type {raw.get('model_type')!r}, expected deepseek_v3")
    cfg_dict = dict(raw)
    cfg_dict.pop("quantization_config", None)  # weights are dequantized here
    cfg_dict.pop("torch_dtype", None)
    cfg_dict.pop("dtype", None)
    config = DeepseekV3Config.from_dict(cfg_dict)
    config._attn_implementation = "eager"
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"
    return raw, config


def effective_rope(config):
    """(rope_theta, yarn dict) as the installed transformers will use them."""
    params = getattr(config, "rope_parameters", None)
    if params:  # transformers >= 4.57 / 5.x
        params = dict(params)
        kind = params.get("rope_type", params.get("type"))
        return params.get("rope_theta", getattr(config, "rope_theta", None)), kind, params
    params = dict(getattr(config, "rope_scaling", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    return getattr(config, "rope_theta", None), kind, params


def yarn_reference(raw):
    """inv_freq, cos/sin factor and softmax scale from MODEL-SPEC §3.4/§3.6 (float64)."""
    dim = raw["qk_rope_head_dim"]
    base = float(raw["rope_theta"])
    rs = raw["rope_scaling"]
    factor = float(rs["factor"])
    l0 = float(rs["original_max_position_embeddings"])

    def corr(n_rot):
        return dim * math.log(l0 / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(rs.get("beta_fast", 32))), 0)
    high = min(math.ceil(corr(rs.get("beta_slow", 1))), dim - 1)
    if low == high:
        high += 0.001
    inv = []
    for i in range(dim // 2):
        extra = base ** (-2.0 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        keep = 1.0 - ramp
        inv.append(extra / factor * (1 - keep) + extra * keep)

    def g(s, m):
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    # transformers: attention_factor when given, else the ratio when mscale and mscale_all_dim are
    # both truthy, else g(factor, 1) (whatever the one present says).
    if rs.get("attention_factor") is not None:
        attn_factor = float(rs["attention_factor"])
    elif rs.get("mscale") and rs.get("mscale_all_dim"):
        attn_factor = g(factor, rs["mscale"]) / g(factor, rs["mscale_all_dim"])
    else:
        attn_factor = g(factor, 1.0)
    qk_head_dim = raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]
    m = g(factor, rs.get("mscale_all_dim", 0.0)) if rs.get("mscale_all_dim") else 1.0
    scale = qk_head_dim**-0.5 * m * m
    return np.array(inv), attn_factor, scale


def check_config(raw, config, model):
    """Fails when HF would not run the model config.json describes (MODEL-SPEC §3.4-3.9)."""
    problems = []
    theta, kind, params = effective_rope(config)
    rs = raw.get("rope_scaling") or {}
    if kind != "yarn":
        problems.append(f"HF rope type {kind!r}, config.json says yarn")
    if theta is None or float(theta) != float(raw["rope_theta"]):
        problems.append(f"HF rope_theta {theta}, config.json {raw['rope_theta']}")
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                "mscale_all_dim"):
        if key in rs and (params.get(key) is None or float(params[key]) != float(rs[key])):
            problems.append(f"HF rope {key} = {params.get(key)}, config.json {rs[key]}")
    if not getattr(config, "rope_interleave", False):
        problems.append("HF rope_interleave is not True (checkpoint rope channels are interleaved)")
    for key in ("n_group", "topk_group", "num_experts_per_tok", "n_routed_experts",
                "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace",
                "rms_norm_eps", "q_lora_rank", "kv_lora_rank", "n_shared_experts"):
        if key in raw and getattr(config, key) != raw[key]:
            problems.append(f"HF {key} = {getattr(config, key)}, config.json {raw[key]}")
    if raw.get("moe_layer_freq", 1) != 1:
        problems.append("moe_layer_freq != 1: HF makes every layer >= first_k_dense_replace MoE")

    inv_ref, factor_ref, scale_ref = yarn_reference(raw)
    rotary = model.model.rotary_emb
    inv_hf = rotary.inv_freq.double().numpy()
    if inv_hf.shape != inv_ref.shape or np.max(np.abs(inv_hf - inv_ref) / inv_ref) > 1e-6:
        problems.append(f"HF inv_freq {inv_hf} differs from MODEL-SPEC §3.4 {inv_ref}")
    if abs(rotary.attention_scaling - factor_ref) > 1e-9:
        problems.append(f"HF cos/sin factor {rotary.attention_scaling}, expected {factor_ref}")
    attn = model.model.layers[0].self_attn
    if abs(attn.scaling - scale_ref) > 1e-9 * scale_ref:
        problems.append(f"HF softmax scale {attn.scaling}, expected {scale_ref}")
    for layer in model.model.layers:
        for norm_name in ("q_a_layernorm", "kv_a_layernorm"):
            norm = getattr(layer.self_attn, norm_name, None)
            if norm is not None and norm.variance_epsilon != 1e-6:
                problems.append(f"HF {norm_name} eps {norm.variance_epsilon} (we use 1e-6)")
    if problems:
        raise SetupError("HF configuration mismatch:\n  " + "\n  ".join(problems))
    return {
        "rope_type": kind,
        "factor": params.get("factor"),
        "inv_freq[0:3]": [float(x) for x in inv_hf[:3]],
        "cos_sin_factor": rotary.attention_scaling,
        "softmax_scale": attn.scaling,
    }


# --------------------------------------------------------------------------------------- weights


def build_state_dict(tensors, model, config):
    """Checkpoint names -> the installed transformers' parameter names (fused experts if so)."""
    expected = model.state_dict()
    state = {}
    used = set()
    expert_re = re.compile(
        r"^(model\.layers\.(\d+)\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    fused = {}  # prefix -> {kind: {e: tensor}}
    for name, t in tensors.items():
        m = expert_re.match(name)
        if m and name not in expected:
            fused.setdefault(m.group(1), {}).setdefault(m.group(4), {})[int(m.group(3))] = t
            used.add(name)
            continue
        state[name] = t
    num_experts = config.n_routed_experts
    for prefix, kinds in fused.items():
        for kind in ("gate", "up", "down"):
            if sorted(kinds.get(kind, {})) != list(range(num_experts)):
                raise SetupError(f"{prefix}: incomplete {kind}_proj experts")
        if prefix + ".gate_up_proj" in expected:
            # [E, 2I, H]: gate rows then up rows (DeepseekV3Experts chunks gate first).
            state[prefix + ".gate_up_proj"] = torch.stack(
                [torch.cat([kinds["gate"][e], kinds["up"][e]], dim=0) for e in range(num_experts)])
            state[prefix + ".down_proj"] = torch.stack(
                [kinds["down"][e] for e in range(num_experts)])
        else:
            raise SetupError(f"{prefix}: transformers has neither per-expert nor fused expert "
                             f"parameters ({[k for k in expected if k.startswith(prefix)][:4]})")
    for key, value in state.items():
        if key in expected and tuple(expected[key].shape) != tuple(value.shape):
            raise SetupError(f"{key}: checkpoint shape {tuple(value.shape)}, HF wants "
                             f"{tuple(expected[key].shape)}")
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    return state, missing, unexpected, len(fused) > 0


# --------------------------------------------------------------------------------------- compare


def read_ours(path, num_tokens, vocab):
    data = np.fromfile(path, dtype="<f4")
    if data.size != num_tokens * vocab:
        raise SetupError(f"{path}: {data.size} floats, expected {num_tokens} x {vocab}")
    return data.reshape(num_tokens, vocab).astype(np.float64)


def read_step_logits(path, vocab):
    rows = []
    with open(path) as f:
        for line in f:
            if line.startswith("logits "):
                values = line.split(":", 1)[1].split()
                if len(values) != vocab:
                    raise SetupError(f"{path}: a logits line has {len(values)} values, not {vocab}")
                rows.append([float(v) for v in values])
    return np.array(rows, dtype=np.float64)


def compare(ours, ref):
    diff = np.abs(ours - ref)
    row_max_ref = np.max(np.abs(ref), axis=1)
    return {
        "max_abs": float(diff.max()),
        "mean_abs": float(diff.mean()),
        "max_rel_row": float(np.max(diff.max(axis=1) / row_max_ref)),
        "max_rel_elem": float(np.max(diff / (np.abs(ref) + ELEM_EPS))),
        "top1_agreement": float(np.mean(np.argmax(ours, axis=1) == np.argmax(ref, axis=1))),
        "max_abs_logit_hf": float(np.max(np.abs(ref))),
        "worst_position": int(np.argmax(diff.max(axis=1))),
    }


def sensitivity_check(model, prompt, ours):
    """The comparison must be able to fail: a few one-line bugs, applied to the HF model, each
    have to push the difference far beyond the tolerance. Returns {bug: max_abs}."""
    config = model.config
    layers = model.model.layers
    saved_scaling = [layer.self_attn.scaling for layer in layers]
    moe_gates = [layer.mlp.gate for layer in layers if hasattr(layer.mlp, "gate")]
    saved_bias = [g.e_score_correction_bias.clone() for g in moe_gates]

    def set_interleave(on):
        config.rope_interleave = on

    def set_mscale(on):
        for layer, scaling in zip(layers, saved_scaling):
            layer.self_attn.scaling = scaling if on else config.qk_head_dim**-0.5

    def set_bias(on):
        for gate, bias in zip(moe_gates, saved_bias):
            gate.e_score_correction_bias.copy_(bias if on else torch.zeros_like(bias))

    def set_scaling_factor(on):
        for gate in moe_gates:
            gate.routed_scaling_factor = config.routed_scaling_factor if on else 1.0

    bugs = {
        "rotate_half on interleaved rope channels": set_interleave,
        "softmax scale without mscale^2": set_mscale,
        "router bias ignored": set_bias,
        "routed_scaling_factor ignored": set_scaling_factor,
    }
    result = {}
    with torch.no_grad():
        for name, toggle in bugs.items():
            toggle(False)
            try:
                logits = model(torch.tensor([prompt])).logits[0].double().numpy()
            finally:
                toggle(True)
            result[name] = float(np.max(np.abs(ours - logits)))
    return result


def fmt(stats):
    return (f"max_abs={stats['max_abs']:.3e} mean_abs={stats['mean_abs']:.3e} "
            f"max_rel_row={stats['max_rel_row']:.3e} max_rel_elem={stats['max_rel_elem']:.3e} "
            f"top1_agreement={stats['top1_agreement'] * 100:.1f}% "
            f"(max |logit| {stats['max_abs_logit_hf']:.2f}, worst position "
            f"{stats['worst_position']})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-ids", required=True, help="comma-separated")
    parser.add_argument("--ours-logits", action="append", required=True, metavar="FORM=FILE",
                        help="hmoe-generate --dump-logits output, e.g. absorbed=/tmp/a.bin")
    parser.add_argument("--ours-continuation", default="", help="comma-separated greedy ids")
    parser.add_argument("--ours-step-logits", default="",
                        help="hmoe-generate --print-logits stdout")
    parser.add_argument("--max-abs", type=float, default=1e-3)
    parser.add_argument("--max-rel-row", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()

    torch.manual_seed(0)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"conformance: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"numpy {np.__version__}")
    check_fp8_table()

    raw, config = make_config(args.model)
    model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    tensors, num_fp8 = load_checkpoint(args.model)
    state, missing, unexpected, fused = build_state_dict(tensors, model, config)
    print(f"conformance: {len(tensors)} tensors ({num_fp8} FP8 dequantized), experts "
          f"{'fused into gate_up_proj/down_proj' if fused else 'per-expert'}; "
          f"missing keys: {missing or 'none'}; unexpected keys: {unexpected or 'none'}")
    if missing or unexpected:
        raise SetupError("state dict does not match the HF model")
    model.load_state_dict(state, strict=True)
    print(f"conformance: HF settings {check_config(raw, config, model)}")

    prompt = [int(x) for x in args.prompt_ids.split(",")]
    vocab = raw["vocab_size"]
    with torch.no_grad():
        hf_logits = model(torch.tensor([prompt])).logits[0].double().numpy()
    if not np.all(np.isfinite(hf_logits)):
        raise SetupError("HF logits are not finite")

    ok = True
    first_ours = None
    print(f"conformance: prompt of {len(prompt)} tokens, vocab {vocab}; tolerance max_abs < "
          f"{args.max_abs:g}, max_rel_row < {args.max_rel_row:g}, top-1 agreement 100%")
    for spec in args.ours_logits:
        form, _, path = spec.partition("=")
        ours = read_ours(path, len(prompt), vocab)
        if first_ours is None:
            first_ours = ours
        stats = compare(ours, hf_logits)
        passed = (stats["max_abs"] < args.max_abs and stats["max_rel_row"] < args.max_rel_row
                  and stats["top1_agreement"] == 1.0)
        ok = ok and passed
        print(f"conformance: prefill logits [{form}] vs HF: {fmt(stats)} -> "
              f"{'PASS' if passed else 'FAIL'}")

    if args.ours_continuation:
        ours_ids = [int(x) for x in args.ours_continuation.split(",")]
        # HF greedy continuation by full recomputation at every step (no KV cache), arg-max with
        # the lowest id on ties (torch.argmax returns the first maximum), no EOS stop.
        seq = list(prompt)
        step_rows = []
        with torch.no_grad():
            for _ in range(len(ours_ids)):
                last = model(torch.tensor([seq])).logits[0, -1].double()
                step_rows.append(last.numpy())
                seq.append(int(torch.argmax(last)))
        hf_ids = seq[len(prompt):]
        same = hf_ids == ours_ids
        ok = ok and same
        print(f"conformance: greedy continuation ({len(ours_ids)} tokens) "
              f"{'identical' if same else 'DIFFERS'}: ours {ours_ids}, HF {hf_ids}")
        if args.ours_step_logits and same:
            ours_steps = read_step_logits(args.ours_step_logits, vocab)
            if ours_steps.shape[0] != len(ours_ids):
                raise SetupError(f"{args.ours_step_logits}: {ours_steps.shape[0]} logits lines")
            stats = compare(ours_steps, np.array(step_rows))
            passed = stats["max_abs"] < args.max_abs and stats["max_rel_row"] < args.max_rel_row
            ok = ok and passed
            print(f"conformance: decode-step logits (our KV cache vs HF recompute): {fmt(stats)} "
                  f"-> {'PASS' if passed else 'FAIL'}")

    sensitivity = sensitivity_check(model, prompt, first_ours)
    for name, diff in sensitivity.items():
        detected = diff > 100 * args.max_abs
        ok = ok and detected
        print(f"conformance: sensitivity: with the bug \"{name}\" in HF, max_abs = {diff:.3g} "
              f"({'detected' if detected else 'NOT DETECTED: the comparison is too weak'})")

    print(f"conformance: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SetupError as e:
        print(f"conformance: error: {e}", file=sys.stderr)
        sys.exit(2)
