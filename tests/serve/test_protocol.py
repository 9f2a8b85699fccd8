"""The request bodies the server takes: what OpenAI clients send routinely passes at its neutral value,
and a field asking for something tierkv does not do is an error that says so."""
import pytest
from pydantic import ValidationError

from tierkv.serve.protocol import ChatRequest, CompletionRequest

HI = [{"role": "user", "content": "hi"}]


def test_the_neutral_values_agent_frameworks_send_are_taken():
    body = ChatRequest(model="m", messages=[{"role": "developer", "content": "be brief"}, *HI], tools=[],
                       tool_choice="none", parallel_tool_calls=False, logit_bias={}, store=False, metadata={"a": "b"})
    assert body.chat_messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert CompletionRequest(model="m", prompt=["once upon a time"]).prompt == "once upon a time"
    named = ChatRequest(model="m", messages=[{"role": "user", "content": "hi", "name": "ann"}, *HI])
    assert named.chat_messages() == [{"role": "user", "content": "hi", "name": "ann"}, *HI]    # for the template


@pytest.mark.parametrize("request_type, fields, message", [
    (ChatRequest, dict(tools=[{"type": "function", "function": {"name": "f"}}]), "function calling is not supported"),
    (ChatRequest, dict(tool_choice={"type": "function", "function": {"name": "f"}}), "function calling"),
    (ChatRequest, dict(logit_bias={"50256": -100}), "logit_bias is not supported"),
    (ChatRequest, dict(store=True), "completions are not stored here"),
    (CompletionRequest, dict(prompt=["a", "b"]), "one prompt a request is supported, not 2"),
    (ChatRequest, dict(wat=1), "Extra inputs are not permitted"),
    (ChatRequest, dict(stream_options={"include_usage": True}), "stream_options: only with stream=true"),
    (ChatRequest, dict(temperature=float("nan")), "finite number"),
    (CompletionRequest, dict(top_p=float("inf")), "finite number"),
])
def test_what_tierkv_does_not_do_is_refused_by_name(request_type, fields, message):
    base = {"model": "m", **({"messages": HI} if request_type is ChatRequest else {"prompt": "x"})}
    with pytest.raises(ValidationError, match=message):
        request_type(**base | fields)


@pytest.mark.parametrize("field, value", [("max_tokens", "3"), ("max_tokens", 2.0), ("stream", "true"), ("stream", 1),
                                          ("temperature", "0"), ("seed", "7"), ("n", "1"), ("top_p", "1")])
def test_a_value_of_the_wrong_type_is_refused_not_converted(field, value):
    with pytest.raises(ValidationError, match=field):
        ChatRequest.model_validate({"model": "m", "messages": HI, field: value})


def test_numbers_of_either_kind_are_taken_where_a_number_is_asked_for():
    body = ChatRequest.model_validate({"model": "m", "messages": HI, "temperature": 0, "top_p": 1, "max_tokens": 3,
                                       "stream": True, "seed": 7, "n": 1, "stop": ["x"]})
    assert body.temperature == 0 and body.stream and body.stop == ["x"]
