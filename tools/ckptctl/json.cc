#include "tools/ckptctl/json.h"

#include <google/protobuf/descriptor.h>

#include <cctype>
#include <string>

#include "tools/ckptctl/common.h"

namespace ckptctl {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

nlohmann::ordered_json Enum(const google::protobuf::EnumValueDescriptor* value) {
  if (value->type() == ckpt::v1::Level_descriptor())
    return LevelWord(static_cast<ckpt::v1::Level>(value->number()));
  if (value->type() == ckpt::v1::ShardState_descriptor())
    return StateWord(static_cast<ckpt::v1::ShardState>(value->number()));
  std::string word = value->name();  // other enums: their value's name, in lower case
  for (char& c : word) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return word;
}

// Field `f` of `m`; element `i` of a repeated field.
nlohmann::ordered_json Value(const Message& m, const FieldDescriptor* f, int i) {
  const Reflection* r = m.GetReflection();
  const bool rep = f->is_repeated();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return rep ? r->GetRepeatedInt32(m, f, i) : r->GetInt32(m, f);
    case FieldDescriptor::CPPTYPE_INT64:
      return rep ? r->GetRepeatedInt64(m, f, i) : r->GetInt64(m, f);
    case FieldDescriptor::CPPTYPE_UINT32:
      return rep ? r->GetRepeatedUInt32(m, f, i) : r->GetUInt32(m, f);
    case FieldDescriptor::CPPTYPE_UINT64:
      return rep ? r->GetRepeatedUInt64(m, f, i) : r->GetUInt64(m, f);
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return rep ? r->GetRepeatedDouble(m, f, i) : r->GetDouble(m, f);
    case FieldDescriptor::CPPTYPE_FLOAT:
      return rep ? r->GetRepeatedFloat(m, f, i) : r->GetFloat(m, f);
    case FieldDescriptor::CPPTYPE_BOOL:
      return rep ? r->GetRepeatedBool(m, f, i) : r->GetBool(m, f);
    case FieldDescriptor::CPPTYPE_STRING:
      return rep ? r->GetRepeatedString(m, f, i) : r->GetString(m, f);
    case FieldDescriptor::CPPTYPE_ENUM:
      return Enum(rep ? r->GetRepeatedEnum(m, f, i) : r->GetEnum(m, f));
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return ToJson(rep ? r->GetRepeatedMessage(m, f, i) : r->GetMessage(m, f));
  }
  return nullptr;
}

}  // namespace

nlohmann::ordered_json ToJson(const Message& m) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  const auto* d = m.GetDescriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    if (!f->is_repeated()) {
      out[f->name()] = Value(m, f, -1);
      continue;
    }
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (int k = 0; k < m.GetReflection()->FieldSize(m, f); ++k) list.push_back(Value(m, f, k));
    out[f->name()] = std::move(list);
  }
  return out;
}

}  // namespace ckptctl
