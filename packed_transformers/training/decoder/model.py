"""A decoder family's causal LM on packed rows, from a config (random init) or a folder.

The model is transformers' own AutoModelForCausalLM of the family, its attention routed
through model.families' packed attention (each row's sequences attend only inside
themselves; by length buckets, cost about the sum of l_i^2), wrapped as model.family_model's
PackedCausalLM: the per-document next-token loss of packed rows equals each document run
alone through transformers (tests/model/test_decoders.py, tests/training/test_decoder_pretraining.py).
"""

from __future__ import annotations

import contextlib
import textwrap
from pathlib import Path

import torch

from packed_transformers.components.errors import RunError

GRANULARITY = {"auto": None, "mask": 0}  # model.attention -> PackedLayout.granularity (buckets: by S)


def family_settings(model: dict, vocab_size: int, length: int) -> dict:
    """transformers config settings of the family's shape (GPT-2 names its own)."""
    if model["family"] == "gpt2":
        return dict(vocab_size=vocab_size, n_embd=model["hidden_size"], n_layer=model["num_hidden_layers"],
                    n_head=model["num_attention_heads"], n_inner=model["intermediate_size"], n_positions=length,
                    bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    # (no dropout: LLM pretraining runs without it, as Llama's configs do)
    settings = dict(vocab_size=vocab_size, hidden_size=model["hidden_size"],
                    intermediate_size=model["intermediate_size"], num_hidden_layers=model["num_hidden_layers"],
                    num_attention_heads=model["num_attention_heads"],
                    num_key_value_heads=model["num_key_value_heads"], max_position_embeddings=length,
                    tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    return settings


def set_rope_theta(family_config, theta: float) -> None:
    """The rotary base, where the family has one base for every layer (Gemma 3's per-layer-type
    bases and GPT-2's learned positions keep the family's own)."""
    rope = getattr(family_config, "rope_parameters", None)
    if (
        isinstance(rope, dict)
        and "rope_theta" in rope
        and not any(isinstance(v, dict) for v in rope.values())
    ):
        rope["rope_theta"] = theta


# Bytes a parameter costs in training: fp32 weight, gradient and AdamW's two moments.
TRAINING_BYTES_PER_PARAMETER = 16


def check_training_memory(
    hf_config, device: torch.device, shards: int = 1, bytes_per_parameter: int = TRAINING_BYTES_PER_PARAMETER
) -> None:
    """RunError unless the model's weights, gradients and AdamW state (fp32; a 1/shards share
    of each under FSDP2; bytes_per_parameter 4: the weights alone) fit the device's memory: counted on the meta device (nothing
    allocated), against the memory available now (a CPU) or the GPU's total. Activations come
    on top: this refuses what cannot fit at all (`--plan` counts them)."""
    import psutil
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_config)
    parameters = sum(p.numel() for p in meta.parameters())
    needed = -(-parameters // shards) * bytes_per_parameter
    if device.type == "cuda":
        have, where = torch.cuda.get_device_properties(device).total_memory, f"{device} holds"
    else:
        have, where = psutil.virtual_memory().available, "this machine has"
    if needed > have:
        share = f" (a 1/{shards} share under execution.sharding fsdp)" if shards > 1 else ""
        raise RunError(
            f"model: {parameters:,} parameters (vocab_size {hf_config.vocab_size}) need {needed / 2**30:.1f} GiB "
            f"for {'weights, gradients and AdamW state' if bytes_per_parameter == TRAINING_BYTES_PER_PARAMETER else 'its weights'} "
            f"in fp32{share}; {where} {have / 2**30:.1f} GiB"
        )


def decoder_folder_config(folder: Path) -> dict:
    """`folder`'s config.json, read once (model.opening.read_model_config) and handed on to the
    loader; RunError (one line) unless it names a decoder family this run trains: a BERT
    folder is named as such, not as a missing head cut off mid-word."""
    from packed_transformers.model.opening import read_model_config
    from packed_transformers.training.decoder.config import DECODER_FAMILIES

    if not (folder / "config.json").is_file():
        raise RunError(f"model.init_checkpoint {folder}: no config.json (a transformers causal-LM folder)")
    config = read_model_config(folder)  # {} where it is not a readable JSON object
    model_type = config.get("model_type")
    if model_type not in DECODER_FAMILIES:
        raise RunError(
            f"model.init_checkpoint {folder}: its config.json says model_type {model_type!r}, not a decoder "
            f"family this run trains ({', '.join(DECODER_FAMILIES)})"
        )
    return config


def build_decoder(config: dict, vocab_size: int, length: int, data_vocab: int, device=None, shards: int = 1,
                  meta: bool = False, weights_only: bool = False):  # fmt: skip
    """PackedCausalLM of config["model"] (seeded by training.seed). vocab_size: the model's
    (model.vocab_size, else the data's); data_vocab: the rows' vocabulary, which the model
    must cover whether it comes from the config or a checkpoint; device: where it will train
    (its memory checked before anything is allocated, a 1/shards share of the model's state
    under FSDP2); meta: built on the meta device, nothing allocated (a random init only: the
    sharded run materializes it, components.sharding.materialize_sharded); weights_only: the
    memory check counts its weights alone (rank 0's whole copy for that, which never trains)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from packed_transformers.model.families import PACKED_ATTENTION, _register_packed_attention
    from packed_transformers.model.family_model import PackedCausalLM, PackedFamilyModel
    from packed_transformers.model.opening import check_finite_weights

    model_cfg = config["model"]
    torch.manual_seed(config["training"]["seed"])
    if model_cfg["init_checkpoint"] is not None:
        folder = Path(model_cfg["init_checkpoint"])
        config_dict = decoder_folder_config(folder)
        try:
            packed = PackedFamilyModel.from_pretrained(folder, "causal_lm", config_dict=config_dict)
            check_finite_weights(folder, packed)  # the door's check: a NaN start trains nothing
        except (OSError, ValueError, RuntimeError) as err:
            reason = textwrap.shorten(str(err), 300, placeholder=" ...")  # cut between words
            raise RunError(f"model.init_checkpoint {folder}: cannot be loaded ({reason})") from None
    else:
        if model_cfg["num_attention_heads"] % model_cfg["num_key_value_heads"]:
            raise RunError("model.num_attention_heads must be a multiple of model.num_key_value_heads")
        if model_cfg["hidden_size"] % model_cfg["num_attention_heads"]:
            raise RunError("model.hidden_size must be a multiple of model.num_attention_heads")
        family_config = AutoConfig.for_model(
            model_cfg["family"], **family_settings(model_cfg, vocab_size, length)
        )
        set_rope_theta(family_config, model_cfg["rope_theta"])
        if vocab_size < data_vocab:
            raise RunError(
                f"model.vocab_size {vocab_size}: below the rows' vocabulary of {data_vocab} tokens "
                "(vocab_size in data.train_dir's metadata.json)"
            )
        state_bytes = 4 if weights_only else TRAINING_BYTES_PER_PARAMETER
        check_training_memory(family_config, torch.device(device or "cpu"), shards, state_bytes)
        _register_packed_attention()
        with torch.device("meta") if meta else contextlib.nullcontext():
            hf_model = AutoModelForCausalLM.from_config(family_config, attn_implementation=PACKED_ATTENTION)
        packed = PackedCausalLM(hf_model, "causal_lm")
    if packed.config.vocab_size < data_vocab:
        raise RunError(
            f"data.train_dir: the rows use a vocabulary of {data_vocab} tokens, the model has {packed.config.vocab_size}"
        )
    choice = model_cfg["attention"]
    packed.attention_granularity = GRANULARITY.get(choice, None)
    if choice == "buckets":
        from packed_transformers.model.causal_buckets import bucket_granularity

        packed.attention_granularity = bucket_granularity(length)
    return packed
