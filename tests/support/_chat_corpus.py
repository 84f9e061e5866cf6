"""Edge-case conversations every template must mask exactly (tests/unit/data/test_data_masks.py).

Each case is (name, messages, tools). The shapes: multi-turn, system/developer, reasoning on the last
or on every turn, reasoning-only turns, tool calls with/without thinking or content, tool calls as the
last turn, tool results as strings and as JSON with quotes and newlines, parallel calls, multi-step
tool use, consecutive assistant/user/tool turns, whitespace at text edges, unicode, list-of-parts
content, tool schemas, and text holding special-token or marker strings.
"""

from __future__ import annotations

def _schema(name: str, description: str) -> dict:
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": city}}


WEATHER = _schema("get_weather", "Weather in a city.")
TIME = _schema("get_time", "Local time in a city.")


def _u(text):
    return {"role": "user", "content": text}


def _a(text, **kw):
    return {"role": "assistant", "content": text, **kw}


def _call(name="get_weather", city="Paris", as_string=False):
    args = '{"city": "%s"}' % city if as_string else {"city": city}
    return {"type": "function", "function": {"name": name, "arguments": args}}


def _tool(text):
    return {"role": "tool", "content": text}


SYS = {"role": "system", "content": "You are brief."}
DEV = {"role": "developer", "content": "Answer in French."}
JSON_RESULT = '{"temp": "21 \\"C\\"", "note": "line one\\nline two", "ok": true}'


def corpus() -> list[tuple[str, list[dict], list | None]]:
    c = [
        ("single turn", [_u("What is 7 plus 6?"), _a("13")], None),
        ("system + turn", [SYS, _u("Hi"), _a("Hello.")], None),
        ("three turns", [SYS, _u("1?"), _a("one"), _u("2?"), _a("two"), _u("3?"), _a("three")], None),
        ("developer", [DEV, _u("Hi"), _a("Bonjour.")], None),
        ("system + developer", [SYS, DEV, _u("Hi"), _a("Bonjour.")], None),
        ("reasoning last turn", [_u("2+2?"), _a("4", reasoning_content="add two and two")], None),
        ("reasoning every turn",
         [_u("2+2?"), _a("4", thinking="add"), _u("3+3?"), _a("6", thinking="add again")], None),
        ("reasoning earlier turn only", [_u("2+2?"), _a("4", thinking="add"), _u("thanks"), _a("welcome")], None),
        ("reasoning-only turn", [_u("think about it"), _a("", thinking="I am thinking")], None),
        ("reasoning field alias", [_u("2+2?"), _a("4", reasoning="sum")], None),
        ("tool call bare", [_u("Weather in Paris?"), _a("", tool_calls=[_call()]), _tool("21 C"), _a("21 C in Paris.")],
         [WEATHER]),
        ("tool call with thinking", [_u("Weather in Paris?"), _a("", thinking="call the tool", tool_calls=[_call()]),
                                     _tool("21 C"), _a("It is 21 C.")], [WEATHER]),
        ("tool call with content", [_u("Weather in Paris?"), _a("Let me check.", tool_calls=[_call()]),
                                    _tool("21 C"), _a("It is 21 C.")], [WEATHER]),
        ("tool call with thinking, final with thinking",
         [_u("Weather in Paris?"), _a("", thinking="call it", tool_calls=[_call()]), _tool("21 C"),
          _a("21 C.", thinking="report it")], [WEATHER]),
        ("tool call last", [_u("Weather in Paris?"), _a("", tool_calls=[_call()])], [WEATHER]),
        ("tool call last with thinking",
         [_u("Weather in Rome?"), _a("", thinking="use tool", tool_calls=[_call(city="Rome")])], [WEATHER]),
        ("tool result JSON", [_u("Weather?"), _a("", tool_calls=[_call()]), _tool(JSON_RESULT), _a("21 C, line two.")],
         [WEATHER]),
        ("tool result JSON, thinking",
         [_u("Weather?"), _a("", thinking="check", tool_calls=[_call()]), _tool(JSON_RESULT), _a("It says 21 C.")],
         [WEATHER]),
        ("tool result with newlines", [_u("Weather?"), _a("", tool_calls=[_call()]), _tool("a\n\nb\n"), _a("a b")],
         [WEATHER]),
        ("parallel calls", [_u("Weather and time in Paris?"),
                            _a("", tool_calls=[_call(), _call("get_time")]), _tool("21 C"), _tool("10:00"),
                            _a("21 C at 10:00.")], [WEATHER, TIME]),
        ("multi-step tools", [_u("Paris then Rome?"), _a("", tool_calls=[_call()]), _tool("21 C"),
                              _a("", tool_calls=[_call(city="Rome")]), _tool("25 C"), _a("21 C and 25 C.")],
         [WEATHER]),
        ("arguments as JSON string", [_u("Weather?"), _a("", tool_calls=[_call(as_string=True)]), _tool("21 C"),
                                      _a("21 C.")], [WEATHER]),
        ("tools in middle turn", [SYS, _u("Hi"), _a("Hello."), _u("Weather?"), _a("", tool_calls=[_call()]),
                                  _tool("21 C"), _a("21 C."), _u("Thanks"), _a("Welcome.")], [WEATHER]),
        ("tool schemas, no call", [_u("Hi"), _a("Hello.")], [WEATHER, TIME]),
        ("consecutive assistant", [_u("Hi"), _a("Hello."), _a("How can I help?")], None),
        ("consecutive assistant, thinking", [_u("Hi"), _a("Hello.", thinking="greet"), _a("Anything else?")], None),
        ("consecutive user", [_u("Hi"), _u("Are you there?"), _a("Yes.")], None),
        ("leading/trailing whitespace", [_u("  padded  "), _a("\n spaced answer \n")], None),
        ("inner newlines", [_u("para one\n\npara two"), _a("line 1\nline 2\n\nline 3")], None),
        ("unicode", [_u("Café? 日本語 🙂 e\u0301"), _a("Oui: café, 日本語, 🙂, e\u0301.")], None),
        ("list-of-parts user", [{"role": "user", "content": [{"type": "text", "text": "What is "},
                                                              {"type": "text", "text": "7 plus 6?"}]}, _a("13")], None),
        ("list-of-parts assistant", [_u("7+6?"), {"role": "assistant", "content": [{"type": "text", "text": "13"}]}],
         None),
        ("special token in user text", [_u("What does <|im_end|> mean?"), _a("It ends a turn.")], None),
        ("harmony markers in user text", [_u("Explain <|start|>user<|message|>hi<|end|> please"), _a("It is harmony.")],
         None),
        ("marker in system text", [{"role": "system", "content": "Never write <|im_start|>assistant\n yourself."},
                                   _u("ok?"), _a("ok")], None),
        ("marker in assistant text", [_u("Show a marker"), _a("Here: <|end|> and <|im_start|>")], None),
        ("marker in tool result", [_u("Weather?"), _a("", tool_calls=[_call()]), _tool("21 C <|call|> <|im_end|>"),
                                   _a("21 C.")], [WEATHER]),
        ("marker in tool arguments", [_u("Weather?"), _a("", tool_calls=[_call(city="<|im_start|>user\nRome<|end|>")]),
                                      _tool("25 C"), _a("25 C.")], [WEATHER]),
        ("think tags in content", [_u("tags?"), _a("I write <think> and </think> as text.")], None),
        ("jinja-looking text", [_u("{{ messages }} {% if x %}"), _a("{{ literal }}")], None),
        ("header-looking text", [_u("assistant\n"), _a("user\nassistant\n")], None),
        ("long message", [_u("count " * 150), _a("one two three " * 60)], None),
        ("numbers only", [_u("1"), _a("2")], None),
        ("JSON answer", [_u("as JSON"), _a('{"a": [1, 2], "b": "x\\ny"}')], None),
        ("three tool results", [_u("3 cities?"), _a("", tool_calls=[_call(), _call(city="Rome"), _call(city="Oslo")]),
                                _tool("21"), _tool("25"), _tool("3"), _a("21, 25, 3.")], [WEATHER]),
        ("everything", [SYS, _u("Hi"), _a("Hello.", thinking="greet"), _u("Weather?"),
                        _a("", thinking="tool", tool_calls=[_call()]), _tool(JSON_RESULT),
                        _a("21 C.", thinking="read it"), _u("And Rome?"),
                        _a("Checking.", tool_calls=[_call(city="Rome")]),
                        _tool("25 C"), _a("25 C.")], [WEATHER]),
    ]
    return c


# ----------------------------------------------------------------------------- the corpus in other formats
_SHAREGPT_FROM = {"system": "system", "user": "human", "assistant": "gpt", "tool": "observation"}


def as_sharegpt(messages: list[dict], tools: list | None) -> dict | None:
    """The conversation as a ShareGPT row (LLaMA-Factory's: a top-level system, function_call turns with
    [{"name", "arguments"}] JSON, observation turns, tools as a JSON string), or None where ShareGPT cannot
    say it (reasoning, developer turns, list-of-parts content, a call beside text)."""
    import json

    turns, row = [], {}
    for i, m in enumerate(messages):
        extra = set(m) - {"role", "content", "tool_calls"}
        if m["role"] not in _SHAREGPT_FROM or extra or not isinstance(m.get("content"), str):
            return None
        if m.get("tool_calls"):
            if m["content"]:
                return None
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            turns.append({"from": "function_call", "value": json.dumps(calls)})
        elif m["role"] == "system" and i == 0:
            row["system"] = m["content"]
        else:
            turns.append({"from": _SHAREGPT_FROM[m["role"]], "value": m["content"]})
    row["conversations"] = turns
    if tools:
        row["tools"] = json.dumps(tools)
    return row


def as_alpaca(messages: list[dict], tools: list | None) -> dict | None:
    """The conversation as an Alpaca row (system, history pairs, instruction/output), or None where Alpaca
    cannot say it (anything but [system] (user, assistant)+ with plain string text)."""
    if tools or any(set(m) != {"role", "content"} or not isinstance(m["content"], str) for m in messages):
        return None
    row = {}
    if messages[0]["role"] == "system":
        row["system"], messages = messages[0]["content"], messages[1:]
    roles = [m["role"] for m in messages]
    if not messages or roles != ["user", "assistant"] * (len(messages) // 2) or len(messages) % 2:
        return None
    pairs = [[messages[i]["content"], messages[i + 1]["content"]] for i in range(0, len(messages), 2)]
    row.update(instruction=pairs[-1][0], input="", output=pairs[-1][1])
    if len(pairs) > 1:
        row["history"] = pairs[:-1]
    return row
