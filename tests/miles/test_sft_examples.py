"""SFT's training samples (miles/sft/examples.py) against transformers' assistant-token mask (what TRL's SFTTrainer
trains with `assistant_only_loss`), its cut of over-long examples, and the packed micro-batches
(trainer/packing.py) it and the RL update train on."""

from __future__ import annotations

import pytest
import torch

from miles.config import DataConfig
from miles.data import PromptFormatter
from miles.models.tokenizer import CHAT_TEMPLATE, END_OF_TEXT, char_tokenizer
from miles.sample import Sample
from miles.sft.examples import fit_context, sft_samples

# The character tokenizer's chat template with transformers' generation tags around what the assistant
# writes: its content and the end-of-turn token, not the newline after it (as TRL's patched templates).
TAGGED_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def base_model_tokenizer():
    """The character tokenizer as a base model's: eos is `<|endoftext|>`, and the chat template ends an
    assistant turn with `<|im_end|>` (as Qwen3-Base, Llama-3 base with its instruct template)."""
    tokenizer = char_tokenizer()
    tokenizer.eos_token = END_OF_TEXT
    return tokenizer


def assistant_tokens(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """transformers' tokens of the whole conversation and its assistant mask (the tagged template renders
    the same text as the plain one)."""
    tagged = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=TAGGED_TEMPLATE)
    assert tagged == tokenizer.apply_chat_template(messages, tokenize=False, chat_template=CHAT_TEMPLATE)
    out = tokenizer.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        chat_template=TAGGED_TEMPLATE,
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def expected_sample(tokenizer, messages: list[dict]) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, response ids, loss mask): the prompt is everything before the first assistant token, the
    response runs to the last one."""
    ids, mask = assistant_tokens(tokenizer, messages)
    first = mask.index(1)
    last = len(mask) - mask[::-1].index(1)
    return ids[:first], ids[first:last], mask[first:last]


def prompt_sample(formatter: PromptFormatter, prompt, label=None, **metadata) -> Sample:
    return Sample(prompt=prompt, prompt_ids=formatter.ids(prompt), label=label, metadata=dict(metadata))


def test_the_response_is_the_assistant_turn_through_its_end_of_turn_token() -> None:
    """With a chat template the response is what the template writes for the assistant, through its
    end-of-turn token `<|im_end|>`, even where the tokenizer's eos is another token: before, SFT appended
    eos (`<|endoftext|>`, id 2) after the solution, a token the template never writes in a turn."""
    tokenizer = base_model_tokenizer()
    formatter = PromptFormatter(tokenizer, DataConfig())
    solution = "12+7=19 #### 19"
    sample = prompt_sample(formatter, "Tom has 12 apples and gets 7.", "19", solution=solution)
    (trained,) = sft_samples([sample], tokenizer, tokenizer.eos_token_id, formatter)
    messages = [
        {"role": "user", "content": "Tom has 12 apples and gets 7."},
        {"role": "assistant", "content": solution},
    ]
    prompt, response, mask = expected_sample(tokenizer, messages)
    assert trained.prompt_ids == prompt
    assert tokenizer.decode(trained.response_ids) == solution + "<|im_end|>"
    assert trained.response_ids == response and trained.loss_mask == mask == [1] * len(response)
    # A system prompt stays in the prompt.
    formatter = PromptFormatter(tokenizer, DataConfig(system_prompt="Be brief."))
    sample = prompt_sample(formatter, "2+3?", "5", response="5")
    (trained,) = sft_samples([sample], tokenizer, tokenizer.eos_token_id, formatter)
    system = [{"role": "system", "content": "Be brief."}]
    messages = [*system, {"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]
    assert (trained.prompt_ids, trained.response_ids, trained.loss_mask) == expected_sample(
        tokenizer, messages
    )


def test_without_a_chat_template_the_response_ends_with_eos() -> None:
    tokenizer = base_model_tokenizer()
    formatter = PromptFormatter(tokenizer, DataConfig(prompt_template="Q: {prompt}\nA: "))
    sample = prompt_sample(formatter, "2+3?", "5")
    (trained,) = sft_samples([sample], tokenizer, tokenizer.eos_token_id, formatter)
    assert trained.prompt_ids == tokenizer("Q: 2+3?\nA: ", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(trained.response_ids) == "#### 5" + END_OF_TEXT
    assert trained.loss_mask == [1] * len(trained.response_ids)
    # A conversation: its last message answers the ones before it.
    conversation = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]
    (trained,) = sft_samples([prompt_sample(formatter, conversation)], tokenizer, 2, formatter)
    assert trained.prompt_ids == tokenizer("Q: 2+3?\nA: ", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(trained.response_ids) == "5" + END_OF_TEXT


@pytest.mark.parametrize("system", [False, True])
def test_a_conversation_trains_every_assistant_turn(system: bool) -> None:
    """A row whose messages end with the assistant's turn (TRL's conversational format) trains each
    assistant turn, through its end-of-turn token, and nothing the user wrote: the tokens and mask of
    transformers' `return_assistant_tokens_mask`. Before, the whole conversation became the prompt, a new
    assistant turn was opened after it and `#### <label>` was trained there."""
    tokenizer = base_model_tokenizer()
    formatter = PromptFormatter(tokenizer, DataConfig(system_prompt="Be brief." if system else None))
    conversation = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "2+3=5"},
        {"role": "user", "content": "And times 4?"},
        {"role": "assistant", "content": "5*4=20 #### 20"},
    ]
    sample = prompt_sample(formatter, conversation, label="20")
    (trained,) = sft_samples([sample], tokenizer, tokenizer.eos_token_id, formatter)
    messages = formatter.messages(conversation)
    assert (trained.prompt_ids, trained.response_ids, trained.loss_mask) == expected_sample(
        tokenizer, messages
    )
    kept = [t for t, m in zip(trained.response_ids, trained.loss_mask) if m]
    assert tokenizer.decode(kept) == "2+3=5<|im_end|>5*4=20 #### 20<|im_end|>"
    assert trained.label == "20"


def test_examples_longer_than_the_context_keep_their_prompt_and_lose_the_response_s_end() -> None:
    """An example whose prompt and response exceed the model's context is cut at the context (the
    response's end goes, as TRL's keep_start truncation; the prompt stays whole), one whose prompt alone
    fills it is left out; both are counted. Before, SFT trained on positions past the model's context."""
    short = Sample(prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[1, 1])
    long = Sample(prompt_ids=[1, 2, 3], response_ids=list(range(10, 20)), loss_mask=[1, 0] * 5)
    full = Sample(prompt_ids=list(range(8)), response_ids=[3])
    kept, metrics = fit_context([short, long, full], context_length=8)
    assert [(s.prompt_ids, s.response_ids, s.loss_mask) for s in kept] == [
        ([1, 2], [3, 4], [1, 1]),
        ([1, 2, 3], [10, 11, 12, 13, 14], [1, 0, 1, 0, 1]),
    ]
    assert metrics == {"data/sft_truncated_responses": 1.0, "data/sft_dropped_examples": 1.0}
    assert long.response_ids == list(range(10, 20))  # the caller's sample is not changed
    assert fit_context([short], context_length=8)[1] == {
        "data/sft_truncated_responses": 0.0,
        "data/sft_dropped_examples": 0.0,
    }


def test_the_sft_loss_is_the_token_mean_nll_of_the_assistant_tokens_over_micro_batches() -> None:
    """sft_step's gradient over packed micro-batches is the gradient of the mean NLL over every loss token of
    the step (prompt and masked tokens excluded), written out by hand from one unpacked forward a sample."""
    import torch.nn.functional as F

    from miles.config import AlgorithmConfig, OptimConfig, TrainerConfig
    from miles.models import CausalLM, ModelArgs
    from miles.trainer import PolicyTrainer

    args = dict(vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=2)
    model = CausalLM(ModelArgs(model_type="llama", num_attention_heads=2, num_key_value_heads=1, **args))
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    samples = []
    for i in range(6):
        p, r = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 8, (1,), generator=g))
        mask = torch.randint(0, 2, (r,), generator=g).tolist() if i % 2 else [1] * r
        samples.append(
            Sample(
                prompt_ids=torch.randint(0, 24, (p,), generator=g).tolist(),
                response_ids=torch.randint(0, 24, (r,), generator=g).tolist(),
                loss_mask=mask,
            )
        )
    total, count = 0.0, 0
    for s in samples:
        logits = model(torch.tensor([s.prompt_ids + s.response_ids]))[0]
        p = len(s.prompt_ids)
        nll = F.cross_entropy(
            logits[p - 1 : p - 1 + len(s.response_ids)], torch.tensor(s.response_ids), reduction="none"
        )
        total = total + (nll * torch.tensor(s.loss_mask, dtype=torch.float32)).sum()
        count += sum(s.loss_mask)
    (total / count).backward()
    total = total.detach()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    cfg = TrainerConfig(optim=OptimConfig(grad_clip=0.0), micro_batch_tokens=8)
    trainer = PolicyTrainer(model, cfg, AlgorithmConfig(name="sft", policy_loss="sft", tis=False), 1.0)
    kept = {}
    step = trainer.optimizer.step

    def keep(*a, **k):
        kept.update(
            {
                trainer._names[id(t)]: t.grad.clone()
                for g in trainer.optimizer.param_groups
                for t in g["params"]
            }
        )
        return step(*a, **k)

    trainer.optimizer.step = keep
    metrics = trainer.sft_step(samples)
    assert metrics["train/loss"] == pytest.approx((total / count).item(), rel=1e-5)
    for name, grad in expected.items():
        torch.testing.assert_close(kept[name], grad, atol=1e-6, rtol=1e-4)


def test_an_sft_run_trains_conversations_and_reports_what_it_cut(tmp_path) -> None:
    """`recipe=sft_math` on a file with a prompt / response row, a conversation and a response longer than
    the model's context (1024 tokens): it trains, and the first record counts the cut response."""
    import json

    from tests.support.cli import run_miles

    rows = [
        {"prompt": "What is 2+3?", "response": "2+3=5 #### 5", "label": "5"},
        {
            "prompt": [
                {"role": "user", "content": "What is 2+3?"},
                {"role": "assistant", "content": "2+3=5"},
                {"role": "user", "content": "And times 4?"},
                {"role": "assistant", "content": "5*4=20 #### 20"},
            ],
            "label": "20",
        },
        {"prompt": "Count.", "response": "1 " * 700, "label": "1"},
    ]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    out = run_miles(
        tmp_path,
        "recipe=sft_math",
        f"data.path={data}",
        "trainer.max_steps=1",
        "trainer.eval_every=0",
        "trainer.save_final=false",
        "trainer.sft_batch_size=3",
        run_dir=run,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert record["data/sft_truncated_responses"] == 1.0 and record["data/sft_dropped_examples"] == 0.0
    assert record["data/dropped_prompts"] == 0.0
    assert record["train/loss"] > 0 and record["train/response_tokens"] > 1024 - 10


def test_the_end_of_turn_token_becomes_a_stop_and_the_model_s_eos() -> None:
    """A base model SFT'd with a chat template ends its turns with `<|im_end|>`: the eval's stops and the
    model's eos_token_id (its checkpoints' config.json, which later runs read their stops from) gain it."""
    from miles.models import ModelArgs
    from miles.sft.examples import end_of_turn_stops

    tokenizer = base_model_tokenizer()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    args = ModelArgs(eos_token_id=2)
    stops = end_of_turn_stops(PromptFormatter(tokenizer, DataConfig()), args, [2])
    assert stops == [2, im_end] and args.eos_token_ids == [2, im_end]
    args = ModelArgs(eos_token_id=2)  # a plain prompt template: eos ends the response, nothing changes
    formatter = PromptFormatter(tokenizer, DataConfig(prompt_template="{prompt}"))
    assert end_of_turn_stops(formatter, args, [2]) == [2] and args.eos_token_ids == [2]


def test_packed_positions_targets_and_masks_line_up_per_sequence() -> None:
    """Each packed sequence's positions restart at 0, its first response token is predicted from its last
    prompt row and its last from its last fed row, its loss mask splits back out with its tokens; a sequence
    over the token budget gets a micro-batch alone; an empty response is refused."""
    from miles.trainer.packing import pack, validate_sample

    a = Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5], loss_mask=[1, 0])
    b = Sample(prompt_ids=[6], response_ids=[7, 8, 9])
    c = Sample(prompt_ids=[1] * 9, response_ids=[2, 3])  # 10 fed tokens, over the budget of 8
    one, alone = pack([a, b, c], [0, 1, 2], 8, torch.device("cpu"))
    assert one.sample_ids == [0, 1] and alone.sample_ids == [2]
    assert one.input_ids.tolist() == [1, 2, 3, 4, 6, 7, 8]
    assert one.positions.tolist() == [0, 1, 2, 3, 0, 1, 2] and one.cu_seqlens == [0, 4, 7]
    assert one.target_rows.tolist() == [2, 3, 4, 5, 6] and one.targets.tolist() == [4, 5, 7, 8, 9]
    assert [t.tolist() for t in one.per_sample(one.targets)] == [[4, 5], [7, 8, 9]]
    assert alone.num_tokens == 10 and alone.target_rows.tolist() == [8, 9]
    with pytest.raises(ValueError, match="no response_ids"):
        validate_sample(Sample(prompt_ids=[1], response_ids=[]), 0)


def test_rl_prompts_in_a_chat_template_stop_at_its_end_of_turn_token() -> None:
    """A base model's eos (`<|endoftext|>`) is not where a ChatML assistant turn ends: the loop's stop ids take
    the template's end-of-turn token too, and only where prompts are chat-formatted."""
    from miles.build import stop_ids

    tokenizer = base_model_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end != tokenizer.eos_token_id
    assert stop_ids(tokenizer, [], PromptFormatter(tokenizer, DataConfig())) == sorted(
        {tokenizer.eos_token_id, end}
    )
    plain = PromptFormatter(tokenizer, DataConfig(prompt_template="{prompt}"))
    assert stop_ids(tokenizer, [], plain) == stop_ids(tokenizer, []) == [tokenizer.eos_token_id]
