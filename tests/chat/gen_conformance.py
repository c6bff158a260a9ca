#!/usr/bin/python3
"""Conformance cases for hybridmoe's chat templates, rendered by Python's jinja2.

Generates conversations (fixed seeds: unicode, empty content, tool turns, thinking on/off) for
every test template in tests/data/chat_templates/, renders them with jinja2 configured as
Hugging Face transformers configures it for apply_chat_template, and writes:

  OUT/<name>/tokenizer_config.json (+ chat_template.jinja for one): the template as a checkpoint
  OUT/cases.json: {"checkpoints": {name: dir}, "cases": [{"checkpoint", "request", "expected"
                   or "error"}]}

hmoe_chat_conformance renders the same requests with our engine and compares byte for byte.

  /usr/bin/python3 gen_conformance.py TEMPLATE_DIR OUT [--per-template N]
"""

import argparse
import json
import os
import random
import sys

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


# ------------------------------------------------------------------ jinja2 as transformers has it
# transformers (utils/chat_template_utils.py, _compile_jinja_template): a sandboxed environment
# with trim_blocks and lstrip_blocks, the loopcontrols extension, a `tojson` filter that is
# json.dumps (not jinja2's HTML-escaping one) and the raise_exception global. (Its
# AssistantTracker extension only adds {% generation %}; strftime_now is time-dependent and not
# part of our subset.)
def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def make_env():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def render(compiled, special_tokens, request):
    # transformers' render_jinja_template: render(messages=, tools=, documents=,
    # add_generation_prompt=, **{**special_tokens_map, **kwargs}).
    kwargs = dict(special_tokens)
    kwargs.update(request["extra"])
    template = compiled["default"]
    if request["tools"] is not None and "tool_use" in compiled:
        template = compiled["tool_use"]
    return template.render(messages=request["messages"], tools=request["tools"], documents=None,
                           add_generation_prompt=request["add_generation_prompt"], **kwargs)


# ------------------------------------------------------------------ conversations
TEXTS = [
    "Hello!", "What is 2 + 2?", "", " ", "  padded  ", "\n\nleading newlines", "trailing\n\n",
    "tab\there", "multi\nline\ntext", "quotes ' and \" and `", "back\\slash \\n not a newline",
    "html <b>bold</b> & <i>it</i> 'x'", "json {\"a\": [1, 2]}", "braces {{ not }} {% a tag %}",
    "日本語のテキスト", "中文：你好，世界！", "Ελληνικά", "русский текст", "עברית ומספרים 123",
    "emoji 😀🎉👍🏽 and 👨‍👩‍👧", "combining é vs é", "\u3000ideographic space\u3000",
    "\xa0nbsp\xa0", "zero\u200bwidth", "control \x01\x1f\x7f chars", "math ∑∫√∞ ≤ ≥",
    "<think>not a real think</think>after", "x" * 300, "end with a quote'",
    "Ünïcödé façade naïve café", "🦄" * 5, "\u2028line sep\u2029para sep",
]
THOUGHTS = ["Let me think.", "思考中……", "", "step 1\nstep 2\n", " spaced thought "]
NAMES = ["get_weather", "search", "run_code", "calc", "translate_文本"]


def text(rng):
    t = rng.choice(TEXTS)
    if rng.random() < 0.3:
        t = t + " " + rng.choice(TEXTS)
    return t


def number(rng):
    return rng.choice([0, 1, -7, 42, 2 ** 62, 0.5, 3.0, -2.5e-7, 1e-05, 1e16, 123456789.125,
                       1.7976931348623157e308, 0.1, 100.0, 1e22])


def json_value(rng, depth=0):
    kind = rng.randrange(7 if depth < 2 else 4)
    if kind == 0:
        return text(rng)
    if kind == 1:
        return number(rng)
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return rng.choice(["", "a<b>&'c'", "ü", "\u00e9\u0301"])
    if kind == 4:
        return [json_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["a", "z", "ключ", "k e y", "<tag>", "é", "b", "A"]) + str(i):
            json_value(rng, depth + 1) for i in range(rng.randrange(4))}


def tool_schema(rng, name):
    props = {}
    for i in range(rng.randrange(4)):
        props[rng.choice(["city", "query", "n", "unit", "lang", "données"]) + str(i)] = {
            "type": rng.choice(["string", "integer", "number", "boolean", "array"]),
            "description": text(rng),
        }
        if rng.random() < 0.3:
            props[list(props)[-1]]["enum"] = [json_value(rng, 2) for _ in range(2)]
    fn = {"name": name, "description": text(rng),
          "parameters": {"type": "object", "properties": props,
                         "required": sorted(props)[:rng.randrange(len(props) + 1)]}}
    if rng.random() < 0.2:
        del fn["description"]
    return {"type": "function", "function": fn}


def tool_call(rng, i):
    args = {k: json_value(rng, 1) for k in rng.sample(["city", "q", "n", "opts", "ключ"],
                                                        rng.randrange(4))}
    arguments = json.dumps(args, ensure_ascii=rng.random() < 0.5) if rng.random() < 0.5 else args
    return {"id": f"functions.{rng.choice(NAMES)}:{i}", "type": "function",
            "function": {"name": rng.choice(NAMES), "arguments": arguments}}


def assistant_content(rng, name):
    t = text(rng)
    if name in ("deepseek_r1", "deepseek_v31") and rng.random() < 0.5:
        t = "<think>" + rng.choice(THOUGHTS) + "</think>" + t
        if rng.random() < 0.2:
            t += "</think>tail"
    return t


def conversation(rng, name):
    msgs = []
    for _ in range(rng.choice([0, 0, 1, 1, 2])):
        msgs.append({"role": "system", "content": text(rng)})
    call_id = 0
    for turn in range(rng.randrange(1, 5)):
        user = {"role": "user", "content": text(rng)}
        if name == "kimi_k2" and rng.random() < 0.2:
            user["content"] = [{"type": "text", "text": text(rng)} for _ in range(rng.randrange(1, 3))]
            if rng.random() < 0.5:
                user["content"].append({"type": "image_url", "image_url": {"url": "x"}})
        if name == "kimi_k2" and rng.random() < 0.1:
            user["name"] = "alice"
        msgs.append(user)
        if rng.random() < 0.35:
            calls = [tool_call(rng, call_id + k) for k in range(rng.randrange(1, 4))]
            call_id += len(calls)
            content = rng.choice([None, "", text(rng)])
            if name == "deepseek_v3" and content is None and rng.random() < 0.5:
                content = None
            msgs.append({"role": "assistant", "content": content, "tool_calls": calls})
            for c in calls:
                msgs.append({"role": "tool", "tool_call_id": c["id"],
                             "content": None if name == "kimi_k2" and rng.random() < 0.1 else text(rng)})
            if rng.random() < 0.3:
                break  # end on the tool results: the model answers next
        last = rng.random() < 0.3 and turn > 0
        if last:
            break
        msgs.append({"role": "assistant", "content": assistant_content(rng, name)})
    if rng.random() < 0.03:
        msgs.insert(rng.randrange(len(msgs) + 1), {"role": "narrator", "content": "odd role"})
    return msgs


def request(rng, name):
    tools = None
    if rng.random() < 0.4:
        tools = [tool_schema(rng, n) for n in rng.sample(NAMES, rng.randrange(0, 4))]
    extra = {}
    if name == "deepseek_v31":
        extra = rng.choice([{}, {"thinking": True}, {"thinking": False}])
    elif name == "deepseek_r1":
        extra = rng.choice([{}, {"enable_thinking": True}, {"enable_thinking": False}])
    return {"messages": conversation(rng, name), "tools": tools,
            "add_generation_prompt": rng.random() < 0.7, "extra": extra}


# ------------------------------------------------------------------ checkpoints
# Each test template is written as a checkpoint in a different documented form, so the C++
# loader's paths are covered too: the string form, the list of named templates, a
# chat_template.jinja file, and bos/eos as strings or AddedToken objects.
def added_token(s):
    return {"__type": "AddedToken", "content": s, "lstrip": False, "normalized": True,
            "rstrip": False, "single_word": False}


CHECKPOINTS = {
    "deepseek_v3": ("string", added_token("<｜begin▁of▁sentence｜>"),
                    added_token("<｜end▁of▁sentence｜>")),
    "deepseek_r1": ("string", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "deepseek_v31": ("list", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "kimi_k2": ("file", "[BOS]", "[EOS]"),
}


def token_text(t):
    return t["content"] if isinstance(t, dict) else t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("template_dir")
    ap.add_argument("out")
    ap.add_argument("--per-template", type=int, default=300)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = make_env()
    result = {"checkpoints": {}, "cases": []}
    for seed, (name, (form, bos, eos)) in enumerate(sorted(CHECKPOINTS.items())):
        with open(os.path.join(args.template_dir, name + ".jinja"), encoding="utf-8") as f:
            source = f.read()
        ckpt = os.path.join(args.out, name)
        os.makedirs(ckpt, exist_ok=True)
        config = {"bos_token": bos, "eos_token": eos, "model_max_length": 131072}
        compiled = {"default": env.from_string(source)}
        if form == "string":
            config["chat_template"] = source
        elif form == "list":
            config["chat_template"] = [{"name": "default", "template": source},
                                       {"name": "rag", "template": "{{ raise_exception('rag') }}"}]
        else:
            with open(os.path.join(ckpt, "chat_template.jinja"), "w", encoding="utf-8") as f:
                f.write(source)
        with open(os.path.join(ckpt, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=2)
        result["checkpoints"][name] = ckpt
        special = {"bos_token": token_text(bos), "eos_token": token_text(eos)}
        rng = random.Random(1000 + seed)
        raised = 0
        for _ in range(args.per_template):
            # Round-trip through JSON text: the C++ side reads exactly these values.
            req = json.loads(json.dumps(request(rng, name), ensure_ascii=False))
            case = {"checkpoint": name, "request": req}
            try:
                case["expected"] = render(compiled, special, req)
            except jinja2.exceptions.TemplateError as e:
                if type(e) is not jinja2.exceptions.TemplateError:
                    raise  # Only raise_exception's errors are expected.
                case["error"] = e.message
                raised += 1
            result["cases"].append(case)
        print(f"{name}: {args.per_template} conversations ({raised} raise_exception)")
    with open(os.path.join(args.out, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
