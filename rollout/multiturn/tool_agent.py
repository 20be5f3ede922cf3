"""A ready generate plugin for tool use in RL (`rollout.generate_fn`, rollout.py): Python functions as tools.

    # weather_tools.py
    from miles.rollout.multiturn.tool_agent import tool_agent

    def get_weather(city: str) -> str:
        \"\"\"The weather in a city.

        Args:
            city: the city's name
        \"\"\"
        return "18 C, sunny"

    generate = tool_agent([get_weather], max_turns=4)

    miles train recipe=... rollout.generate_fn=weather_tools.py:generate

The prompt (its chat messages, or its text as one user message) is rendered with the tools by the model's
chat template (transformers' `get_json_schema` turns each function's type hints and Google-style docstring
into its schema). Each model turn runs to its end; the `<tool_call>` blocks of its text (tool_calls.py: the
format of Qwen's templates) are run, and the tool turns the template renders after the assistant's are
appended as environment tokens (`loss_mask` 0), then the model goes on, for up to `max_turns` model turns.
A tool runs in a thread (`asyncio.to_thread`) with a time limit; an unknown tool, bad arguments, an exception
or a timeout becomes the tool's answer ("error: ..."), as an agent framework would tell the model, not a
failed sample. (A sync tool past its time limit keeps its worker thread until it returns: Python cannot stop
a thread; give a tool that may hang its own timeout.) Tools are the user's own code, run in the trainer's process like reward plugins; untrusted
code belongs in the code-reward sandbox (rewards/sandbox.py), not here.

The environment's tokens are what the template adds between the conversation with the assistant's turn
and the conversation with the tool turns (and the next generation prompt): the template's rendering of the
assistant's turn itself is not used, the model's own tokens stay, so the trained tokens are exactly the
sampled ones. Where a template renders the assistant's turn differently once tool turns follow it (Qwen3's
gives a last turn without reasoning an empty thinking block, and drops it then), the environment's tokens are
what follows the turn's end-of-turn token (its last token's text) in the conversation with the tool turns. `metadata["tool_calls"]` counts the calls made, `metadata["tool_errors"]` those that failed.
Tool answers that leave no room in the context (`client.max_context`: the model's, or the engine's KV pool where
that is smaller) for another model token end the trajectory as TRUNCATED, without them: the model's turns so far
still train; so does a model turn that reaches that limit (the client caps it there).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from miles.config import DataConfig
from miles.data import PromptFormatter
from miles.rollout.multiturn.rollout import EngineClient, GenerateFn, Trajectory
from miles.rollout.multiturn.tool_calls import ToolCall, parse_reply, template_renders_tools
from miles.rollout.sampling.params import SamplingParams
from miles.sample import Sample, SampleStatus


def tool_agent(
    tools: list[Callable[..., Any]],
    max_turns: int = 4,
    tool_timeout_s: float = 30.0,
    system_prompt: str | None = None,
) -> GenerateFn:
    """A generate plugin that lets the model call `tools` (plain Python functions, sync or async, each with
    type hints and a docstring describing its arguments) for up to `max_turns` model turns. `system_prompt`
    opens a prompt that has no system message (the plugin renders the prompt itself, with the tools)."""
    from transformers.utils import get_json_schema

    if max_turns < 1 or tool_timeout_s <= 0:
        raise ValueError("tool_agent needs max_turns >= 1 and tool_timeout_s > 0")
    by_name = {tool.__name__: tool for tool in tools}
    if len(by_name) != len(tools):
        raise ValueError("tool_agent: two tools share a name")
    schemas = [get_json_schema(tool) for tool in tools]  # raises, naming what a docstring lacks
    checked: dict[int, bool] = {}
    prompts = PromptFormatter(None, DataConfig(system_prompt=system_prompt))  # its messages() only

    async def generate(client: EngineClient, sample: Sample, params: SamplingParams) -> Sample:
        tokenizer = client.tokenizer
        if not checked.setdefault(id(tokenizer), tokenizer is not None and template_renders_tools(tokenizer)):
            raise ValueError(
                "tool_agent needs a tokenizer whose chat template renders tools in the <tool_call> format "
                "(Qwen2.5, Qwen3, Hermes)"
            )
        messages = prompts.messages(sample.prompt)

        def render(conversation: list[dict[str, Any]], generation_prompt: bool) -> str:
            return tokenizer.apply_chat_template(
                conversation, tools=schemas, tokenize=False, add_generation_prompt=generation_prompt
            )

        rendered = render(messages, True)  # the conversation as the template renders it, to the next turn
        prompt = replace(sample, prompt_ids=client.encode(rendered))
        traj, calls, errors = Trajectory(prompt), 0, 0
        for _ in range(max_turns):
            turn = await client.generate(traj.ids, params)
            traj.add_turn(turn)
            reply = parse_reply(turn.response_text)
            if not reply.calls or turn.status != SampleStatus.COMPLETED:
                break  # an answer, the length cap, or the end of the context
            answers = [await _run(by_name, call, tool_timeout_s) for call in reply.calls]
            calls += len(answers)
            errors += sum(failed for _, failed in answers)
            messages.append(
                {
                    "role": "assistant",
                    "content": reply.content or "",
                    "tool_calls": [
                        {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                        for c in reply.calls
                    ],
                }
            )
            before = render(messages, False).rstrip()  # the model's turn ended with its end-of-turn token
            messages += [
                {"role": "tool", "name": c.name, "content": a} for c, (a, _) in zip(reply.calls, answers)
            ]
            after = render(messages, True)
            if after.startswith(before):
                environment = after[len(before) :]
            else:
                environment = _after_turn(after, rendered, tokenizer.decode(turn.response_ids[-1:]))
            rendered = after
            answer_ids = client.encode(environment)
            if len(traj.ids) + len(answer_ids) + 1 > client.max_context:
                # No room for another model token: the engine would refuse the next turn and that refusal
                # (ABORTED) would drop the whole trajectory from training. It ends here as a length cut,
                # without the answers: nothing after them would be trained, and the sample stays within
                # the model's context.
                traj.status = SampleStatus.TRUNCATED
                break
            traj.add_tokens(answer_ids)
        out = traj.to_sample(tokenizer)
        out.metadata.update(tool_calls=calls, tool_errors=errors)
        return out

    return generate


def _after_turn(after: str, prompt: str, end_of_turn: str) -> str:
    """The text the template puts after the model's turn in `after` (the conversation with the tool turns),
    found where the model's turn ends: at the first `end_of_turn` (the text of the turn's last token, its
    end-of-turn token) past `prompt`, the conversation before the turn. For templates that render the last
    assistant turn differently from one that tool turns follow: Qwen3's adds an empty thinking block to a
    last turn without reasoning, and leaves it out once tools answered."""
    at = after.find(end_of_turn, len(prompt)) if end_of_turn.strip() and after.startswith(prompt) else -1
    if at < 0:
        raise ValueError("the chat template renders an earlier turn differently once tools answered")
    return after[at + len(end_of_turn) :]


async def _run(tools: dict[str, Callable[..., Any]], call: ToolCall, timeout_s: float) -> tuple[str, bool]:
    """(the tool's answer as text, whether it failed)."""
    tool = tools.get(call.name)
    if tool is None:
        return f"error: no tool named {call.name!r}; the tools are {', '.join(sorted(tools))}", True
    try:
        if asyncio.iscoroutinefunction(tool):
            result = await asyncio.wait_for(tool(**call.arguments), timeout_s)
        else:
            result = await asyncio.wait_for(asyncio.to_thread(tool, **call.arguments), timeout_s)
    except TimeoutError:
        return f"error: {call.name} took longer than {timeout_s:g} s", True
    except Exception as err:  # a bad argument or the tool's own failure: the model is told, as an agent is
        return f"error: {type(err).__name__}: {err}", True
    return (result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)), False
