// Unit tests of the Jinja engine, one group per construct (docs/chat_templates.md). Expected
// strings are what Python's jinja2 3.1 renders with trim_blocks and lstrip_blocks and
// transformers' tojson (checked with /usr/bin/python3 when written).
#include "common/chat/jinja.h"

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace hmoe::jinja {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::ordered_json;

std::string R(const std::string& source, const json& context = json::object()) {
  auto t = Template::Parse(source);
  if (!t.ok()) return "PARSE ERROR: " + t.status().ToString();
  auto r = t->Render(context);
  if (!r.ok()) return "RENDER ERROR: " + std::string(r.status().message());
  return *r;
}

absl::Status ParseError(const std::string& source) { return Template::Parse(source).status(); }

TEST(JinjaText, PlainTextCommentsAndTrailingNewline) {
  EXPECT_EQ(R("hello"), "hello");
  EXPECT_EQ(R("a{# note #}b"), "ab");
  EXPECT_EQ(R("line\n"), "line");      // keep_trailing_newline=False drops one final newline.
  EXPECT_EQ(R("line\n\n"), "line\n");  // ... only one.
  EXPECT_EQ(R("a\r\nb\rc"), "a\nb\nc");
  EXPECT_EQ(R("{ not a tag }"), "{ not a tag }");
}

TEST(JinjaWhitespace, DashStripsAllWhitespace) {
  EXPECT_EQ(R("a  \n {{- 'x' -}} \n  b"), "axb");
  EXPECT_EQ(R("a \n{%- if true -%}\n x {%- endif %}"), "ax");
  EXPECT_EQ(R("a \u3000{{- 'x' }}"), "ax");  // Python's str.rstrip: Unicode whitespace too.
}

TEST(JinjaWhitespace, TrimBlocksAndLstripBlocks) {
  EXPECT_EQ(R("{% if true %}\nyes\n{% endif %}\nafter"), "yes\nafter");
  EXPECT_EQ(R("  {% if true %}\n  x\n  {% endif %}\n"), "  x\n");
  EXPECT_EQ(R("{{ 'v' }}\nnext"), "v\nnext");            // trim_blocks does not apply to {{ }}.
  EXPECT_EQ(R("a  {% if true %}b{% endif %}"), "a  b");  // lstrip only at the line start.
  EXPECT_EQ(R("  {#- c #}\nx"), "x");
  EXPECT_EQ(R("  {# c #}\nx"), "x");
}

TEST(JinjaWhitespace, PlusDisablesLstripAndTrim) {
  EXPECT_EQ(R("  {%+ if true %}x{% endif +%}\ny"), "  x\ny");
}

TEST(JinjaOutput, PrintsValuesAsPythonStr) {
  EXPECT_EQ(R("{{ none }}|{{ true }}|{{ False }}|{{ 42 }}|{{ -3 }}"), "None|True|False|42|-3");
  EXPECT_EQ(R("{{ 1.0 }}|{{ 0.1 }}|{{ 1e-5 }}|{{ 1e16 }}|{{ 2.5e15 }}"),
            "1.0|0.1|1e-05|1e+16|2500000000000000.0");
  EXPECT_EQ(R("{{ [1, 'a', none] }}|{{ (1,) }}|{{ {'k': true} }}"),
            "[1, 'a', None]|(1,)|{'k': True}");
  EXPECT_EQ(R("{{ [\"it's\"] }}"), "[\"it's\"]");
  EXPECT_EQ(R("[{{ missing }}]"), "[]");
  EXPECT_THAT(R("{{ ['é'] }}"), HasSubstr("non-ASCII"));  // Refused, not approximated.
}

TEST(JinjaLiterals, StringsAndEscapes) {
  EXPECT_EQ(R(R"({{ 'a\nb' }}|{{ "q\"q" }}|{{ 'x' 'y' }}|{{ '\u00e9' }}|{{ '\d' }})"),
            "a\nb|q\"q|xy|é|\\d");
  EXPECT_THAT(ParseError("{{ 'open }}").message(), HasSubstr("line 1: unterminated string"));
}

TEST(JinjaSet, AssignmentUnpackingBlockAndNamespace) {
  EXPECT_EQ(R("{% set x = 1 + 2 %}{{ x }}"), "3");
  EXPECT_EQ(R("{% set a, b = [1, 2] %}{{ b }}{{ a }}"), "21");
  EXPECT_EQ(R("{% set t = 1, 2 %}{{ t }}"), "(1, 2)");
  EXPECT_EQ(R("{% set block %}in {{ 'side' }}{% endset %}[{{ block }}]"), "[in side]");
  EXPECT_EQ(R("{% set ns = namespace(n=0, s='') %}{% for i in [1, 2, 3] %}{% set ns.n = ns.n + i "
              "%}{% endfor %}{{ ns.n }}"),
            "6");
  // A namespace holding itself renders (and, under ASan, does not leak).
  EXPECT_EQ(R("{% set ns = namespace(a=1) %}{% set ns.me = ns %}{{ ns.me.me.a }}"), "1");
  EXPECT_THAT(R("{% set d = {} %}{% set d.x = 1 %}"),
              HasSubstr("line 1: cannot assign attribute on non-namespace object"));
}

TEST(JinjaFor, LoopVariables) {
  EXPECT_EQ(R("{% for x in 'abc' %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}"
              "{{ loop.length }}{{ loop.first }}{{ loop.last }};{% endfor %}"),
            "1033TrueFalse;2123FalseFalse;3213FalseTrue;");
  EXPECT_EQ(R("{% for x in [1, 2] %}{{ loop.previtem }}-{{ loop.nextitem }};{% endfor %}"),
            "-2;1-;");
}

TEST(JinjaFor, ElseFilterBreakContinue) {
  EXPECT_EQ(R("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(R("{% for x in [1, 2, 3, 4] if x % 2 == 0 %}{{ x }}{{ loop.length }}{% endfor %}"),
            "2242");
  EXPECT_EQ(R("{% for x in [1, 2, 3, 4] %}{% if x == 2 %}{% continue %}{% endif %}"
              "{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}"),
            "13");
  EXPECT_EQ(R("{% for x in missing %}x{% else %}none{% endfor %}"), "none");
}

TEST(JinjaFor, ScopingAndDicts) {
  // A set inside a loop body is local to the iteration (jinja2 scoping).
  EXPECT_EQ(R("{% set x = 0 %}{% for i in [1, 2] %}{% set x = x + i %}{{ x }}{% endfor %}{{ x }}"),
            "120");
  EXPECT_EQ(R("{% for k in d %}{{ k }}{% endfor %}|{% for k, v in d.items() %}{{ k }}={{ v }};"
              "{% endfor %}",
              {{"d", {{"b", 1}, {"a", 2}}}}),
            "ba|b=1;a=2;");
}

TEST(JinjaIf, ElifElse) {
  const std::string t = "{% if x == 1 %}one{% elif x == 2 %}two{% else %}many{% endif %}";
  EXPECT_EQ(R(t, {{"x", 1}}), "one");
  EXPECT_EQ(R(t, {{"x", 2}}), "two");
  EXPECT_EQ(R(t, {{"x", 3}}), "many");
  EXPECT_THAT(ParseError("{% if x %}a{% else %}b{% elif y %}c{% endif %}").message(),
              HasSubstr("line 1"));
}

TEST(JinjaTests, AllTestsAndTheirNotForms) {
  const json ctx = {{"s", "x"},           {"n", nullptr},        {"i", 1},   {"f", 1.5},
                    {"l", json::array()}, {"d", json::object()}, {"b", true}};
  EXPECT_EQ(
      R("{{ s is defined }}{{ u is defined }}{{ u is undefined }}{{ u is not defined }}", ctx),
      "TrueFalseTrueTrue");
  EXPECT_EQ(R("{{ n is none }}{{ s is none }}{{ n is not none }}", ctx), "TrueFalseFalse");
  EXPECT_EQ(R("{{ s is string }}{{ i is string }}{{ i is not string }}", ctx), "TrueFalseTrue");
  EXPECT_EQ(R("{{ d is mapping }}{{ l is mapping }}{{ l is not mapping }}", ctx), "TrueFalseTrue");
  EXPECT_EQ(R("{{ l is iterable }}{{ s is iterable }}{{ i is iterable }}{{ u is iterable }}", ctx),
            "TrueTrueFalseTrue");
  EXPECT_EQ(R("{{ i is number }}{{ f is number }}{{ b is number }}{{ s is number }}", ctx),
            "TrueTrueTrueFalse");
  EXPECT_EQ(R("{{ l is sequence }}{{ b is boolean }}{{ b is true }}{{ b is false }}", ctx),
            "TrueTrueTrueFalse");
  EXPECT_EQ(R("{{ i is integer }}{{ f is float }}{{ b is integer }}", ctx), "TrueTrueFalse");
  // `not` binds looser than `is`.
  EXPECT_EQ(R("{{ not u is defined }}{{ not s is defined }}", ctx), "TrueFalse");
}

TEST(JinjaOperators, LogicComparisonsMembership) {
  EXPECT_EQ(R("{{ 1 and 'x' }}|{{ 0 or 'y' }}|{{ not 0 }}|{{ '' or [] }}"), "x|y|True|[]");
  EXPECT_EQ(R("{{ 1 < 2 < 3 }}{{ 3 > 2 > 2 }}{{ 1 == 1.0 }}{{ 'a' != 'b' }}{{ 2 >= 2 }}"),
            "TrueFalseTrueTrueTrue");
  EXPECT_EQ(R("{{ 'b' in 'abc' }}{{ 2 in [1, 2] }}{{ 'k' in {'k': 1} }}{{ 3 not in [3] }}"),
            "TrueTrueTrueFalse");
  EXPECT_EQ(R("{{ 'x' in missing }}"), "False");
  EXPECT_THAT(R("{{ 1 in 'abc' }}"), HasSubstr("requires string as left operand"));
  EXPECT_THAT(R("{{ 1 < 'a' }}"), HasSubstr("not supported between"));
}

TEST(JinjaOperators, ArithmeticConcatAndConditional) {
  EXPECT_EQ(R("{{ 'a' + 'b' }}|{{ [1] + [2] }}|{{ 7 // 2 }}|{{ -7 // 2 }}|{{ -7 % 3 }}|{{ 7 / 2 "
              "}}|{{ 2 ** 10 }}|{{ 'ab' * 2 }}"),
            "ab|[1, 2]|3|-4|2|3.5|1024|abab");
  EXPECT_EQ(R("{{ 1 ~ 'x' ~ none ~ missing }}|{{ (1 + 2) ~ 3 }}"), "1xNone|33");
  // `~` binds tighter than `+` (jinja2's grammar): this is 1 + '23'.
  EXPECT_THAT(R("{{ 1 + 2 ~ 3 }}"), HasSubstr("unsupported operand type(s) for +"));
  EXPECT_THAT(R("{{ 9223372036854775807 + 1 }}"), HasSubstr("integer overflow"));
  EXPECT_THAT(R("{{ 3 ** 99 }}"), HasSubstr("integer overflow"));
  EXPECT_THAT(R("{{ 'ab' * 100000000 }}"), HasSubstr("too large"));
  EXPECT_EQ(R("{{ (-1) ** 5 }}{{ 0 ** 0 }}{{ 2 ** 62 }}"), "-114611686018427387904");
  EXPECT_EQ(R("{{ 'y' if 1 else 'n' }}{{ 'y' if 0 else 'n' }}[{{ 'y' if 0 }}]"), "yn[]");
  EXPECT_THAT(R("\n{{ 'a' + 1 }}"), HasSubstr("line 2: unsupported operand type(s) for +"));
  EXPECT_THAT(R("{{ missing + 'a' }}"), HasSubstr("'missing' is undefined"));
}

TEST(JinjaAccess, SubscriptsAttributesSlices) {
  const json ctx = {
      {"m", {{"role", "user"}, {"items", "key"}}}, {"l", {10, 20, 30, 40}}, {"s", "héllo wörld"}};
  EXPECT_EQ(R("{{ m['role'] }}{{ m.role }}{{ m['items'] }}", ctx), "useruserkey");
  EXPECT_EQ(R("{{ l[0] }}{{ l[-1] }}[{{ l[9] }}]{{ l.1 }}", ctx), "1040[]20");
  EXPECT_EQ(R("{{ l[1:] }}{{ l[:-2] }}{{ l[::-1] }}{{ l[::2] }}", ctx),
            "[20, 30, 40][10, 20][40, 30, 20, 10][10, 30]");
  EXPECT_EQ(R("{{ s[1:5] }}|{{ s[-5:] }}|{{ s[1] }}|{{ s[::-1] }}", ctx),
            "éllo|wörld|é|dlröw olléh");
  EXPECT_EQ(R("[{{ m.missing }}]{{ m.missing is defined }}", ctx), "[]False");
  EXPECT_THAT(R("{{ m.missing.deeper }}", ctx), HasSubstr("has no attribute 'missing'"));
  EXPECT_THAT(R("{{ nothing['x'] }}", ctx), HasSubstr("'nothing' is undefined"));
}

TEST(JinjaStringMethods, SplitStripStartswithReplaceCase) {
  EXPECT_EQ(R("{{ 'a</think>b</think>c'.split('</think>') }}"), "['a', 'b', 'c']");
  EXPECT_EQ(R("{{ 'a,b,c'.split(',', 1) }}|{{ '  a  b '.split() }}|{{ ' a b c '.split(none, 1) }}"),
            "['a', 'b,c']|['a', 'b']|['a', 'b c ']");
  EXPECT_EQ(R("[{{ ' \u3000x\t '.strip() }}][{{ 'xxaxx'.strip('x') }}][{{ '  a '.lstrip() }}]"
              "[{{ '  a '.rstrip() }}]"),
            "[x][a][a ][  a]");
  EXPECT_EQ(R("{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith(('x', 'bc')) }}{{ 'a'.endswith('ba') "
              "}}"),
            "TrueTrueFalse");
  EXPECT_EQ(R("{{ 'aaa'.replace('a', 'b') }}{{ 'aaa'.replace('a', 'b', 2) }}"), "bbbbba");
  EXPECT_EQ(R("{{ 'MiXed'.lower() }}{{ 'MiXed'.upper() }}"), "mixedMIXED");
  EXPECT_THAT(R("{{ 'É'.lower() }}"), HasSubstr("non-ASCII"));
  EXPECT_EQ(R("{{ d.get('a') }}{{ d.get('z') }}{{ d.get('z', 5) }}{{ d.keys() | list }}",
              {{"d", {{"a", 1}}}}),
            "1None5['a']");
}

TEST(JinjaFilters, Tojson) {
  const json ctx = {{"v", {{"b", "<&'>é"}, {"a", {1, 2.5, nullptr, true}}, {"c", json::object()}}}};
  // transformers' tojson: json.dumps, keys in order, no HTML escaping, ensure_ascii=False.
  EXPECT_EQ(R("{{ v | tojson }}", ctx), R"({"b": "<&'>é", "a": [1, 2.5, null, true], "c": {}})");
  EXPECT_EQ(R("{{ v | tojson(ensure_ascii=True) }}", ctx),
            R"({"b": "<&'>\u00e9", "a": [1, 2.5, null, true], "c": {}})");
  EXPECT_EQ(R("{{ v | tojson(separators=(',', ':'), sort_keys=true) }}", ctx),
            R"({"a":[1,2.5,null,true],"b":"<&'>é","c":{}})");
  EXPECT_EQ(R("{{ v.a | tojson(indent=2) }}", ctx), "[\n  1,\n  2.5,\n  null,\n  true\n]");
  EXPECT_EQ(R("{{ '\x01\n\"\\\\😀' | tojson(ensure_ascii=true) }}"),
            R"("\u0001\n\"\\\ud83d\ude00")");
  EXPECT_EQ(R("{{ [1e16, 1e-05, 100.0, -0.0, 123456789.125] | tojson }}"),
            "[1e+16, 1e-05, 100.0, -0.0, 123456789.125]");
  EXPECT_THAT(R("{{ missing | tojson }}"), HasSubstr("not JSON serializable"));
  EXPECT_THAT(R("{{ v | tojson(bogus=1) }}", ctx), HasSubstr("unexpected keyword argument"));
}

TEST(JinjaFilters, LengthTrimDefaultJoinFirstLastString) {
  EXPECT_EQ(R("{{ 'héllo' | length }}{{ [1, 2] | length }}{{ {'a': 1} | count }}{{ u | length }}"),
            "5210");
  EXPECT_EQ(R("[{{ '  x \n' | trim }}][{{ '--x--' | trim('-') }}]"), "[x][x]");
  EXPECT_EQ(R("{{ u | default('d') }}{{ '' | default('d') }}{{ '' | default('d', true) }}"
              "[{{ u | default }}]"),
            "dd[]");
  EXPECT_EQ(R("{{ [1, 'a', none] | join(', ') }}|{{ 'abc' | join('-') }}|{{ [] | join }}"),
            "1, a, None|a-b-c|");
  EXPECT_EQ(R("{{ [1, 2, 3] | first }}{{ [1, 2, 3] | last }}{{ 'xyz' | first }}[{{ [] | last }}]"),
            "13x[]");
  EXPECT_EQ(R("{{ (1 | string) + 'a' }}{{ none | string }}"), "1aNone");
  EXPECT_EQ(R("{{ 'AbC' | lower }}{{ 'AbC' | upper }}"), "abcABC");
}

TEST(JinjaMacro, DefinitionCallDefaultsAndScope) {
  const std::string defs =
      "{% set top = 'T' %}{% set ns = namespace(n=0) %}"
      "{%- macro greet(name, punct='!') -%}{% set local = 1 %}{% set ns.n = ns.n + 1 %}"
      "hi {{ name }}{{ punct }}{{ top }}{{ item is defined }}{%- endmacro -%}";
  EXPECT_EQ(R(defs + "{{ greet('a') }}|{{ greet('b', '?') }}|{{ greet(punct='.', name='c') }}|"
                     "{{ ns.n }}{{ local is defined }}"),
            "hi a!TFalse|hi b?TFalse|hi c.TFalse|3False");
  // The caller's loop variables are not visible inside; the macro's text is a string.
  EXPECT_EQ(R(defs + "{% for item in [1] %}{{ greet(item) | length }}{% endfor %}"), "11");
  // Called from another macro defined earlier in the source.
  EXPECT_EQ(R("{% macro a() %}<{{ b() }}>{% endmacro %}{% macro b() %}B{% endmacro %}{{ a() }}"),
            "<B>");
  EXPECT_THAT(R(defs + "{{ greet(1, 2, 3) }}"), HasSubstr("takes not more than 2 argument(s)"));
  EXPECT_THAT(R(defs + "{{ greet(nam=1) }}"), HasSubstr("no keyword argument 'nam'"));
  EXPECT_THAT(R("{% macro r() %}{{ r() }}{% endmacro %}{{ r() }}"), HasSubstr("nested deeper"));
}

TEST(JinjaRaise, RaiseExceptionCarriesTheMessage) {
  auto t = Template::Parse("a{{ raise_exception('Bad role: ' ~ role) }}b");
  ASSERT_TRUE(t.ok()) << t.status();
  auto r = t->Render({{"role", "narrator"}});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "Bad role: narrator");
  EXPECT_TRUE(IsRaisedByTemplate(r.status()));
  auto other = Template::Parse("{{ 1 + 'a' }}")->Render(json::object());
  ASSERT_FALSE(other.ok());
  EXPECT_FALSE(IsRaisedByTemplate(other.status()));
}

TEST(JinjaGlobals, NamespaceAndRange) {
  EXPECT_EQ(R("{% set ns = namespace(a=1) %}{{ ns.a }}{{ ns.b is defined }}"), "1False");
  EXPECT_EQ(R("{% for i in range(3) %}{{ i }}{% endfor %}{{ range(1, 7, 2) }}"),
            "012range(1, 7, 2)");
  EXPECT_EQ(R("{{ range(2) | list }}{{ range(3)[1:] | length }}"), "[0, 1]2");
  EXPECT_THAT(R("{{ range(2) | tojson }}"), HasSubstr("not JSON serializable"));
  EXPECT_EQ(R("{% generation %}kept{% endgeneration %}"), "kept");
}

TEST(JinjaRejects, UnsupportedConstructsNameTheLine) {
  const struct {
    const char* source;
    const char* message;
  } cases[] = {
      {"a\n{% call m() %}x{% endcall %}", "line 2: unsupported statement '{% call %}'"},
      {"{% macro m(*a) %}{% endmacro %}", "line 1: expected a macro parameter name"},
      {"{% macro m(a=1, b) %}{% endmacro %}", "line 1: a macro parameter without a default"},
      {"{{ m() }}", "line 1: unsupported function 'm()'"},
      {"a\nb\n{% include 'x.j2' %}", "line 3: unsupported statement '{% include %}'"},
      {"{% import 'x' as y %}", "line 1: unsupported statement '{% import %}'"},
      {"{% extends 'base' %}", "line 1: unsupported statement '{% extends %}'"},
      {"{% raw %}{{ x }}{% endraw %}", "line 1: unsupported statement '{% raw %}'"},
      {"{% filter upper %}x{% endfilter %}", "line 1: unsupported statement '{% filter %}'"},
      {"\n\n\n{{ x | capitalize }}", "line 4: unsupported filter 'capitalize'"},
      {"{{ x is divisibleby(2) }}", "line 1: unsupported test 'divisibleby'"},
      {"{{ x is odd }}", "line 1: unsupported test 'odd'"},
      {"\n{{ lipsum() }}", "line 2: unsupported function 'lipsum()'"},
      {"{{ strftime_now('%Y') }}", "line 1: unsupported function 'strftime_now()'"},
      {"{{ 'a {}'.format(1) }}", "line 1: unsupported method '.format()'"},
      {"{{ l.append(1) }}", "line 1: unsupported method '.append()'"},
      {"{% for x in l recursive %}{% endfor %}", "line 1: recursive for loops are not supported"},
  };
  for (const auto& c : cases) {
    absl::Status s = ParseError(c.source);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.source;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message)) << c.source;
  }
}

TEST(JinjaRejects, SyntaxErrors) {
  EXPECT_THAT(ParseError("{% if x %}\nno end").message(), HasSubstr("missing '{% endif %}'"));
  EXPECT_THAT(ParseError("a\n{% endfor %}").message(),
              HasSubstr("line 2: unexpected '{% endfor %}'"));
  EXPECT_THAT(ParseError("{% for x in l %}{% endif %}").message(),
              HasSubstr("line 1: unexpected '{% endif %}'"));
  EXPECT_THAT(ParseError("{{ x ) }}").message(), HasSubstr("line 1: unexpected ')'"));
  EXPECT_THAT(ParseError("{{ x y }}").message(), HasSubstr("line 1: unexpected 'y'"));
  EXPECT_THAT(ParseError("{# open").message(), HasSubstr("missing end of comment tag"));
  EXPECT_THAT(ParseError("{{ x").message(), HasSubstr("unexpected end of template"));
  EXPECT_THAT(ParseError("{{ 'x' ? }}").message(), HasSubstr("unexpected character '?'"));
  EXPECT_THAT(ParseError(std::string("{{ '\xff' }}")).message(), HasSubstr("not valid UTF-8"));
}

TEST(JinjaRender, ContextMustBeAnObject) {
  auto t = Template::Parse("x");
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE(t->Render(json::array()).ok());
}

TEST(PyJsonDumps, MatchesPythonJsonDumps) {
  EXPECT_EQ(PyJsonDumps(json::parse(R"({"b": [1, 0.5, "ü"], "a": null})")),
            R"({"b": [1, 0.5, "ü"], "a": null})");
  EXPECT_EQ(PyJsonDumps(json::parse(R"({"b": 1, "a": "ü"})"), true, true),
            R"({"a": "\u00fc", "b": 1})");
}

// The render budget: loops nested over a large input stop with an error naming the budget
// (2 * 10^6 statements and loop iterations, 256 MiB of text) instead of running for minutes or
// exhausting memory; a template that stays under it is untouched.
TEST(JinjaBudget, NestedLoopsAndHugeOutputStopWithAnError) {
  const json big = {{"n", 2000}};
  EXPECT_THAT(R("{% for i in range(n) %}{% for j in range(n) %}{% endfor %}{% endfor %}", big),
              HasSubstr("rendering took more than 2000000 steps"));
  EXPECT_THAT(R("{% for i in range(1000000) %}{{ 'x' * 1000 }}{% endfor %}"),
              HasSubstr("exceeds 268435456 bytes"));
  const json ok = {{"n", 500}};
  EXPECT_EQ(R("{% set ns = namespace(c=0) %}{% for i in range(n) %}{% for j in range(n) %}"
              "{% set ns.c = ns.c + 1 %}{% endfor %}{% endfor %}{{ ns.c }}",
              ok),
            "250000");
}

}  // namespace
}  // namespace hmoe::jinja
