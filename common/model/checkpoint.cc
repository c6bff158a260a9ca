#include "common/model/checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <system_error>
#include <unordered_map>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

#include "common/base/json.h"
#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"

namespace hmoe {
namespace {

constexpr char kConfigFile[] = "config.json";
constexpr char kIndexFile[] = "model.safetensors.index.json";
constexpr char kSingleFile[] = "model.safetensors";

std::string JoinPath(const std::string& dir, std::string_view name) {
  if (dir.empty() || dir.back() == '/')
    return absl::StrCat(dir, absl::string_view(name.data(), name.size()));
  return absl::StrCat(dir, "/", absl::string_view(name.data(), name.size()));
}

bool IsRegularFile(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// A shard name from the (untrusted) index must be a plain file name inside the directory.
bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

// Names of the *.safetensors regular files directly in `dir`, sorted.
absl::StatusOr<std::vector<std::string>> ListSafetensors(const std::string& dir) {
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("list directory ", dir, ": ", ec.message()));
  }
  std::vector<std::string> names;
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) {
    if (ec) return absl::InternalError(absl::StrCat("list directory ", dir, ": ", ec.message()));
    const std::string name = it->path().filename().string();
    constexpr std::string_view kSuffix = ".safetensors";
    if (name.size() > kSuffix.size() && name.ends_with(kSuffix) &&
        IsRegularFile(JoinPath(dir, name))) {
      names.push_back(name);
    }
  }
  if (ec) return absl::InternalError(absl::StrCat("list directory ", dir, ": ", ec.message()));
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

absl::StatusOr<CheckpointIndex> ParseCheckpointIndex(std::string_view text) {
  absl::StatusOr<json::Value> index = json::Parse(text);
  if (!index.ok()) return absl::InvalidArgumentError(index.status().message());
  if (!index->is_object()) return absl::InvalidArgumentError("not a JSON object");
  const json::Value* weight_map = index->Find("weight_map");
  if (weight_map == nullptr || !weight_map->is_object()) {
    return absl::InvalidArgumentError("missing or non-object \"weight_map\"");
  }
  CheckpointIndex result;
  for (const auto& [tensor, shard] : weight_map->members()) {
    if (!shard.is_string() || !IsPlainFileName(shard.as_string())) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", tensor, "\": shard is not a file name in the directory"));
    }
    result.shard_names.push_back(shard.as_string());
  }
  std::sort(result.shard_names.begin(), result.shard_names.end());
  result.shard_names.erase(std::unique(result.shard_names.begin(), result.shard_names.end()),
                           result.shard_names.end());
  for (const auto& [tensor, shard] : weight_map->members()) {
    // A tensor listed twice: the last entry wins, as it did before.
    result.shard_of[tensor] = static_cast<size_t>(
        std::lower_bound(result.shard_names.begin(), result.shard_names.end(), shard.as_string()) -
        result.shard_names.begin());
  }
  return result;
}

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  std::unique_ptr<Checkpoint> ckpt(new Checkpoint());
  ckpt->dir_ = dir;
  const std::string context = absl::StrCat("checkpoint ", dir);

  // config.json
  const std::string config_path = JoinPath(dir, kConfigFile);
  absl::StatusOr<std::string> config_text = ReadFileToString(config_path);
  if (!config_text.ok()) {
    if (absl::IsNotFound(config_text.status())) {
      return absl::NotFoundError(absl::StrCat(context, ": missing ", kConfigFile));
    }
    return Annotate(config_text.status(), context);
  }
  ckpt->config_json_ = *std::move(config_text);
  absl::StatusOr<ModelConfig> config = ModelConfig::FromJson(ckpt->config_json_);
  if (!config.ok()) return Annotate(config.status(), context);
  ckpt->config_ = *std::move(config);

  const std::string index_path = JoinPath(dir, kIndexFile);
  if (IsRegularFile(index_path)) {
    // Sharded: the index's weight_map names the shard of every tensor.
    HMOE_ASSIGN_OR_RETURN(const std::string index_text, ReadFileToString(index_path));
    absl::StatusOr<CheckpointIndex> parsed = ParseCheckpointIndex(index_text);
    if (!parsed.ok()) {
      return absl::Status(parsed.status().code(),
                          absl::StrCat(index_path, ": ", parsed.status().message()));
    }
    const std::vector<std::string>& shard_names = parsed->shard_names;
    const std::map<std::string, size_t>& shard_of = parsed->shard_of;
    for (const std::string& name : shard_names) {
      const std::string shard_path = JoinPath(dir, name);
      absl::StatusOr<std::unique_ptr<SafetensorsFile>> shard = SafetensorsFile::Open(shard_path);
      if (!shard.ok()) {
        if (absl::IsNotFound(shard.status())) {
          return absl::NotFoundError(
              absl::StrCat(context, ": missing shard ", name, " (listed in ", kIndexFile, ")"));
        }
        return shard.status();
      }
      ckpt->shards_.push_back(*std::move(shard));
    }
    // No tensor may be in two shards; every tensor of a shard must be listed in the index for that
    // shard; every tensor of the index must be in its shard.
    std::unordered_map<std::string_view, size_t> found_in;  // tensor -> shard number
    found_in.reserve(shard_of.size());
    for (size_t s = 0; s < ckpt->shards_.size(); ++s) {
      for (const auto& [tensor, entry] : ckpt->shards_[s]->entries()) {
        const auto [it, inserted] = found_in.emplace(tensor, s);
        if (!inserted) {
          return absl::InvalidArgumentError(absl::StrCat(
              context, ": tensor \"", tensor,
              "\" is present in two shards: ", shard_names[it->second], " and ", shard_names[s]));
        }
        ckpt->index_.emplace(tensor, &entry);
      }
    }
    for (const auto& [tensor, entry] : ckpt->index_) {
      const size_t s = found_in.at(tensor);
      const auto listed = shard_of.find(tensor);
      if (listed == shard_of.end()) {
        return absl::InvalidArgumentError(absl::StrCat(context, ": tensor \"", tensor,
                                                       "\" in shard ", shard_names[s],
                                                       " is not listed in ", kIndexFile));
      }
      if (listed->second != s) {
        return absl::InvalidArgumentError(
            absl::StrCat(context, ": tensor \"", tensor, "\" is in shard ", shard_names[s], " but ",
                         kIndexFile, " lists it in shard ", shard_names[listed->second]));
      }
    }
    for (const auto& [tensor, s] : shard_of) {
      if (found_in.find(tensor) == found_in.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat(context, ": tensor \"", tensor, "\" is listed in ", kIndexFile,
                         " for shard ", shard_names[s], ", which does not contain it"));
      }
    }
    return ckpt;
  }

  // Unsharded: model.safetensors, or the only *.safetensors file.
  std::string single = JoinPath(dir, kSingleFile);
  if (!IsRegularFile(single)) {
    HMOE_ASSIGN_OR_RETURN(const std::vector<std::string> files, ListSafetensors(dir));
    if (files.empty()) {
      return absl::NotFoundError(absl::StrCat(context, ": no ", kIndexFile, ", ", kSingleFile,
                                              " or other *.safetensors file"));
    }
    if (files.size() > 1) {
      return absl::InvalidArgumentError(absl::StrCat(context, ": ", files.size(),
                                                     " *.safetensors files (", files[0], ", ",
                                                     files[1], ", ...) but no ", kIndexFile));
    }
    single = JoinPath(dir, files[0]);
  }
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(single));
  for (const auto& [tensor, entry] : file->entries()) ckpt->index_.emplace(tensor, &entry);
  ckpt->shards_.push_back(std::move(file));
  return ckpt;
}

absl::StatusOr<TensorView> Checkpoint::GetTensor(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::NotFoundError(
        absl::StrCat("tensor \"", name, "\" not found in checkpoint ", dir_));
  }
  return it->second->view;
}

std::vector<std::string> Checkpoint::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(index_.size());
  for (const auto& [name, entry] : index_) names.push_back(name);
  return names;
}

size_t Checkpoint::total_tensor_bytes() const {
  size_t total = 0;
  for (const auto& [name, entry] : index_) total += entry->view.size_bytes;
  return total;
}

}  // namespace hmoe
