"""`ds4server serve` with real clients: the OpenAI and Anthropic SDKs, raw HTTP for SSE framing, bad input.

The model is the tiny synthetic one with the real DeepSeek V4 vocabulary, so
the text is meaningless; these tests check the protocol: shapes, streaming,
usage, errors in each API's format, and that the server keeps serving.
"""
import http.client
import json

import anthropic
import httpx
import openai
import pytest

from test_server_util import Server, make_model

MODEL_ID = "deepseek-v4-flash"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}]


@pytest.fixture(scope="module")
def model(tmp_path_factory, ds4server):
    return make_model(tmp_path_factory.mktemp("server") / "tiny.gguf")


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, "--max-body-mb", "1")
    yield s
    assert s.stop() == 0, s.log_text()
    assert "stopped" in s.log_text()


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_models_and_health(server, oai):
    ids = [m.id for m in oai.models.list()]
    assert ids == [MODEL_ID]
    assert oai.models.retrieve(MODEL_ID).id == MODEL_ID
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["queue_length"] == 0


def test_chat_completions(oai):
    kw = dict(model=MODEL_ID, messages=[{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Say something."}],
              max_tokens=6, temperature=0.8, seed=3)
    r = oai.chat.completions.create(**kw)
    text = r.choices[0].message.content
    assert isinstance(text, str) and text
    assert r.choices[0].finish_reason in ("length", "stop")
    assert 1 <= r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("chatcmpl-")

    # The same request streamed: same seed, same text, usage in the final events.
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # The prompt was evaluated a moment ago: it is reused from the live KV state.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == chunks[-1].usage.prompt_tokens


def test_chat_reasoning_is_apart(oai):
    # Thinking on: the tiny model never closes its reasoning, so everything is reasoning_content.
    r = oai.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Think."}], max_tokens=5,
                                    extra_body={"thinking": {"type": "enabled"}})
    msg = r.choices[0].message
    assert msg.model_extra.get("reasoning_content")
    assert msg.content == ""


def test_completions(oai):
    r = oai.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=5, seed=9, temperature=0.7)
    assert isinstance(r.choices[0].text, str) and r.usage.completion_tokens <= 5
    parts = list(oai.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=5, seed=9,
                                        temperature=0.7, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == r.choices[0].text


def test_responses(oai):
    r = oai.responses.create(model=MODEL_ID, input="Hello there", max_output_tokens=6,
                             reasoning={"effort": "none"}, instructions="Answer.")
    assert r.status in ("completed", "incomplete")
    assert isinstance(r.output_text, str) and r.output_text
    assert r.usage.output_tokens <= 6
    events = list(oai.responses.create(model=MODEL_ID, input="Hello there", max_output_tokens=6,
                                       reasoning={"effort": "none"}, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created"
    assert "response.output_text.delta" in types
    assert types[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == deltas


def test_messages(claude):
    m = claude.messages.create(model=MODEL_ID, max_tokens=6, system="Be brief.",
                               messages=[{"role": "user", "content": "Hi"}], thinking={"type": "disabled"})
    assert m.type == "message" and m.role == "assistant"
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("max_tokens", "end_turn") and m.usage.output_tokens <= 6
    with claude.messages.stream(model=MODEL_ID, max_tokens=6, messages=[{"role": "user", "content": "Hi"}],
                                thinking={"type": "disabled"}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[-1].text == text
    # Thinking on: the reasoning arrives as a thinking block.
    m = claude.messages.create(model=MODEL_ID, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert m.content[0].type == "thinking" and m.content[0].thinking
    n = claude.messages.count_tokens(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}],
                                     thinking={"type": "disabled"})
    assert n.input_tokens == 5  # BOS, User, "Hi", Assistant, </think>


def test_tools_in_every_api(oai, claude):
    # A tool conversation: definitions, an assistant call and its result, sent back by the client.
    r = oai.chat.completions.create(
        model=MODEL_ID, tools=TOOLS, max_tokens=3,
        messages=[{"role": "user", "content": "Weather in Rome?"},
                  {"role": "assistant", "content": None,
                   "tool_calls": [{"id": "call_1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}])
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    prompt_with_tools = r.usage.prompt_tokens
    chunks = list(oai.chat.completions.create(model=MODEL_ID, tools=TOOLS, tool_choice="none", max_tokens=3,
                                              stream=True, messages=[{"role": "user", "content": "Weather?"}]))
    assert chunks[-1].usage.prompt_tokens < prompt_with_tools  # tool_choice none: schemas not rendered
    m = claude.messages.create(
        model=MODEL_ID, max_tokens=3, thinking={"type": "disabled"},
        tools=[{"name": "get_weather", "description": "Weather of a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        messages=[{"role": "user", "content": "Weather in Rome?"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                     "input": {"city": "Rome"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                "content": "21 degrees"}]}])
    assert m.stop_reason in ("max_tokens", "end_turn", "tool_use") and m.usage.output_tokens <= 3
    r = oai.responses.create(
        model=MODEL_ID, max_output_tokens=3, reasoning={"effort": "none"},
        tools=[{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}],
        input=[{"role": "user", "content": "Weather in Rome?"},
               {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
               {"type": "function_call_output", "call_id": "call_2", "output": "21"}])
    assert r.status in ("completed", "incomplete")


def test_sse_framing(server):
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                       "stream": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("Content-Type").startswith("text/event-stream")
    assert resp.getheader("Transfer-Encoding") == "chunked"
    raw = resp.read().decode()
    conn.close()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for ev in events[:-2]:
        assert ev.startswith("data: ") and "\n" not in ev, ev
        json.loads(ev[6:])
    # Anthropic framing: named events.
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                       "stream": True, "thinking": {"type": "disabled"}}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/messages", body=body, headers={"Content-Type": "application/json"})
    raw = conn.getresponse().read().decode()
    conn.close()
    names = []
    for ev in raw.split("\n\n")[:-1]:
        name, data = ev.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == name[7:]
        names.append(name[7:])
    assert names[0] == "message_start" and names[-1] == "message_stop" and "content_block_delta" in names


def _post(server, path, body, headers=None):
    h = {"Content-Type": "application/json", **(headers or {})}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=data, headers=h, timeout=60)


def _assert_error(r, status, anthropic_format):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    if anthropic_format:
        assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"]
    else:
        assert body["error"]["message"] and body["error"]["type"]


def test_bad_input(server):
    chat = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    msgs = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for path, anth in (("/v1/chat/completions", False), ("/v1/messages", True), ("/v1/responses", False),
                       ("/v1/completions", False)):
        _assert_error(_post(server, path, b'{"model": "deepseek-v4-flash", "messages": ['), 400, anth)
        _assert_error(_post(server, path, b'{"messages": "\xff\xfe"}'), 400, anth)
        _assert_error(_post(server, path, b"x" * (2 << 20)), 413, anth)
        _assert_error(_post(server, path, {**chat, "model": "no-such-model"}), 404, anth)
    _assert_error(_post(server, "/v1/chat/completions", {**chat, "messages": "Hi"}), 400, False)
    _assert_error(_post(server, "/v1/chat/completions", {**chat, "max_tokens": "many"}), 400, False)
    _assert_error(_post(server, "/v1/chat/completions", {**chat, "max_tokens": 1 << 20}), 400, False)
    _assert_error(_post(server, "/v1/chat/completions", {**chat, "temperature": [1]}), 400, False)
    _assert_error(_post(server, "/v1/messages", {**msgs, "max_tokens": 5000}), 400, True)
    _assert_error(_post(server, "/v1/messages", {**msgs, "messages": [{"role": "user", "content": 3}]}), 400, True)
    _assert_error(_post(server, "/v1/responses", {"model": MODEL_ID, "input": 7}), 400, False)
    _assert_error(_post(server, "/v1/completions", {"model": MODEL_ID, "prompt": {"a": 1}}), 400, False)
    long_prompt = "word " * 3000  # more tokens than the 1024-token context
    too_long = {**chat, "messages": [{"role": "user", "content": long_prompt}]}
    _assert_error(_post(server, "/v1/chat/completions", too_long), 400, False)
    _assert_error(_post(server, "/v1/nothing", chat), 404, False)
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405
    # The SDKs raise their typed errors.
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model="gpt-nothing", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError):
        anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0).messages.create(
            model=MODEL_ID, max_tokens=5000, messages=[{"role": "user", "content": "x"}])
    # Still serving.
    r = _post(server, "/v1/chat/completions", chat)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    m = server.metrics()
    assert m['ds4_errors_total{class="4xx"}'] >= 20


def test_api_key_cors_and_any_model(model):
    s = Server(model, "--api-key", "s3cret", "--cors", "--any-model")
    try:
        chat = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        _assert_error(_post(s, "/v1/chat/completions", chat), 401, False)
        _assert_error(_post(s, "/v1/messages", chat), 401, True)
        _assert_error(_post(s, "/v1/chat/completions", chat, {"Authorization": "Bearer wrong"}), 401, False)
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/metrics").status_code == 401
        assert httpx.get(s.url + "/health").status_code == 401
        assert _post(s, "/v1/chat/completions", chat, {"Authorization": "Bearer s3cret"}).status_code == 200
        assert _post(s, "/v1/messages", chat, {"x-api-key": "s3cret"}).status_code == 200
        r = httpx.get(s.url + "/health", headers={"x-api-key": "s3cret"})
        assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "*"
        r = httpx.options(s.url + "/v1/chat/completions")
        assert r.status_code == 204 and "Authorization" in r.headers["Access-Control-Allow-Headers"]
        m = anthropic.Anthropic(base_url=s.url, api_key="s3cret", max_retries=0).messages.create(
            model="claude-any-name", max_tokens=2, messages=[{"role": "user", "content": "x"}])  # --any-model
        assert m.usage.output_tokens <= 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        assert s.stop() == 0
