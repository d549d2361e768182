"""Every packed model answers its outputs as attributes, as transformers' models do."""

from __future__ import annotations

import pytest
import torch


# ----- 3. outputs as transformers returns them ------------------------------------------------------
def test_every_packed_model_answers_its_outputs_as_attributes(hub_classifier, tmp_path):
    """`model(**batch).loss` as on any transformers model (a plain dict raised AttributeError);
    an unset declared field reads None, as a ModelOutput's does; index access as to_tuple."""
    import transformers

    from packed_transformers.model.opening import ModelOptions, open_model

    from ..decoder_helpers import packed_rows, tiny_config

    config = tiny_config("llama")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    model = open_model(tmp_path / "llama", "causal_lm", ModelOptions()).model
    rows, _ = packed_rows()
    out = model.eval()(**rows, labels=rows["input_ids"])
    assert out.loss is out["loss"] and out.logits is out["logits"] and out[0] is out.loss
    trained = model.train()(**rows, labels=rows["input_ids"])  # the head only where a target is
    assert trained.logits is None and trained.loss is trained["loss"] and trained[0] is trained.loss
    assert torch.isfinite(out.loss)
    assert model(**rows).loss is None
    with pytest.raises(AttributeError, match="has no output 'lossy'"):
        out.lossy  # noqa: B018
    bert = open_model(hub_classifier, "classification", ModelOptions()).model
    head_out = bert(**{**rows, "input_ids": rows["input_ids"] % 50})
    assert head_out.logits is head_out["logits"] and head_out.loss is None
