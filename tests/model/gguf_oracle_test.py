#!/usr/bin/env python3
"""GGUF oracle (issue 18, acceptance 1): our reader and scalar dequantizer against llama.cpp's own
`gguf` Python package.

  1. Random blocks of every type we read (F32, F16, BF16, Q8_0, Q5_0, Q4_K, Q5_K, Q6_K): our
     dequantization (hmoe-gguf dequant-raw) equals gguf.quants.dequantize bit for bit. Scale
     fields are random finite fp16 values (NaN/inf scales are excluded: NaN payloads are not
     compared).
  2. Models written by hmoe-make-model --format gguf (tiny in every mix, both MLA layouts, split
     files; a cut-down small in q4_k_m): gguf.GGUFReader reads every file, its metadata and tensor
     infos (name, ne, type) equal what our reader reports, and every tensor's dequantization
     equals ours bit for bit.

The package comes from a venv in the build tree (pinned: gguf_oracle_requirements.txt), created on
demand. When pip cannot install it the test is skipped (exit 77) with the reason, except under CI
(CI=true), where that is a failure so the oracle always runs there.

usage: gguf_oracle_test.py --bin-dir BUILD/tools --work-dir DIR --venv DIR --requirements FILE
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

SKIP = 77


def ensure_venv(args):
    """Re-executes this script under the venv's python (tests/python/hmoe_venv.py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import hmoe_venv
    hmoe_venv.ensure_venv(args.venv, args.requirements, "the gguf package", "HMOE_GGUF_ORACLE_IN_VENV")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--venv", required=True)
    p.add_argument("--requirements", required=True)
    args = p.parse_args()
    ensure_venv(args)

    import numpy as np
    import gguf
    from gguf.quants import dequantize

    tool = os.path.join(args.bin_dir, "hmoe-gguf")
    make_model = os.path.join(args.bin_dir, "hmoe-make-model")
    shutil.rmtree(args.work_dir, ignore_errors=True)
    os.makedirs(args.work_dir)
    failures = []
    checks = 0

    def run(cmd):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), r.returncode, r.stderr))
        return r.stdout

    def same_bits(ours, ref, what):
        nonlocal checks
        checks += 1
        ref = np.ascontiguousarray(ref, dtype=np.float32).reshape(-1)
        if ours.size != ref.size:
            failures.append("%s: %d values, gguf has %d" % (what, ours.size, ref.size))
            return
        diff = np.nonzero(ours.view(np.uint32) != ref.view(np.uint32))[0]
        if diff.size:
            i = diff[0]
            failures.append("%s: %d of %d values differ, first at %d: ours %r, gguf %r" %
                            (what, diff.size, ours.size, i, ours[i], ref[i]))

    # 1. Random blocks.
    rng = np.random.default_rng(18)
    T = gguf.GGMLQuantizationType
    half_fields = {T.Q8_0: [0], T.Q5_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}

    def finite_f16(n):
        h = rng.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
        bad = (h & 0x7C00) == 0x7C00
        h[bad] &= np.uint16(0xBFFF)  # clear an exponent bit: finite
        return h

    for qtype in [T.F32, T.F16, T.BF16, T.Q8_0, T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K]:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_blocks = 4096 // block_size * 16
        raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint32).astype(np.uint8)
        if qtype == T.F16:
            raw = finite_f16(n_blocks).view(np.uint8).reshape(n_blocks, 2)
        elif qtype == T.BF16:
            b = rng.integers(0, 1 << 16, size=n_blocks, dtype=np.uint32).astype(np.uint16)
            b[(b & 0x7F80) == 0x7F80] &= np.uint16(0xFF7F)
            raw = b.view(np.uint8).reshape(n_blocks, 2)
        elif qtype == T.F32:
            f = rng.integers(0, 1 << 32, size=n_blocks, dtype=np.uint64).astype(np.uint32)
            f[(f & 0x7F800000) == 0x7F800000] &= np.uint32(0xFF7FFFFF)
            raw = f.view(np.uint8).reshape(n_blocks, 4)
        for off in half_fields.get(qtype, []):
            raw[:, off:off + 2] = finite_f16(n_blocks).view(np.uint8).reshape(n_blocks, 2)
        raw = np.ascontiguousarray(raw)
        src = os.path.join(args.work_dir, "blocks_%s.bin" % qtype.name)
        dst = src + ".f32"
        raw.tofile(src)
        run([tool, "dequant-raw", str(int(qtype)), src, dst])
        ours = np.fromfile(dst, dtype=np.float32)
        same_bits(ours, dequantize(raw, qtype), "random %s blocks" % qtype.name)

    # 2. Our generated models.
    models = [
        ("tiny-q4_k_m", ["--preset", "tiny", "--quant", "q4_k_m"]),
        ("tiny-q5_k_m-kv_b", ["--preset", "tiny", "--quant", "q5_k_m", "--gguf-kv-b"]),
        ("tiny-q8_0-split", ["--preset", "tiny", "--quant", "q8_0", "--gguf-split-mb", "1"]),
        ("tiny-bf16", ["--preset", "tiny", "--quant", "bf16", "--seed", "3"]),
        ("tiny-f16", ["--preset", "tiny", "--quant", "f16"]),
        ("small-q4_k_m", ["--preset", "small", "--quant", "q4_k_m", "--num-layers", "2",
                          "--experts", "8"]),
    ]
    for name, flags in models:
        out = os.path.join(args.work_dir, name)
        run([make_model, "--format", "gguf", "--out", out, "--threads", "2"] + flags)
        files = sorted(os.path.join(out, f) for f in os.listdir(out) if f.endswith(".gguf"))
        if not files:
            failures.append("%s: no .gguf written" % name)
            continue
        info = json.loads(run([tool, "info", files[0]]))
        if info.get("config_error") or info.get("tensors_valid") != "ok":
            failures.append("%s: our reader: %s / %s" %
                            (name, info.get("config_error"), info.get("tensors_valid")))
        if name.endswith("split") and len(files) < 2:
            failures.append("%s: expected several parts, got %d" % (name, len(files)))
        deq_path = os.path.join(args.work_dir, name + ".f32")
        run([tool, "dequant", files[0], deq_path])
        ours_all = np.fromfile(deq_path, dtype=np.float32)
        ref_tensors = {}
        ref_meta = {}
        for path in files:
            reader = gguf.GGUFReader(path)
            for t in reader.tensors:
                ref_tensors[t.name] = t
            if path == files[0]:
                for key, field in reader.fields.items():
                    if key.startswith("GGUF."):
                        continue
                    ref_meta[key] = field
        # Metadata of the first part (arrays: type, length and first elements).
        ours_meta = info["metadata"]
        if sorted(ref_meta) != sorted(ours_meta):
            failures.append("%s: metadata keys differ: only gguf %s, only ours %s" % (
                name, sorted(set(ref_meta) - set(ours_meta)), sorted(set(ours_meta) - set(ref_meta))))
        for key, field in ref_meta.items():
            if key not in ours_meta:
                continue
            checks += 1
            mine = ours_meta[key]
            vt = field.types[0]
            if vt == gguf.GGUFValueType.ARRAY:
                ref_values = field.contents()
                if mine["value"]["length"] != len(ref_values) or \
                        mine["value"]["first"] != list(ref_values[:8]):
                    failures.append("%s: array %s differs" % (name, key))
                continue
            ref_value = field.contents()
            if vt in (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64):
                ok = np.float32(ref_value) == np.float32(mine["value"])
            else:
                ok = ref_value == mine["value"]
            if not ok or mine["type"] != {
                    gguf.GGUFValueType.UINT8: "u8", gguf.GGUFValueType.INT8: "i8",
                    gguf.GGUFValueType.UINT16: "u16", gguf.GGUFValueType.INT16: "i16",
                    gguf.GGUFValueType.UINT32: "u32", gguf.GGUFValueType.INT32: "i32",
                    gguf.GGUFValueType.FLOAT32: "f32", gguf.GGUFValueType.BOOL: "bool",
                    gguf.GGUFValueType.STRING: "string", gguf.GGUFValueType.UINT64: "u64",
                    gguf.GGUFValueType.INT64: "i64", gguf.GGUFValueType.FLOAT64: "f64"}[vt]:
                failures.append("%s: %s: gguf reads %r (%s), ours %r" %
                                (name, key, ref_value, vt.name, mine))
        # Tensors, in our name order (the order of the dequant output).
        if sorted(ref_tensors) != [t["name"] for t in info["tensors"]]:
            failures.append("%s: tensor names differ" % name)
            continue
        pos = 0
        for t in info["tensors"]:
            ref = ref_tensors[t["name"]]
            checks += 1
            if [int(x) for x in ref.shape] != t["ne"] or int(ref.tensor_type) != t["type"]:
                failures.append("%s: %s: gguf reads ne %s type %s, ours ne %s type %s" % (
                    name, t["name"], list(ref.shape), ref.tensor_type.name, t["ne"],
                    t["type_name"]))
                continue
            n = int(np.prod(t["ne"]))
            same_bits(ours_all[pos:pos + n], dequantize(ref.data, ref.tensor_type),
                      "%s: %s (%s)" % (name, t["name"], t["type_name"]))
            pos += n
        print("%s: %d files, %d tensors, %d metadata keys compared" %
              (name, len(files), len(info["tensors"]), len(ref_meta)))

    for f in failures[:40]:
        print("MISMATCH: " + f)
    print("gguf oracle: %d checks, %d failures (gguf %s, numpy %s)" %
          (checks, len(failures), getattr(gguf, "__version__", "?"), np.__version__))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
