#!/usr/bin/env python3
"""Plants one known bug into a copy of the source tree (docs/conformance.md "Planted bugs").

    scripts/planted_bugs.py TREE BUG      # BUG: see BUGS below; TREE: a throw-away copy

Run by scripts/planted_bugs.sh, never on a working tree you keep: the patches are exact-text
replacements (an AssertionError names the anchor that no longer matches when the code moved).
Nothing here is part of the build or of the production path.
"""

import sys

BUGS = ["router-bias", "router-bias-ref", "block-scale", "block-scale-ref", "expert-scale",
        "rope-1000", "rope-1000-ref", "routed-scaling", "routed-scaling-ref", "mscale",
        "mscale-ref", "none"]
# Every file a patch below touches (the driver restores them between bugs).
FILES = ["common/engine/engine.cc", "common/engine/weights.cc", "common/ops/cpu/moe_executor.cc",
         "common/device/cpu_device.cc", "common/model/model_config.cc", "common/model/tensor.cc",
         "common/engine/reference/reference_ops.cc",
         "common/engine/reference/reference_model.cc"]
if sys.argv[1:] == ["--files"]:
    print("\n".join(FILES))
    sys.exit(0)
if len(sys.argv) != 3 or sys.argv[2] not in BUGS:
    sys.exit(f"usage: planted_bugs.py TREE BUG with BUG one of {', '.join(BUGS)}")
R = sys.argv[1].rstrip("/") + "/"
bug = sys.argv[2]
def patch(path, old, new):
    assert path in FILES, path
    s = open(R + path).read()
    assert s.count(old) == 1, (path, old)
    open(R + path, "w").write(s.replace(old, new))

def executor_patch(all_blocks, name):
    patch("common/ops/cpu/moe_executor.cc",
          """  return Fp8MatrixView::Dense(reinterpret_cast<const uint8_t*>(t.data),
                              reinterpret_cast<const float*>(s.data), rows, cols);""",
          """  if (t.name == "%s") {  // PLANTED BUG
    static std::vector<float> doubled;
    const float* src = reinterpret_cast<const float*>(s.data);
    doubled.assign(src, src + s.shape[0] * s.shape[1]);
    for (size_t i = 0; i < (%s ? doubled.size() : 1); ++i) doubled[i] *= 2.0f;
    return Fp8MatrixView::Dense(reinterpret_cast<const uint8_t*>(t.data), doubled.data(), rows, cols);
  }
  return Fp8MatrixView::Dense(reinterpret_cast<const uint8_t*>(t.data),
                              reinterpret_cast<const float*>(s.data), rows, cols);""" % (name, "true" if all_blocks else "false"))
if bug == "router-bias":
    patch("common/engine/engine.cc",
          "dev.MoeGate(st, x, hd, n, w.router, w.router_bias, k.gate,",
          "dev.MoeGate(st, x, hd, n, w.router, layer == 2 ? VectorWeight{} : w.router_bias, k.gate,")
elif bug == "block-scale":
    executor_patch(False, "model.layers.2.mlp.experts.5.up_proj.weight")
    patch("common/engine/weights.cc",
          "      lw.scale_inv = reinterpret_cast<const float*>(s.data);",
          """      lw.scale_inv = reinterpret_cast<const float*>(s.data);
      if (t.name == "model.layers.2.mlp.experts.5.up_proj.weight") {  // PLANTED BUG
        static std::vector<float> doubled;
        const float* src = reinterpret_cast<const float*>(s.data);
        doubled.assign(src, src + want[0] * want[1]);
        doubled[0] *= 2.0f;
        lw.scale_inv = doubled.data();
      }""")
elif bug == "rope-1000":
    patch("common/device/cpu_device.cc",
          "const double angle = static_cast<double>(positions[t]) * static_cast<double>(inv_freq[i]);",
          "const double angle = static_cast<double>(positions[t] >= 1000 ? positions[t] + 1 : positions[t]) * static_cast<double>(inv_freq[i]);")
elif bug == "routed-scaling":
    patch("common/engine/engine.cc",
          "k.gate.routed_scaling_factor = c.routed_scaling_factor;",
          "k.gate.routed_scaling_factor = 1.0;")
elif bug == "mscale":
    patch("common/model/model_config.cc",
          "  if (y.mscale != 0.0 && y.mscale_all_dim != 0.0) {",
          "  if (true) {  // PLANTED BUG: the old rule, mscale defaulting to 1\n    if (y.mscale == 0.0) return YarnScaleOf(y.factor, 1.0) / YarnScaleOf(y.factor, y.mscale_all_dim);")
elif bug == "block-scale-ref":
    patch("common/model/tensor.cc",
          "        out[i * cols + j] = table[codes[i * cols + j]] * s;",
          "        out[i * cols + j] = table[codes[i * cols + j]] * s *\n            ((t.name == \"model.layers.2.mlp.experts.5.up_proj.weight\" && i < 128 && jb == 0) ? 2.0f : 1.0f);  // PLANTED")
elif bug == "mscale-ref":
    patch("common/engine/reference/reference_ops.cc",
          "  if (!both) return YarnMscale(yarn.factor, 1.0);",
          "  (void)both;  // PLANTED: the old rule, mscale defaulting to 1\n  return YarnMscale(yarn.factor, yarn.mscale == 0.0 ? 1.0 : yarn.mscale) / YarnMscale(yarn.factor, yarn.mscale_all_dim);")
elif bug == "none":
    pass
elif bug == "expert-scale":
    executor_patch(True, "model.layers.2.mlp.experts.5.down_proj.weight")
    patch("common/engine/weights.cc",
          "      lw.scale_inv = reinterpret_cast<const float*>(s.data);",
          """      lw.scale_inv = reinterpret_cast<const float*>(s.data);
      if (t.name == "model.layers.2.mlp.experts.5.down_proj.weight") {  // PLANTED BUG
        static std::vector<float> doubled;
        const float* src = reinterpret_cast<const float*>(s.data);
        doubled.assign(src, src + want[0] * want[1]);
        for (float& x : doubled) x *= 2.0f;
        lw.scale_inv = doubled.data();
      }""")
elif bug == "rope-1000-ref":
    patch("common/engine/reference/reference_ops.cc",
          "    const double angle = static_cast<double>(pos) * static_cast<double>(inv_freq[i]);",
          "    const double angle = static_cast<double>(pos >= 1000 ? pos + 1 : pos) * static_cast<double>(inv_freq[i]);  // PLANTED")
elif bug == "router-bias-ref":
    patch("common/engine/reference/reference_model.cc",
          "  MoeGateResult gate = MoeGate(router_logits, layer.router_bias.data, gate_params_);",
          "  MoeGateResult gate = MoeGate(router_logits, layer_index == 2 ? std::span<const float>() : std::span<const float>(layer.router_bias.data), gate_params_);  // PLANTED")
elif bug == "routed-scaling-ref":
    patch("common/engine/reference/reference_ops.cc",
          "  p.routed_scaling_factor = config.routed_scaling_factor;",
          "  p.routed_scaling_factor = 1.0;  // PLANTED")
