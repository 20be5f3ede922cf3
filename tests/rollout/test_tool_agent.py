"""The tool-use generate plugin (rollout/multiturn/tool_agent.py): the model's `<tool_call>` blocks run Python tools, and
the template's tool turns go back as environment tokens, with the model's own tokens trained on."""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

import pytest

from miles.config import RolloutConfig
from miles.model_io import load_model
from miles.rollout import Engine, SamplingParams
from miles.rollout.multiturn.rollout import MultiTurnRollout
from miles.rollout.multiturn.tool_agent import tool_agent
from miles.sample import Sample, SampleStatus
from tests.serve.test_tool_calls import TOOL_TEMPLATE
from tests.support.models import assert_pool_clean


def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: the city's name
    """
    if city == "Atlantis":
        raise LookupError("no such city")
    return f"18 C in {city}"


async def add(a: int, b: int) -> dict:
    """Adds two numbers.

    Args:
        a: the first
        b: the second
    """
    return {"sum": a + b}


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "done"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tokenizer = copy.deepcopy(load_model("builtin:tiny_moe_math").tokenizer)
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


class ScriptedClient:
    """The plugin's engine client, answering each turn with the next scripted reply (as the model's tokens,
    with made-up logprobs), so the conversation's tokens can be checked."""

    def __init__(self, tokenizer: Any, replies: list[str], max_context: int = 100_000) -> None:
        self.tokenizer, self.replies, self.max_context = tokenizer, list(replies), max_context
        self.prompts: list[list[int]] = []

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Sample:
        self.prompts.append(list(prompt_ids))
        if len(prompt_ids) + 1 > self.max_context:  # as the engine refuses a prompt with no room left
            return Sample(prompt_ids=prompt_ids, status=SampleStatus.ABORTED, metadata={"error": "too long"})
        text = self.replies.pop(0)
        ids = self.encode(text + "<|im_end|>")
        return Sample(
            prompt_ids=prompt_ids,
            response_ids=ids,
            response_text=text,
            rollout_logprobs=[-0.5] * len(ids),
            status=SampleStatus.COMPLETED,
        )


def test_calls_run_and_their_answers_go_back_as_environment_tokens(tokenizer: Any) -> None:
    replies = [
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Atlantis"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "fly", "arguments": {}}\n</tool_call>',
        "It is 18 C in Paris and 2 + 3 = 5.",
    ]
    client = ScriptedClient(tokenizer, replies)
    generate = tool_agent([get_weather, add], max_turns=4, system_prompt="Use the tools.")
    sample = Sample(prompt="Weather in Paris, and 2 + 3?", prompt_ids=[1, 2, 3])
    out = asyncio.run(generate(client, sample, SamplingParams(temperature=1.0)))
    decode = tokenizer.decode
    first = decode(client.prompts[0])
    assert first.startswith("<|im_start|>system\nTools:") and '"name": "get_weather"' in first
    assert '"description": "The weather in a city."' in first and "Use the tools.<|im_end|>" in first
    assert first.endswith("<|im_start|>user\nWeather in Paris, and 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert out.prompt_ids == client.prompts[0] and out.metadata["turns"] == 3
    assert out.metadata["tool_calls"] == 4 and out.metadata["tool_errors"] == 2
    # Each turn's prompt is the conversation so far: the model's tokens, then the tool turns.
    assert (
        client.prompts[1] == out.prompt_ids + out.response_ids[: len(client.prompts[1]) - len(out.prompt_ids)]
    )
    response = decode(out.response_ids)
    answers = [
        "<tool_response>\n18 C in Paris\n</tool_response>",
        '<tool_response>\n{"sum": 5}\n</tool_response>',
        "<tool_response>\nerror: LookupError: no such city\n</tool_response>",
        "<tool_response>\nerror: no tool named 'fly'; the tools are add, get_weather\n</tool_response>",
    ]
    for answer in answers:
        assert answer in response
    assert response.endswith("It is 18 C in Paris and 2 + 3 = 5.<|im_end|>")
    # Trained: exactly the model's tokens, with their logprobs; the tool turns are masked.
    trained = [t for t, m in zip(out.response_ids, out.loss_mask) if m]
    assert trained == [t for r in replies for t in client.encode(r + "<|im_end|>")]
    assert all(lp == -0.5 for lp, m in zip(out.rollout_logprobs, out.loss_mask) if m)
    masked = decode([t for t, m in zip(out.response_ids, out.loss_mask) if not m])
    assert masked.startswith("\n<|im_start|>user\n<tool_response>") and masked.endswith(
        "<|im_start|>assistant\n"
    )


# TOOL_TEMPLATE with Qwen3's rule for an assistant turn after the last user message: a thinking block
# (split off its content at `</think>`) when it is the last message or has reasoning, so a last turn without
# reasoning gets an empty block that it loses once tool turns follow it.
QWEN3_LIKE_TEMPLATE = TOOL_TEMPLATE.replace(
    "{%- elif message.tool_calls %}<|im_start|>assistant\n{{ message.content }}",
    "{%- elif message.tool_calls %}{%- set content = message.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1]"
    ".strip('\\n') %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "<|im_start|>assistant\n{% if loop.last or reasoning %}<think>\n{{ reasoning }}\n</think>\n\n{% endif %}"
    "{{ content }}",
)


@pytest.mark.parametrize("thinking", ["<think>\nPlan.\n</think>\n\n", "<think>\n\n</think>\n\n", ""])
def test_a_template_that_renders_the_last_turn_differently_still_gets_the_tool_turns(
    tokenizer: Any, thinking: str
) -> None:
    """Qwen3's template renders a tool-calling turn without reasoning with an empty thinking block while it is
    the last message, without one once the tool turns follow: the environment tokens are still what the
    template puts after the model's turn (they once failed the sample: "renders an earlier turn
    differently")."""
    qwen3 = copy.deepcopy(tokenizer)
    qwen3.chat_template = QWEN3_LIKE_TEMPLATE
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    replies = [thinking + call, "It is 18 C."]
    client = ScriptedClient(qwen3, replies)
    out = asyncio.run(tool_agent([get_weather])(client, Sample(prompt="Weather?"), SamplingParams()))
    assert out.status == SampleStatus.COMPLETED and out.metadata["turns"] == 2
    assert out.metadata["tool_calls"] == 1 and out.metadata["tool_errors"] == 0
    trained = [t for t, m in zip(out.response_ids, out.loss_mask) if m]
    assert trained == [t for r in replies for t in client.encode(r + "<|im_end|>")]
    masked = qwen3.decode([t for t, m in zip(out.response_ids, out.loss_mask) if not m])
    assert masked == (
        "\n<|im_start|>user\n<tool_response>\n18 C in Paris\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        client.prompts[1] == out.prompt_ids + out.response_ids[: len(client.prompts[1]) - len(out.prompt_ids)]
    )


def test_turns_end_at_max_turns_and_a_slow_tool_times_out(tokenizer: Any) -> None:
    call = '<tool_call>\n{"name": "slow", "arguments": {"seconds": 1}}\n</tool_call>'
    client = ScriptedClient(tokenizer, [call, call, "never asked"])
    generate = tool_agent([slow], max_turns=2, tool_timeout_s=0.05)
    out = asyncio.run(generate(client, Sample(prompt="go"), SamplingParams()))
    assert out.metadata["turns"] == 2 and out.metadata["tool_errors"] == 2 and len(client.replies) == 1
    assert "error: slow took longer than 0.05 s" in tokenizer.decode(out.response_ids)


def test_tool_answers_past_the_context_end_the_trajectory_as_truncated(tokenizer: Any) -> None:
    """A tool answer that leaves no room for another token: the engine would refuse the next turn (ABORTED),
    which drops the whole trajectory from training. It ends as a length cut instead, without the answer,
    within the context, with the model's turn trained on."""

    def lookup(q: str) -> str:
        """Looks something up.

        Args:
            q: the query
        """
        return "y" * 2000

    call = '<tool_call>\n{"name": "lookup", "arguments": {"q": "a"}}\n</tool_call>'
    client = ScriptedClient(tokenizer, [call, "never asked"], max_context=600)
    out = asyncio.run(tool_agent([lookup])(client, Sample(prompt="go"), SamplingParams()))
    assert out.status == SampleStatus.TRUNCATED and out.metadata["turns"] == 1 and len(client.prompts) == 1
    assert out.response_ids == client.encode(call + "<|im_end|>") and all(out.loss_mask)
    assert len(out.prompt_ids) + len(out.response_ids) <= client.max_context
    # An answer that fits goes on as before.
    client = ScriptedClient(tokenizer, [call, "done"], max_context=100_000)
    out = asyncio.run(tool_agent([lookup])(client, Sample(prompt="go"), SamplingParams()))
    assert out.status == SampleStatus.COMPLETED and out.metadata["turns"] == 2


def test_bad_setups_are_refused_with_what_to_do(tokenizer: Any) -> None:
    def undocumented(x):  # noqa: ANN001, ANN202
        return x

    with pytest.raises(Exception, match="type hint|docstring|description"):
        tool_agent([undocumented])
    with pytest.raises(ValueError, match="max_turns"):
        tool_agent([get_weather], max_turns=0)
    plain = load_model("builtin:tiny_moe_math").tokenizer  # ChatML without tools
    with pytest.raises(ValueError, match="<tool_call> format"):
        asyncio.run(
            tool_agent([get_weather])(ScriptedClient(plain, ["x"]), Sample(prompt="hi"), SamplingParams())
        )


def test_the_plugin_runs_on_the_engine(tokenizer: Any) -> None:
    """On the real engine (the tiny model calls no tools, so each sample is one turn), through the
    multi-turn driver the loop uses."""
    loaded = load_model("builtin:tiny_moe_math")
    engine = Engine(loaded.model, tokenizer, RolloutConfig(kv_cache_bytes=16 * 1024 * 1024))
    rollout = MultiTurnRollout(engine, tool_agent([get_weather, add]))
    prompts = [
        Sample(prompt="What is 2 + 3?", prompt_ids=[5]),
        Sample(prompt=[{"role": "user", "content": "Hi"}]),
    ]
    out = rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=12, seed=3))
    assert len(out) == 4 and all(s.status != SampleStatus.ABORTED for s in out), [s.metadata for s in out]
    for s in out:
        assert '"name": "get_weather"' in tokenizer.decode(s.prompt_ids)
        assert s.metadata["turns"] == 1 and s.metadata["tool_calls"] == 0 and all(s.loss_mask)


@pytest.mark.parametrize("limit", ["kv_pool", "context"])
@pytest.mark.parametrize("turns", ["short", "long"])
def test_a_conversation_that_outgrows_the_engine_ends_as_truncated(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch, limit: str, turns: str
) -> None:
    """On the real engine, with a KV pool (or a context) that the conversation outgrows: by its tool answers
    (short turns) or within a model turn (long turns). A pool smaller than the context bounds a request too: the
    engine refuses a prompt past it and aborts a turn that outgrows it, and either would drop the whole
    trajectory from training (ABORTED). It ends as a length cut instead, within what the engine holds, with
    the model's turns trained on."""
    import miles.rollout.multiturn.tool_agent as module
    from miles.rollout.kv.pool import KVLayout
    from miles.rollout.multiturn.tool_calls import ParsedReply, ToolCall

    def lookup(q: str) -> str:
        """Looks something up.

        Args:
            q: the query
        """
        return "y" * 40

    # The tiny model calls no tools: read every turn that ends as a call.
    monkeypatch.setattr(
        module, "parse_reply", lambda text: ParsedReply(content=text, calls=[ToolCall("lookup", {"q": "a"})])
    )
    loaded = load_model("builtin:tiny_moe_math")
    model = loaded.model
    per_token = KVLayout.for_model(model.args, model.dtype, 1, False).bytes_per_token
    cfg = RolloutConfig(kv_cache_bytes=(480 + 1) * per_token)
    if limit == "context":
        cfg = RolloutConfig(max_context=481)
    engine = Engine(model, tokenizer, cfg)
    holds = min(engine.max_context, engine.pool.capacity_tokens + 1)  # the most tokens a request reaches
    assert holds == 481 and (limit == "context") == (engine.max_context == holds)
    # Short turns: any token ends a turn. Long turns: the first runs until the engine can hold no more.
    stop_ids = list(range(len(tokenizer))) if turns == "short" else []
    params = SamplingParams(n=2, max_new_tokens=2000, seed=1, stop_token_ids=stop_ids, ignore_eos=True)
    rollout = MultiTurnRollout(engine, tool_agent([lookup], max_turns=50))
    out = rollout.generate([Sample(prompt="go")], params)
    for s in out:
        assert s.status == SampleStatus.TRUNCATED and "error" not in s.metadata, s.metadata
        assert len(s.prompt_ids) + len(s.response_ids) <= holds
        trained = sum(s.loss_mask)
        if turns == "short":  # a token a turn; the last turn's call was answered past the room left
            assert trained == s.metadata["turns"] == s.metadata["tool_calls"] > 1
        else:
            assert s.metadata["turns"] == 1 and trained == len(s.response_ids) == holds - len(s.prompt_ids)
    assert rollout.metrics() == {"rollout/generate_errors": 0.0} and not engine.has_unfinished
    assert_pool_clean(engine)
