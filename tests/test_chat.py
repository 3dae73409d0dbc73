"""DeepSeek-V4 chat encoding against DeepSeek's official golden cases.

Cases 1-4 are DeepSeek's `encoding/tests/test_input_{1..4}.json` -> `test_output_{1..4}.txt` (V4 HF repos;
read from the copy in vllm-project/vllm tests/tokenizers_/fixtures/deepseek_v4/, with the official
`reasoning_content` key restored). The parse checks mirror the official `encoding/test_encoding_dsv4.py`.
Further expected strings come from public re-implementations' tests of the same format (noted per test).
"""
import json

import pytest

from dsv4.runtime.chat import (AssistantReply, ChatFormatError, ChatParseError, ToolCall, encode_messages,
                               parse_reply)

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def v4_tokenizer():
    from dsv4.runtime.tokenizer import Tokenizer
    return Tokenizer.from_checkpoint(None)


# The tools prompt exactly as in the golden files, up to the schema lines and after them.
TOOLS_HEAD = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by "
    "writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME\">\n<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">"
    "$PARAMETER_VALUE</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"$TOOL_NAME2\">\n...\n"
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\nString parameters should be specified as is and set "
    "`string=\"true\"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format "
    "and set `string=\"false\"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output your "
    "complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\nOtherwise, output "
    "directly after </think> with tool calls or final response.\n\n### Available Tool Schemas\n\n")
TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"

# ------------------------------------------------------------------ golden case 1: thinking + tools
TOOLS_1 = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather for a specific location",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string", "description": "The city name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}},
            "required": ["location"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web for information",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "Search query"},
            "num_results": {"type": "integer", "description": "Number of results to return"}},
            "required": ["query"]}}},
]
MESSAGES_1 = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Beijing?"},
    {"role": "assistant",
     "reasoning_content": "The user wants to know the weather in Beijing. I should use the get_weather tool.",
     "tool_calls": [{"id": "call_001", "type": "function", "function": {
         "name": "get_weather", "arguments": "{\"location\": \"Beijing\", \"unit\": \"celsius\"}"}}]},
    {"role": "tool", "tool_call_id": "call_001",
     "content": "{\"temperature\": 22, \"condition\": \"sunny\", \"humidity\": 45}"},
    {"role": "assistant", "reasoning_content": "Got the weather data. Let me format a nice response.",
     "content": "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity."},
]
OUTPUT_1 = (
    BOS + "You are a helpful assistant.\n\n" + TOOLS_HEAD
    + '{"name": "get_weather", "description": "Get the weather for a specific location", "parameters": {"type": '
      '"object", "properties": {"location": {"type": "string", "description": "The city name"}, "unit": {"type": '
      '"string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}}, "required": ["location"]}}\n'
      '{"name": "search", "description": "Search the web for information", "parameters": {"type": "object", '
      '"properties": {"query": {"type": "string", "description": "Search query"}, "num_results": {"type": '
      '"integer", "description": "Number of results to return"}}, "required": ["query"]}}'
    + TOOLS_TAIL
    + "<｜User｜>What's the weather in Beijing?<｜Assistant｜><think>The user wants to know the weather in Beijing. "
      "I should use the get_weather tool.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
      "<｜DSML｜parameter name=\"location\" string=\"true\">Beijing</｜DSML｜parameter>\n"
      "<｜DSML｜parameter name=\"unit\" string=\"true\">celsius</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
      "</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>{\"temperature\": 22, \"condition\": "
      "\"sunny\", \"humidity\": 45}</tool_result><｜Assistant｜><think>Got the weather data. Let me format a nice "
      "response.</think>The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity."
      "<｜end▁of▁sentence｜>")

# ------------------------------------------------------------------ golden case 2: thinking, earlier reasoning dropped
MESSAGES_2 = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "reasoning_content": "The user said hello, I should greet back.",
     "content": "Hi there! How can I help you?"},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "reasoning_content": "The user asks about the capital of France. It is Paris.",
     "content": "The capital of France is Paris."},
]
OUTPUT_2 = (BOS + "You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>Hi there! How can I help you?"
            "<｜end▁of▁sentence｜><｜User｜>What is the capital of France?<｜Assistant｜><think>The user asks about "
            "the capital of France. It is Paris.</think>The capital of France is Paris.<｜end▁of▁sentence｜>")

# ------------------------------------------------------------------ golden case 3: developer, reminder, tools
_SCHEMA = "http://json-schema.org/draft-07/schema#"
TOOLS_3 = [
    {"type": "function", "function": {
        "name": "search", "description": "Web search. Split multiple queries with '||'.",
        "parameters": {"type": "object", "properties": {"queries": {"type": "string", "description": "query1||query2"}},
                       "required": ["queries"], "additionalProperties": False, "$schema": _SCHEMA}}},
    {"type": "function", "function": {
        "name": "open", "description": "Batch open IDs (format 【{id}†...】) or URLs.",
        "parameters": {"type": "object", "properties": {"open_list": {"type": "array", "items": {
            "type": "object", "properties": {
                "id": {"description": "ID or URL", "anyOf": [{"type": "integer"}, {"type": "string"}], "default": -1},
                "cursor": {"type": "integer", "description": "", "default": -1},
                "loc": {"type": "integer", "description": "Start line", "default": -1},
                "num_lines": {"type": "integer", "description": "", "default": -1},
                "view_source": {"type": "boolean", "description": "", "default": False}},
            "additionalProperties": False}, "description": ""}},
            "required": ["open_list"], "additionalProperties": False, "$schema": _SCHEMA}}},
    {"type": "function", "function": {
        "name": "find", "description": "Find exact text pattern in pages.",
        "parameters": {"type": "object", "properties": {"find_list": {"type": "array", "items": {
            "type": "object", "properties": {
                "pattern": {"type": "string", "description": ""},
                "cursor": {"type": "integer", "description": "", "default": -1}},
            "required": ["pattern"], "additionalProperties": False}, "description": ""}},
            "required": ["find_list"], "additionalProperties": False, "$schema": _SCHEMA}}},
]
MESSAGES_3 = [
    {"role": "system", "content": "该助手为DeepSeek，由深度求索公司创造。"},
    {"role": "latest_reminder", "content": "2026-02-21,星期六,广州,App,中文"},
    {"role": "developer", "tools": TOOLS_3,
     "content": "小柴胡冲剂和布洛芬能一起吃吗？\n\nCITATION FORMAT: 【{cursor_id}†L{start_line_id}(-L{end_line_id})?】"},
    {"role": "assistant", "content": "", "reasoning_content": "用户想知道小柴胡冲剂和布洛芬能否一起服用。",
     "tool_calls": [{"type": "function", "function": {
         "name": "search", "arguments": "{\"queries\": \"小柴胡冲剂 布洛芬 相互作用 一起吃\"}"}}]},
    {"role": "tool", "content": "[0]"},
    {"role": "assistant", "content": "请及时就医。", "reasoning_content": "现在开始组织回答。", "tool_calls": []},
]
OUTPUT_3 = (
    BOS + "该助手为DeepSeek，由深度求索公司创造。<｜latest_reminder｜>2026-02-21,星期六,广州,App,中文<｜User｜>"
    "小柴胡冲剂和布洛芬能一起吃吗？\n\nCITATION FORMAT: 【{cursor_id}†L{start_line_id}(-L{end_line_id})?】\n\n"
    + TOOLS_HEAD
    + '{"name": "search", "description": "Web search. Split multiple queries with \'||\'.", "parameters": {"type": '
      '"object", "properties": {"queries": {"type": "string", "description": "query1||query2"}}, "required": '
      '["queries"], "additionalProperties": false, "$schema": "http://json-schema.org/draft-07/schema#"}}\n'
      '{"name": "open", "description": "Batch open IDs (format 【{id}†...】) or URLs.", "parameters": {"type": '
      '"object", "properties": {"open_list": {"type": "array", "items": {"type": "object", "properties": {"id": '
      '{"description": "ID or URL", "anyOf": [{"type": "integer"}, {"type": "string"}], "default": -1}, "cursor": '
      '{"type": "integer", "description": "", "default": -1}, "loc": {"type": "integer", "description": "Start '
      'line", "default": -1}, "num_lines": {"type": "integer", "description": "", "default": -1}, "view_source": '
      '{"type": "boolean", "description": "", "default": false}}, "additionalProperties": false}, "description": '
      '""}}, "required": ["open_list"], "additionalProperties": false, "$schema": '
      '"http://json-schema.org/draft-07/schema#"}}\n'
      '{"name": "find", "description": "Find exact text pattern in pages.", "parameters": {"type": "object", '
      '"properties": {"find_list": {"type": "array", "items": {"type": "object", "properties": {"pattern": '
      '{"type": "string", "description": ""}, "cursor": {"type": "integer", "description": "", "default": -1}}, '
      '"required": ["pattern"], "additionalProperties": false}, "description": ""}}, "required": ["find_list"], '
      '"additionalProperties": false, "$schema": "http://json-schema.org/draft-07/schema#"}}'
    + TOOLS_TAIL
    + "<｜Assistant｜><think>用户想知道小柴胡冲剂和布洛芬能否一起服用。</think>\n\n<｜DSML｜tool_calls>\n"
      "<｜DSML｜invoke name=\"search\">\n<｜DSML｜parameter name=\"queries\" string=\"true\">小柴胡冲剂 布洛芬 相互作用 "
      "一起吃</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜>"
      "<tool_result>[0]</tool_result><｜Assistant｜><think>现在开始组织回答。</think>请及时就医。<｜end▁of▁sentence｜>")

# ------------------------------------------------------------------ golden case 4: chat mode, quick-instruction task
ANSWER_4 = (
    "关于热海大滚锅是否是世界著名温泉，可以这样总结：它在**中国乃至全球的地热奇观中占有重要地位**，但“世界著名”的称号更侧重于它作为"
    "**独特的地质现象和旅游景点**，而非普遍的温泉疗养体验。\n\n为了让你快速了解，我整理了一个简要的表格：\n\n"
    "| 维度 | 热海大滚锅的地位与特点 |\n| :--- | :--- |\n"
    "| **地质奇观** | **世界罕见**的高温地热系统，泉眼多、水温高、形态多样。 |\n"
    "| **国内声誉** | **中国三大地热区之一**，**国家5A级旅游景区**，自古闻名（徐霞客曾游历并记载）。 |\n"
    "| **国际知名度** | 在一些旅游平台被提及为“世界六大温泉”之一，但此说法流传不广，其国际声誉更多建立在地质独特性上。 |\n"
    "| **核心体验** | **观赏地热奇观**（如97℃沸腾的“大滚锅”）、**体验温泉煮鸡蛋**。 |\n\n"
    "### 💡 游玩攻略与温馨提示\n\n如果你计划前往热海大滚锅，这里有一些实用信息供你参考：\n\n"
    "- **门票与开放时间**：\n    - **门票**：景区门票约为**50元/人**。如果选择包含温泉沐浴的套餐，价格会更高，例如约**288元**。\n"
    "    - **开放时间**：景区一般**08:00-18:00**开放，但具体时间可能变动，建议提前核实。\n\n"
    "- **特色体验**：\n    - **温泉煮鸡蛋**：这几乎是必试项目。可以在景区门口购买用草绳串起的生鸡蛋（约5-8元/串），然后到“大滚锅”旁的指定"
    "区域蒸煮，几分钟便可熟食，趣味十足。\n    - **金汤足浴**：可以直接用从“大滚锅”流出的温泉水泡脚，缓解旅途疲劳。\n\n"
    "- **注意事项**：\n    - **安全第一**：“大滚锅”水温极高，务必遵守游览规则，在指定区域内观赏，切勿随意触碰泉水。\n"
    "    - **规划行程**：建议为热海景区预留**3-4小时**的游览时间。景区内步道不走回头路，出入口有观光车接送。\n\n"
    "希望这些信息能帮助你更好地了解热海大滚锅。如果你对腾冲的其他景点或者行程规划有更多疑问，我很乐意提供进一步的信息。")
MESSAGES_4 = [
    {"role": "system", "content": "该助手为DeepSeek-V3，由深度求索公司创造。\n今天是2025年10月17日，星期五。"},
    {"role": "latest_reminder", "content": "2024-11-15,上海市,App,中文"},
    {"role": "user", "content": "热海大滚锅是世界著名温泉吗"},
    {"role": "assistant", "content": ANSWER_4, "mask": 1},
    {"role": "user", "content": "世界著名温泉有哪些", "task": "action"},
    {"role": "assistant", "content": "Search"},
]
OUTPUT_4 = (BOS + "该助手为DeepSeek-V3，由深度求索公司创造。\n今天是2025年10月17日，星期五。<｜latest_reminder｜>"
            "2024-11-15,上海市,App,中文<｜User｜>热海大滚锅是世界著名温泉吗<｜Assistant｜></think>" + ANSWER_4
            + "<｜end▁of▁sentence｜><｜User｜>世界著名温泉有哪些<｜Assistant｜></think><｜action｜>Search"
              "<｜end▁of▁sentence｜>")


def test_golden_1_thinking_with_tools():
    prompt = encode_messages(MESSAGES_1, thinking=True, tools=TOOLS_1)
    assert prompt == OUTPUT_1
    # Official test: parse the first assistant turn (a tool call) and the last one (an answer).
    marker = "<｜Assistant｜><think>"
    first = prompt.find(marker) + len(marker)
    reply = parse_reply(prompt[first:prompt.find("<｜User｜>", first)], thinking=True)
    assert reply.reasoning_content == ("The user wants to know the weather in Beijing. "
                                       "I should use the get_weather tool.")
    assert reply.content == ""
    assert [t.name for t in reply.tool_calls] == ["get_weather"]
    assert json.loads(reply.tool_calls[0].arguments) == {"location": "Beijing", "unit": "celsius"}
    final = parse_reply(prompt[prompt.rfind(marker) + len(marker):], thinking=True)
    assert final.reasoning_content == "Got the weather data. Let me format a nice response."
    assert "22°C" in final.content and final.tool_calls == ()


def test_golden_1_tools_on_first_message_equals_tools_argument():
    messages = [{**MESSAGES_1[0], "tools": TOOLS_1}, *MESSAGES_1[1:]]
    assert encode_messages(messages, thinking=True) == OUTPUT_1


def test_golden_2_thinking_drops_earlier_reasoning():
    prompt = encode_messages(MESSAGES_2, thinking=True)
    assert prompt == OUTPUT_2
    marker = "<｜Assistant｜><think>"
    reply = parse_reply(prompt[prompt.rfind(marker) + len(marker):], thinking=True)
    assert reply == AssistantReply("The capital of France is Paris.",
                                   "The user asks about the capital of France. It is Paris.")
    assert "The user said hello" not in prompt


def test_golden_3_developer_latest_reminder_and_search_tools():
    assert encode_messages(MESSAGES_3, thinking=True) == OUTPUT_3


def test_golden_4_chat_mode_action_task():
    assert encode_messages(MESSAGES_4, thinking=False) == OUTPUT_4


def test_vllm_reasoning_alias_is_accepted():
    messages = [{**m, "reasoning": m.pop("reasoning_content")} if "reasoning_content" in m else m
                for m in (dict(m) for m in MESSAGES_2)]
    assert encode_messages(messages, thinking=True) == OUTPUT_2


# ------------------------------------------------------------------ single features
# Expected strings from public re-implementations' tests of the same format (vLLM tests/tokenizers_/
# test_deepseek_v4.py; smg crates renderer/deepseek_v4/tests.rs), checked against the official algorithm.
ABSOLUTE_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough in your thinking "
    "and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic "
    "against all potential paths, edge cases, and adversarial scenarios.\nExplicitly write out your entire "
    "deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to "
    "ensure absolutely no assumption is left unchecked.\n\n")
HELLO = [{"role": "user", "content": "Hello"}]


def test_thinking_on_off():
    assert encode_messages(HELLO) == BOS + "<｜User｜>Hello<｜Assistant｜></think>"
    assert encode_messages(HELLO, thinking=True) == BOS + "<｜User｜>Hello<｜Assistant｜><think>"
    assert encode_messages(HELLO, add_bos=False) == "<｜User｜>Hello<｜Assistant｜></think>"


def test_reasoning_effort_v4():
    solve = [{"role": "user", "content": "solve it"}]
    assert encode_messages(solve, thinking=True, reasoning_effort="max") == (
        BOS + ABSOLUTE_MAX + "<｜User｜>solve it<｜Assistant｜><think>")
    assert encode_messages(solve, thinking=True, reasoning_effort="high") == (
        BOS + "<｜User｜>solve it<｜Assistant｜><think>")
    # The effort prompt exists only in thinking mode.
    assert encode_messages(solve, reasoning_effort="max") == BOS + "<｜User｜>solve it<｜Assistant｜></think>"
    with pytest.raises(ChatFormatError, match="reasoning_effort"):
        encode_messages(solve, thinking=True, reasoning_effort="low")


def test_reasoning_effort_v4_0731():
    def enc(effort):
        return encode_messages(HELLO, thinking=True, reasoning_effort=effort, revision="v4-0731")
    assert enc("low") == enc(None) == BOS + "<｜User｜>Hello<｜Assistant｜><think>"
    assert enc("high") == BOS + ABSOLUTE_MAX + "<｜User｜>Hello<｜Assistant｜><think>"
    assert enc("max").startswith(
        BOS + "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n")
    assert enc("max").endswith("no error remains undiscovered.\n\n<｜User｜>Hello<｜Assistant｜><think>")


def test_tool_results_follow_tool_call_order():
    messages = [
        {"role": "assistant", "tool_calls": [
            {"id": "second", "type": "function", "function": {"name": "second_tool", "arguments": "{}"}},
            {"id": "first", "type": "function", "function": {"name": "first_tool", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "first", "content": "first result"},
        {"role": "tool", "tool_call_id": "second", "content": "second result"},
    ]
    assert encode_messages(messages) == (
        BOS + "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"second_tool\">\n\n</｜DSML｜invoke>\n"
        "<｜DSML｜invoke name=\"first_tool\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>second result</tool_result>\n\n<tool_result>first result</tool_result>"
        "<｜Assistant｜></think>")


def test_drop_thinking_false_keeps_earlier_reasoning():
    messages = [{"role": "assistant", "reasoning_content": "old reasoning", "content": "old answer"},
                {"role": "user", "content": "next"}]
    assert encode_messages(messages, thinking=True, drop_thinking=False) == (
        BOS + "old reasoning</think>old answer<｜end▁of▁sentence｜><｜User｜>next<｜Assistant｜><think>")


def test_thinking_drops_earlier_developer_turns_only():
    # Derived by hand from the official _drop_thinking_messages: before the last user/developer turn,
    # developer turns vanish and assistant turns lose their reasoning; the last one is kept.
    early = [{"role": "developer", "content": "rules"},
             {"role": "assistant", "reasoning_content": "r1", "content": "a1"},
             {"role": "user", "content": "q2"}]
    assert encode_messages(early, thinking=True) == BOS + "a1<｜end▁of▁sentence｜><｜User｜>q2<｜Assistant｜><think>"
    last = [{"role": "user", "content": "q1"},
            {"role": "assistant", "reasoning_content": "r1", "content": "a1"},
            {"role": "developer", "content": "d"}]
    assert encode_messages(last, thinking=True) == (
        BOS + "<｜User｜>q1<｜Assistant｜></think>a1<｜end▁of▁sentence｜><｜User｜>d<｜Assistant｜><think>")


def test_assistant_prefix_without_eos():
    messages = [{"role": "user", "content": "write"},
                {"role": "assistant", "content": "partial answer", "wo_eos": True}]
    assert encode_messages(messages) == BOS + "<｜User｜>write<｜Assistant｜></think>partial answer"


def test_response_format_and_context():
    system = {"role": "system", "content": "Be terse.", "response_format": {"type": "json_object"}}
    assert encode_messages([system, *HELLO]) == (
        BOS + "Be terse.\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        '{"type": "json_object"}<｜User｜>Hello<｜Assistant｜></think>')
    # With context (already in the KV cache) only the new turns are rendered, without BOS.
    turn1 = [*HELLO, {"role": "assistant", "content": "Hi"}]
    full = encode_messages([*turn1, {"role": "user", "content": "Bye"}])
    assert encode_messages([{"role": "user", "content": "Bye"}], context=turn1) == full[len(encode_messages(turn1)):]


def test_tools_without_system_message_get_their_own():
    prompt = encode_messages(HELLO, tools=TOOLS_1[:1])
    assert prompt.startswith(BOS + "\n\n" + TOOLS_HEAD + '{"name": "get_weather"')
    assert prompt.endswith(TOOLS_TAIL + "<｜User｜>Hello<｜Assistant｜></think>")


def test_content_parts_and_bad_messages():
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert encode_messages(parts) == BOS + "<｜User｜>a\n\nb<｜Assistant｜></think>"
    for bad, match in [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "image_url"),
        ([{"role": "robot", "content": "x"}], "unknown role"),
        ([{"role": "user", "content": "x", "task": "dance"}], "unknown task"),
        ([{"role": "developer", "content": ""}], "developer"),
        ([{"role": "user", "content": "x", "tools": TOOLS_1}], "tools"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b", "task": "query"}], "task would be lost"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}], "JSON object"),
        ([{"role": "assistant", "reasoning": "a", "reasoning_content": "b"}], "differ"),
    ]:
        with pytest.raises(ChatFormatError, match=match):
            encode_messages(bad)


def test_chat_markers_are_single_tokens(v4_tokenizer):
    # The strings the encoder writes must be the tokenizer's added tokens (fullwidth bars, '▁').
    from dsv4.runtime import chat
    for token in [chat.BOS, chat.EOS, chat.USER, chat.ASSISTANT, chat.LATEST_REMINDER, chat.THINK_START,
                  chat.THINK_END, chat.DSML, *chat.TASK_TOKENS.values()]:
        assert len(v4_tokenizer.encode(token)) == 1, token
    ids = v4_tokenizer.encode(encode_messages(HELLO, thinking=True))
    assert ids == [0, 128803, 19923, 128804, 128821]


# ------------------------------------------------------------------ parsing
def _assistant_reply(message: dict, thinking: bool) -> str:
    """The text the model would generate for `message`: its rendering after the prompt's opening."""
    prompt = encode_messages([{"role": "user", "content": "q"}, message], thinking=thinking, drop_thinking=False)
    return prompt[len(encode_messages([{"role": "user", "content": "q"}], thinking=thinking, drop_thinking=False)):]


@pytest.mark.parametrize("thinking", [False, True])
def test_round_trip(thinking):
    calls = [("get_weather", {"location": "北京", "days": 3, "hourly": False, "tags": ["a", "b"], "extra": None}),
             ("now", {})]
    message = {"role": "assistant", "content": "Let me check 🙂.",
               "reasoning_content": "I need the weather." if thinking else "",
               "tool_calls": [{"type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                              for n, a in calls]}
    reply = parse_reply(_assistant_reply(message, thinking), thinking=thinking)
    assert reply.content == "Let me check 🙂."
    assert reply.reasoning_content == message["reasoning_content"]
    assert [(t.name, json.loads(t.arguments)) for t in reply.tool_calls] == calls
    assert reply.to_message()["tool_calls"][1] == {"type": "function", "function": {"name": "now", "arguments": "{}"}}


def test_parse_without_eos_and_plain_answers():
    assert parse_reply("Paris.", thinking=False) == AssistantReply("Paris.", "")
    assert parse_reply("hmm</think>Paris." + EOS, thinking=True) == AssistantReply("Paris.", "hmm")
    tool = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x" string="false">1'
            '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    assert parse_reply(tool, thinking=False) == AssistantReply("", "", (ToolCall("f", '{"x": 1}'),))


@pytest.mark.parametrize("text, thinking, match", [
    ("no end of thinking", True, "</think>"),
    ("answer" + EOS + "more", False, "after EOS"),
    ("a</think>b</think>c", True, "special token"),
    ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n', False, "not closed"),
    ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke nam="f">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>', False, "malformed invoke"),
    ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x">1</｜DSML｜parameter>\n'
     '</｜DSML｜invoke>\n</｜DSML｜tool_calls>', False, "malformed parameter"),
    ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x" string="true">1</｜DSML｜parameter>'
     '\n<｜DSML｜parameter name="x" string="true">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
     False, "duplicate"),
    ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x" string="false">one'
     '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>', False, "not JSON"),
    ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>trailing', False,
     "after the tool calls"),
])
def test_malformed_replies_raise(text, thinking, match):
    with pytest.raises(ChatParseError, match=match):
        parse_reply(text, thinking=thinking)
