"""The packed family models (model/families.py's rows put to work): transformers' task model
of a folder run on packed rows, a PreTrainedModel so that `Trainer` takes it. Imported only
where a non-BERT folder is opened (model.families names them lazily): transformers'
modeling_utils costs seconds of start-up that a BERT folder's command does not pay.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import torch
from transformers import PreTrainedModel

from packed_transformers.model.embedding import check_pooling, pool_slots
from packed_transformers.model.families import (
    DROPOUT_KEYS,
    PACKED_ATTENTION,
    TASK_CLASSES,
    PackedLayout,
    _register_packed_attention,
    causal_lm_outputs,
    family_of,
    mask_stand_in,
    max_tokens,
    next_token_targets,
    padding_index,
    predicted_token_outputs,
    tokenizer_hands_token_types,
)
from packed_transformers.model.hf_checkpoint import load_checked
from packed_transformers.model.outputs import PackedOutput
from packed_transformers.model.packed_rows import TRAINER_IGNORED_OUTPUTS, SlotRows
from packed_transformers.model.task_heads import classification_outputs, span_outputs, token_outputs


class PackedFamilyModel(PreTrainedModel):
    """A transformers task model (`hf_model`) run on packed rows; see the module docstring.

    task: "classification" | "token_classification" | "question_answering" | "embedding";
    pooling (embedding): sentence-transformers' modes, as model/embedding.py's.

    A PreTrainedModel, as the packed BERT heads are, so that transformers' `Trainer` takes
    it over `hf_integration.trainer.pack_dataset`'s packs: it accepts Trainer's `num_items_in_batch`,
    its outputs come in the order `hf_integration.trainer.packed_metrics` reads, `save_pretrained`
    writes the task model's own folder (Auto classes load it) and `load_state_dict` takes
    that folder's names back (Trainer's resume from a checkpoint)."""

    accepts_loss_kwargs = True

    def __init__(self, hf_model, task: str, pooling=("mean",)):
        # A config of its own: PreTrainedModel's init rewrites the attention implementation
        # of the config it is given, and the encoder's must stay "packed".
        config = copy.deepcopy(hf_model.config)
        config._attn_implementation_internal = None
        super().__init__(config)
        config.keys_to_ignore_at_inference = TRAINER_IGNORED_OUTPUTS
        self.hf_model, self.task = hf_model, task
        self.family = family_of(self.config.model_type)
        self.base = hf_model if task == "embedding" else hf_model.base_model
        self.pooling = check_pooling(list(pooling)) if task == "embedding" else ()
        takes = inspect.signature(self.base.forward).parameters
        type_vocabulary = getattr(self.config, "type_vocab_size", None)
        self._token_types = "token_type_ids" in takes and (type_vocabulary or 0) > 1
        # GPT-2 has no token-type table: token_type_ids, where its tokenizer hands them (a BERT
        # tokenizer over GPT-2 weights), are embedded with the token table; None adds nothing.
        # Whether they are given is the tokenizer's to say (hand_token_types).
        self._token_types_optional = "token_type_ids" in takes and type_vocabulary is None
        self._has_position_ids = "position_ids" in takes
        self._has_attention_mask = "attention_mask" in takes
        self._has_use_cache = "use_cache" in takes  # decoders: no key/value cache over packed rows
        # Attention by length buckets (model.causal_buckets) or through the row's mask:
        # None chooses by the row length; an int forces buckets of that granularity, 0 the mask.
        self.attention_granularity: int | None = None

    @property
    def dimension(self) -> int:
        return self.config.hidden_size * len(self.pooling)

    def hand_token_types(self, given: bool) -> PackedFamilyModel:
        """Whether the tokenizer hands token_type_ids, for a family that adds them only when
        given (GPT-2): then the rows' segment ids are passed, as transformers is given them."""
        if self._token_types_optional:
            self._token_types = bool(given)
        return self

    @property
    def max_tokens(self) -> int:
        """The longest sequence its positions take (RoBERTa-style: 2 fewer than the table)."""
        return max_tokens(self.config)

    @classmethod
    def from_pretrained(
        cls,
        folder,
        task: str,
        pooling=("mean",),
        dropout: dict | None = None,
        new_head: bool = False,
        config_dict=None,
        token_types: bool | None = None,
        **options,
    ):
        """Load `folder` with transformers' Auto class of the task (never with remote code).
        options: config settings (num_labels, id2label, problem_type, ...); dropout:
        {"hidden", "attention", "classifier"} probabilities, set on whichever of the
        family's config keys name them (DROPOUT_KEYS); config_dict: config.json as already
        read (None: read here), built as AutoConfig builds it from the file; token_types:
        whether the folder's tokenizer hands token_type_ids, where the caller built it (None:
        transformers' tokenizer of the folder is asked here)."""
        import transformers
        from transformers import CONFIG_MAPPING, AutoConfig

        if config_dict and config_dict.get("model_type") in CONFIG_MAPPING:
            config = CONFIG_MAPPING[config_dict["model_type"]].from_dict(dict(config_dict), **options)
        else:
            config = AutoConfig.from_pretrained(folder, trust_remote_code=False, **options)
        family = family_of(config.model_type)
        for what, value in (dropout or {}).items():
            for key in DROPOUT_KEYS[what]:
                if hasattr(config, key):  # set on the config: a key the family does not read is inert
                    setattr(config, key, value)
        loading = {}
        if family.pair_mask is None:
            _register_packed_attention()
            loading["attn_implementation"] = PACKED_ATTENTION
        auto = getattr(transformers, TASK_CLASSES[task])
        # strictly (load_checked): new_head=True where fine-tuning (or embedding) needs no head from the file
        hf_model, _ = load_checked(
            auto, Path(folder), new_head, config=config, trust_remote_code=False, **loading
        )
        packed = (PackedCausalLM if task == "causal_lm" else cls)(hf_model, task, pooling)
        if token_types is None and packed._token_types_optional:
            token_types = tokenizer_hands_token_types(folder, config=config)
        return packed.hand_token_types(packed._token_types_optional and bool(token_types))

    # ----- the encoder --------------------------------------------------------------------
    def encode(self, input_ids, segment_ids, position_ids, sequence_ids) -> torch.Tensor:
        """Packed rows -> the family's last hidden states [B, S, H]."""
        if self.family.pair_mask is not None:
            arguments = self.packed_arguments(input_ids, segment_ids, position_ids, sequence_ids)
            allowed = PackedLayout(sequence_ids, position_ids, {}).allowed()[:, 0]
            return self.family.pair_mask(self, arguments, sequence_ids != 0, allowed)
        arguments = self.packed_arguments(input_ids, segment_ids, position_ids, sequence_ids)
        return self.base(**arguments).last_hidden_state

    def packed_arguments(self, input_ids, segment_ids, position_ids, sequence_ids) -> dict:
        """The keywords the family's base model takes for packed rows (all [B, S]): its
        positions (RoBERTa-style offset where the family numbers them so), token types where
        it reads them, and, for attention through packed_attention, the layout and the 4-D
        mask stand-in (a pair-mask family gets only the first three: its encoder is run by
        the family's pair_mask function)."""
        real = sequence_ids != 0
        positions = position_ids
        if self.family.positions_after_padding:
            pad = padding_index(self.config.model_type, self.config.pad_token_id)
            positions = torch.where(real, position_ids + pad + 1, torch.full_like(position_ids, pad))
        arguments = {"input_ids": input_ids}
        if self._has_position_ids:
            arguments["position_ids"] = positions
        if self._token_types:
            arguments["token_type_ids"] = segment_ids
        if self.family.pair_mask is not None:
            return arguments
        arguments["packed_layout"] = PackedLayout(sequence_ids, position_ids, {}, self.attention_granularity)
        if self._has_attention_mask:  # attention is confined by the packed layout: no mask built
            arguments["attention_mask"] = mask_stand_in(input_ids)
        if self._has_use_cache:
            arguments["use_cache"] = False
        return arguments

    # ----- the forward ----------------------------------------------------------------------
    @property
    def multi_label(self) -> bool:
        return self.config.problem_type == "multi_label_classification"

    def forward(
        self, input_ids, segment_ids, position_ids, sequence_ids, cls_positions, example_index, labels=None,
        num_items_in_batch=None, **unused,
    ):  # fmt: skip
        """Rows -> the task's outputs, as the packed BERT heads give them (model/
        classification.py, question_answering.py, token_classification.py): with labels also
        the loss (over Trainer's num_items_in_batch where given), per-example losses and
        metric sums. labels: [B, K] class ids or [B, K, C] multi-hot; [B, K, 2] spans; [B, S]
        token labels (-100: none). (causal_lm: PackedCausalLM.forward.)"""
        hidden = self.encode(input_ids, segment_ids, position_ids, sequence_ids)
        rows = SlotRows(sequence_ids, cls_positions, example_index)
        if self.task == "embedding":
            embeddings = pool_slots(hidden, rows, self.pooling)
            return PackedOutput(embeddings=embeddings, present=rows.present, example_index=example_index)
        if self.task == "classification":
            logits = self._classify(hidden, rows)
            return classification_outputs(logits, rows, labels, num_items_in_batch, self.multi_label)
        logits = self._per_token(hidden)
        if self.task == "token_classification":
            return token_outputs(logits, rows, labels, num_items_in_batch)
        start_logits, end_logits = logits[..., 0].float(), logits[..., 1].float()
        return span_outputs(start_logits, end_logits, rows, labels, num_items_in_batch)

    def _lm_logits(self, hidden):
        """[B, S, V]: the family's LM head (with Gemma's final logit soft-capping where set)."""
        logits = self.hf_model.get_output_embeddings()(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _per_token(self, hidden):
        return self.family.read_tokens(self.hf_model, hidden, self.task)

    def _classify(self, hidden, rows: SlotRows):
        """[B, K, C]: each slot's sequence read as the family's classification head reads it."""
        b, k = rows.cls_positions.shape
        first = hidden.gather(1, rows.cls_positions[..., None].expand(b, k, hidden.shape[-1]))  # [B, K, H]
        features = first.reshape(b * k, 1, -1)  # heads that take features read [:, 0]
        return self.family.read_sequence(self, hidden, rows, features).reshape(b, k, -1)

    # ----- Hugging Face folders and Trainer ------------------------------------------------
    def save_pretrained(self, folder, **trainer_options) -> None:
        """transformers' folder of the task model (its Auto class loads it as is), written
        atomically (model.hf_checkpoint.save_folder). Trainer's options (state_dict,
        safe_serialization, ...) are accepted; the weights saved are the model's."""
        from packed_transformers.model.hf_checkpoint import save_folder

        save_folder(self.hf_model, folder)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """A state dict in the task model's own names (what save_pretrained wrote, and what
        Trainer's resume reads back, asking for strict=False) loads into it strictly: a
        missing or unexpected weight is an error, never a silently fresh layer."""
        if state_dict and not any(name.startswith("hf_model.") for name in state_dict):
            return self.hf_model.load_state_dict(state_dict, strict=True, assign=assign)
        return super().load_state_dict(state_dict, strict, assign)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        """TrainingArguments(gradient_checkpointing=True) reaches the family's own layers."""
        self.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs)


class PackedCausalLM(PackedFamilyModel):
    """A decoder's causal LM on packed rows (PackedFamilyModel.from_pretrained(folder,
    "causal_lm")). Its own forward signature: transformers' Trainer reads a model's label
    columns from it (every parameter naming "label"), and only this task has `shift_labels`."""

    def forward(
        self, input_ids, segment_ids, position_ids, sequence_ids, cls_positions=None, example_index=None,
        labels=None, shift_labels=None, num_items_in_batch=None, skip_logits: bool | None = None, **unused,
    ):  # fmt: skip
        """Rows -> {"logits" [B, S, V]} and, with labels ([B, S] token labels, -100 where not
        predicted) or shift_labels ([B, S] next-token targets inside each sequence, as
        hf_integration.trainer.pack_dataset writes them), the loss (causal_lm_outputs).

        skip_logits (None: in training mode with targets, as Liger Kernel's causal LMs
        decide it, except under torch.compile): the LM head runs only on the tokens that
        have a target, and the outputs hold the loss and {"predicted_logits" [N, V],
        "predicted_targets" [N]} with no [B, S, V] logits (`out.logits` is None;
        predicted_token_outputs). skip_logits=False keeps them. A compiled step keeps them
        too: N changes every batch, and a graph of fixed shapes is what compiling is for."""
        hidden = self.encode(input_ids, segment_ids, position_ids, sequence_ids)
        if shift_labels is None and labels is not None:
            shift_labels = next_token_targets(labels, sequence_ids)
        if skip_logits is None:
            skip_logits = self.training and shift_labels is not None and not torch.compiler.is_compiling()
        if skip_logits:
            if shift_labels is None:
                raise ValueError(
                    "skip_logits=True needs labels or shift_labels: the head runs only where a target is"
                )
            return predicted_token_outputs(hidden, shift_labels, self._lm_logits, num_items_in_batch)
        return causal_lm_outputs(self._lm_logits(hidden), shift_labels, num_items_in_batch)
