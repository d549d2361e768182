"""`finetune.train` with data.task causal_lm: supervised fine-tuning of a decoder on
prompt/completion JSON lines, packed. Judged by transformers' own model: the run's validation
loss is the stock AutoModelForCausalLM's token-weighted loss over the validation examples run
one at a time (prompt tokens -100), before and after training; the saved folder loads in
AutoModelForCausalLM with every weight; the chat template renders the prompt where the
tokenizer has one; an encoder checkpoint is refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from packed_transformers.data.classification_data import ExampleError
from packed_transformers.finetune import train as finetune
from packed_transformers.finetune.causal_lm_task import encode_examples, read_prompt_completions

from ..decoder_helpers import (  # noqa: F401
    config_for,
    decoder_tokenizer,
    tiny_config,
    write_pairs,  # noqa: F401
)


def stock_validation_loss(folder, examples) -> tuple[float, list[float]]:
    """transformers' model on each example alone: token-weighted mean loss, and each example's."""
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    total, tokens, each = 0.0, 0, []
    with torch.no_grad():
        for ids, labels in zip(examples.token_ids, examples.label_ids):
            predicted = int((labels[1:] != -100).sum())
            out = stock(input_ids=torch.from_numpy(ids)[None], labels=torch.from_numpy(labels)[None])
            total, tokens = total + out.loss.item() * predicted, tokens + predicted
            each.append(out.loss.item())
    return total / tokens, each


def test_sft_run_equals_transformers_per_example_and_saves_a_causal_lm_folder(tmp_path, start_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = config_for(tmp_path, start_folder, epochs=1)
    tokenizer = AutoTokenizer.from_pretrained(start_folder)
    validation = encode_examples(
        read_prompt_completions(tmp_path / "val.jsonl", "prompt", "completion"), tokenizer, 64, "truncate"
    )
    before, _ = stock_validation_loss(start_folder, validation)
    summary = finetune.run_finetune(config, tmp_path / "run")
    assert (
        summary["task"] == "causal_lm"
        and summary["train_examples"] == 40
        and summary["validation_examples"] == 12
    )
    assert summary["validation_loss"] < before  # it learned (lr 3e-3 on a random model)
    # the run's validation loss (packed) is transformers' over the examples one at a time, after training
    after, each = stock_validation_loss(tmp_path / "run" / "model", validation)
    assert abs(summary["validation_loss"] - after) <= 1e-5
    lines = [
        json.loads(line)
        for line in (tmp_path / "run" / "validation_predictions.jsonl").read_text().splitlines()
    ]
    np.testing.assert_allclose([line["loss"] for line in lines], each, atol=1e-5)
    assert [line["tokens"] for line in lines] == [
        int((labels[1:] != -100).sum()) for labels in validation.label_ids
    ]
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert (
        AutoTokenizer.from_pretrained(tmp_path / "run" / "model")("a b")["input_ids"]
        == tokenizer("a b")["input_ids"]
    )


def test_examples_mask_the_prompt_and_follow_the_chat_template(tmp_path):
    tokenizer = decoder_tokenizer()
    examples = read_prompt_completions(write_pairs(tmp_path / "p.jsonl", 3), "prompt", "completion")
    plain = encode_examples(examples, tokenizer, 200, "truncate")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    for ids, labels, prompt, completion in zip(
        plain.token_ids, plain.label_ids, examples.prompts, examples.completions
    ):
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        # the tokenizer's leading BOS, not its trailing EOS after the prompt; EOS ends the completion
        assert ids.tolist() == [bos, *prompt_ids, *completion_ids, eos]
        assert labels.tolist() == [-100] * (1 + len(prompt_ids)) + [*completion_ids, eos]
    tokenizer.chat_template = "{% for m in messages %}<s>user: {{ m['content'] }}\n{% endfor %}assistant:"
    chat = encode_examples(examples, tokenizer, 200, "truncate")
    rendered = tokenizer(f"<s>user: {examples.prompts[0]}\nassistant:", add_special_tokens=False)["input_ids"]
    assert chat.token_ids[0].tolist()[: len(rendered)] == rendered
    assert (chat.label_ids[0][: len(rendered)] == -100).all() and chat.label_ids[0][len(rendered)] != -100
    tokenizer.chat_template = "{{ raise_exception('system turns only') }}"
    with pytest.raises(
        ExampleError, match=r"p.jsonl:1: the tokenizer's chat template cannot render this prompt"
    ):
        encode_examples(examples, tokenizer, 200, "truncate")
    tokenizer.chat_template = None
    cut = encode_examples(examples, tokenizer, 8, "truncate")
    assert cut.truncated == 3 and all(len(ids) == 8 for ids in cut.token_ids)


def test_sft_refusals_are_one_line(tmp_path, start_folder, capsys):
    from ..family_helpers import save_family_folder

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n')
    cases = {
        "completion": (["--set", f"data.train_file={bad}"], f"{bad}:1: field 'completion' is missing"),
        "encoder": (["--set", f"model.init_checkpoint={save_family_folder(tmp_path / 'enc', 'roberta', 'embedding')}"], "is an encoder"),
        "source": (["--set", "data.source=bbc_news", "--set", "data.validation_file=null"], "causal_lm reads jsonl"),
    }  # fmt: skip
    config = config_for(tmp_path, start_folder)
    path = tmp_path / "c.yaml"
    import yaml

    path.write_text(yaml.safe_dump({k: v for k, v in config.items()}))
    for name, (extra, expected) in cases.items():
        capsys.readouterr()
        code = finetune.main(["--config", str(path), "--output-dir", str(tmp_path / name), *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and expected in err[-1] and "Traceback" not in "\n".join(err), (name, err)
        assert not (tmp_path / name / "model").exists()
