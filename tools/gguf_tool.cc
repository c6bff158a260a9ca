// hmoe-gguf: looks into a GGUF model with our reader (the oracle test compares its answers with
// the `gguf` Python package; also handy by hand).
//
//   hmoe-gguf info PATH             JSON: metadata (arrays summarized by length and first
//                                   elements), tensors (name, ne, type, offset, file), the
//                                   ModelConfig read from the metadata (or the error), and
//                                   ValidateGgufTensors' verdict
//   hmoe-gguf dequant PATH OUT      every tensor dequantized to float32, concatenated in name
//                                   order (the order `info` lists), into the file OUT
//   hmoe-gguf dequant-raw TYPE IN OUT  the bytes of IN as blocks of ggml type id TYPE -> OUT
//   hmoe-gguf tokenize PATH TEXT    token ids of TEXT (with BOS) by the GGUF's tokenizer
//
// Exit status 0 on success, 1 with the error on stderr.

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"

#include "common/base/json.h"
#include "common/model/gguf.h"
#include "common/model/gguf_model.h"
#include "common/model/gguf_quants.h"

namespace hmoe {
namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "hmoe-gguf: %s\n", s.ToString().c_str());
  return 1;
}

json::Value ValueJson(const GgufValue& v, bool summarize) {
  switch (v.type) {
    case GgufValueType::kString:
      return json::Value::String(v.str);
    case GgufValueType::kBool:
      return json::Value::Bool(v.u != 0);
    case GgufValueType::kF32:
    case GgufValueType::kF64:
      return json::Value::Number(v.f);
    case GgufValueType::kArray: {
      json::Value items = json::Value::Array();
      const size_t n = summarize ? std::min<size_t>(v.array.size(), 8) : v.array.size();
      for (size_t i = 0; i < n; ++i) items.Append(ValueJson(v.array[i], summarize));
      return json::Value::Object(
          {{"array_type", json::Value::String(std::string(GgufValueTypeName(v.array_type)))},
           {"length", json::Value::Integer(static_cast<int64_t>(v.array.size()))},
           {"first", std::move(items)}});
    }
    default:
      if (v.AsInt()) return json::Value::Integer(*v.AsInt());
      return json::Value::Number(static_cast<double>(v.u));
  }
}

int Info(const std::string& path) {
  absl::StatusOr<std::unique_ptr<GgufModel>> model = GgufModel::Open(path);
  if (!model.ok()) return Fail(model.status());
  const GgufModel& m = **model;
  json::Value metadata = json::Value::Object();
  for (const auto& [key, value] : m.file(0).metadata()) {
    metadata.Set(key,
                 json::Value::Object(
                     {{"type", json::Value::String(std::string(GgufValueTypeName(value.type)))},
                      {"value", ValueJson(value, true)}}));
  }
  json::Value tensors = json::Value::Array();
  for (const GgufTensorInfo* t : m.Tensors()) {
    json::Value ne = json::Value::Array();
    for (int64_t d : t->ne) ne.Append(json::Value::Integer(d));
    tensors.Append(json::Value::Object({
        {"name", json::Value::String(t->name)},
        {"ne", std::move(ne)},
        {"type", json::Value::Integer(t->type)},
        {"type_name", json::Value::String(GgmlTypeName(t->type))},
        {"offset", json::Value::Integer(static_cast<int64_t>(t->offset))},
        {"file", json::Value::Integer(t->file_index)},
    }));
  }
  json::Value out = json::Value::Object({{"metadata", std::move(metadata)},
                                         {"tensors", std::move(tensors)},
                                         {"num_files", json::Value::Integer(m.num_files())}});
  absl::StatusOr<ModelConfig> config = ModelConfigFromGguf(m);
  if (config.ok()) {
    absl::StatusOr<json::Value> c = json::Parse(config->ToJson());
    out.Set("config", c.ok() ? *c : json::Value::Null());
    const absl::Status v = ValidateGgufTensors(*config, m);
    out.Set("tensors_valid", json::Value::String(v.ok() ? "ok" : std::string(v.message())));
  } else {
    out.Set("config_error", json::Value::String(std::string(config.status().message())));
  }
  std::printf("%s\n", json::Serialize(out, 1).c_str());
  return 0;
}

int Dequant(const std::string& path, const std::string& out_path) {
  absl::StatusOr<std::unique_ptr<GgufModel>> model = GgufModel::Open(path);
  if (!model.ok()) return Fail(model.status());
  std::ofstream out(out_path, std::ios::binary);
  for (const GgufTensorInfo* t : (*model)->Tensors()) {
    absl::StatusOr<std::vector<float>> v = (*model)->Dequantize(t->name);
    if (!v.ok()) return Fail(v.status());
    out.write(reinterpret_cast<const char*>(v->data()),
              static_cast<std::streamsize>(v->size() * sizeof(float)));
  }
  out.close();
  if (!out) return Fail(absl::InternalError("cannot write " + out_path));
  return 0;
}

int DequantRaw(const std::string& type_text, const std::string& in, const std::string& out_path) {
  uint32_t type = 0;
  if (!absl::SimpleAtoi(type_text, &type)) {
    return Fail(absl::InvalidArgumentError("bad type id " + type_text));
  }
  std::ifstream f(in, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::optional<GgmlTypeSize> ts = GgmlTypeSizeOf(type);
  if (!ts) return Fail(absl::InvalidArgumentError("unknown type " + type_text));
  const int64_t n = static_cast<int64_t>(bytes.size()) / ts->type_size * ts->block_size;
  std::vector<float> v(static_cast<size_t>(n));
  if (absl::Status s = DequantizeGgml(type, bytes.data(), n, v.data()); !s.ok()) return Fail(s);
  std::ofstream out(out_path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(v.data()),
            static_cast<std::streamsize>(v.size() * sizeof(float)));
  return out ? 0 : Fail(absl::InternalError("cannot write " + out_path));
}

int Tokenize(const std::string& path, const std::string& text) {
  absl::StatusOr<std::unique_ptr<GgufModel>> model = GgufModel::Open(path);
  if (!model.ok()) return Fail(model.status());
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = TokenizerFromGguf(**model);
  if (!tok.ok()) return Fail(tok.status());
  for (int32_t id : (*tok)->Encode(text, /*add_bos=*/true)) std::printf("%d ", id);
  std::printf("\n");
  return 0;
}

}  // namespace
}  // namespace hmoe

int main(int argc, char** argv) {
  const std::vector<std::string> a(argv + 1, argv + argc);
  if (a.size() == 2 && a[0] == "info") return hmoe::Info(a[1]);
  if (a.size() == 3 && a[0] == "dequant") return hmoe::Dequant(a[1], a[2]);
  if (a.size() == 4 && a[0] == "dequant-raw") return hmoe::DequantRaw(a[1], a[2], a[3]);
  if (a.size() == 3 && a[0] == "tokenize") return hmoe::Tokenize(a[1], a[2]);
  std::fprintf(stderr,
               "usage: hmoe-gguf info PATH | dequant PATH OUT | dequant-raw TYPE IN OUT | "
               "tokenize PATH TEXT\n");
  return 2;
}
