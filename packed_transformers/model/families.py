"""Packed encoders of other families, on transformers' own modules: RoBERTa, XLM-RoBERTa,
CamemBERT, DistilBERT, ELECTRA, ModernBERT, NomicBERT, DeBERTa-v2/v3, MPNet (and BERT), and
packed decoders: Llama, Mistral, Qwen2, Qwen3, Gemma 3 (text), Phi-3, GPT-2 (docs/decoders.md).

    model = PackedFamilyModel.from_pretrained(folder, task="classification")
    out = model(**rows)            # packs.rows.pack_rows' fields as tensors
    out["logits"]                  # [B, K, C] | token tasks: [B, S, C] | QA: start/end [B, S]
    out["embeddings"]              # task "embedding": pooled per slot, [B, K, D]
    # causal_lm: out["logits"] [B, S, V]; in training with labels the head runs only on the
    # predicted tokens: out["predicted_logits"] [N, V], out["predicted_targets"] [N]

The weights are transformers' (`AutoModelFor*` loads and saves the folder as is); packing
changes only what the encoder is given, by each family's rule (`FAMILIES`):

- positions restart in every sequence, at the family's first position (RoBERTa-style
  families number from `pad_token_id + 1`; rotary families from 0);
- attention stays inside each sequence: families that call transformers' AttentionInterface
  run `packed_attention` (registered as "packed"): one SDPA call with the block-diagonal
  mask built once per forward from `sequence_ids` (ModernBERT's local layers also keep
  their sliding window, measured in positions inside the sequence). DeBERTa-v2 and MPNet
  compute relative-position attention of their own and take a [B, S, S] mask instead;
  their relative positions (i - j) inside a sequence are the same packed or not;
- token type ids only where the family has more than one type;
- decoders: causal attention inside each sequence (its sliding window inside it too), the
  causal-LM loss predicting t + 1 from t only inside the sequence (`next_token_targets`),
  classification from the sequence's last token, no key/value cache.

A family is one row of `FAMILIES` (`Family`: every choice a value or a function: the
classification read-out, the token head, the pair mask of families with attention of their
own, the padding index); no code names a family.

The heads read each sequence as the family's own head does ([CLS] through the pooler or
the head's dense layer; ModernBERT's mean pooling over the sequence's own tokens). Outputs
follow the packed heads' contract (model/packed_head.py) so that inference.runner, the
server and the embeddings run them unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from packed_transformers.model.embedding import pool_slots
from packed_transformers.model.outputs import PackedOutput
from packed_transformers.model.varlen import allowed_pairs

PACKED_ATTENTION = "packed"


# ----- each family's pieces: how its head reads a sequence, its tokens, its pair mask ----------------
def read_through_pooler(model, hidden, rows, features):
    """BERT, NomicBERT: the pooler over the first token, dropout, classifier."""
    m = model.hf_model
    return m.classifier(m.dropout(model.base.pooler(features)))


def read_features(model, hidden, rows, features):
    """RoBERTa-style heads, ELECTRA, MPNet: the head takes the hidden states, reads [:, 0]."""
    return model.hf_model.classifier(features)


def read_distilbert(model, hidden, rows, features):
    m = model.hf_model
    return m.classifier(m.dropout(F.relu(m.pre_classifier(features[:, 0]))))


def read_context_pooler(model, hidden, rows, features):
    """DeBERTa-v2: its ContextPooler over the first token."""
    m = model.hf_model
    return m.classifier(m.dropout(m.pooler(features)))


def read_modernbert(model, hidden, rows, features):
    """ModernBERT: mean over the sequence's own tokens or its first, as classifier_pooling says."""
    m = model.hf_model
    if model.config.classifier_pooling == "mean":
        b, k = rows.cls_positions.shape
        pooled = pool_slots(hidden, rows, ("mean",)).reshape(b * k, -1).to(hidden.dtype)
    else:
        pooled = features[:, 0]
    return m.classifier(m.drop(m.head(pooled)))


def read_last_token(model, hidden, rows, features):
    """Decoders: the score of the sequence's last token (its whole context), as transformers'
    XxxForSequenceClassification scores the last non-pad token."""
    b, k = rows.cls_positions.shape
    return model.hf_model.score(pool_slots(hidden, rows, ("lasttoken",)).reshape(b * k, -1).to(hidden.dtype))


def tokens_through_dropout(m, hidden, task: str):
    """BERT-style token heads: dropout -> classifier; QA: qa_outputs."""
    return m.qa_outputs(hidden) if task == "question_answering" else m.classifier(m.dropout(hidden))


def tokens_through_head(m, hidden, task: str):
    """ModernBERT: head -> drop -> classifier, for tokens and QA alike."""
    return m.classifier(m.drop(m.head(hidden)))


def additive_pair_mask(model, arguments: dict, real, allowed) -> torch.Tensor:
    """MPNet adds its mask to the scores; a prepared 4-D mask is taken as is. Additive float,
    never boolean (a boolean 4-D mask is silently wrong under eager)."""
    floor = torch.finfo(model.base.dtype).min
    zero = torch.zeros((), dtype=model.base.dtype, device=allowed.device)
    arguments["attention_mask"] = torch.where(allowed, zero, floor)[:, None]
    return model.base(**arguments).last_hidden_state


def deberta_pair_mask(model, arguments: dict, real, allowed) -> torch.Tensor:
    """DeBERTa-v2 multiplies its embeddings by a [B, S] token mask and its attention by a
    pair mask: the two are given separately (its forward takes one mask for both)."""
    base = model.base
    embeddings = base.embeddings(
        input_ids=arguments["input_ids"], token_type_ids=arguments.get("token_type_ids"),
        position_ids=arguments.get("position_ids"), mask=real.long(),
    )  # fmt: skip
    return base.encoder(
        embeddings, allowed.long(), output_hidden_states=False, return_dict=True
    ).last_hidden_state


@dataclass(frozen=True)
class Family:
    """How a family's model takes packed rows: one row of FAMILIES, every choice a value.

    positions_after_padding: RoBERTa-style positions, numbered from the padding index + 1.
    fixed_padding_index: that index where the family fixes it (MPNet: 1), else the config's
        pad_token_id.
    pair_mask: None: attention through transformers' AttentionInterface (packed_attention);
        else the function that runs an encoder computing relative-position attention of its
        own with the [B, S, S] pair mask (DeBERTa-v2, MPNet).
    read_sequence: how sequence classification reads each packed sequence (its head).
    read_tokens: how token classification and QA read every token.
    causal: a decoder: each token attends to its own sequence's earlier tokens only.
    """

    read_sequence: Callable
    positions_after_padding: bool = False
    fixed_padding_index: int | None = None
    pair_mask: Callable | None = None
    read_tokens: Callable = tokens_through_dropout
    causal: bool = False


ROBERTA_STYLE = Family(read_features, positions_after_padding=True)
# decoders: rotary (or GPT-2's learned) positions from 0 in every sequence, causal attention
# inside it, each family's sliding window and grouped-query heads as its modules have them
DECODER = Family(read_last_token, causal=True)

FAMILIES = {
    "bert": Family(read_through_pooler),
    "roberta": ROBERTA_STYLE,
    "xlm-roberta": ROBERTA_STYLE,
    "camembert": ROBERTA_STYLE,
    "electra": Family(read_features),
    "distilbert": Family(read_distilbert),
    "nomic_bert": Family(read_through_pooler),
    "modernbert": Family(read_modernbert, read_tokens=tokens_through_head),
    "deberta-v2": Family(read_context_pooler, pair_mask=deberta_pair_mask),
    "mpnet": Family(
        read_features, positions_after_padding=True, fixed_padding_index=1, pair_mask=additive_pair_mask
    ),
    "llama": DECODER,
    "mistral": DECODER,
    "qwen2": DECODER,
    "qwen3": DECODER,
    "gemma3_text": DECODER,
    "phi3": DECODER,
    "gpt2": DECODER,
}
TASK_CLASSES = {
    "classification": "AutoModelForSequenceClassification",
    "token_classification": "AutoModelForTokenClassification",
    "question_answering": "AutoModelForQuestionAnswering",
    "embedding": "AutoModel",
    "causal_lm": "AutoModelForCausalLM",
}


# The config keys each family names its dropout probabilities with.
DROPOUT_KEYS = {
    "hidden": ("hidden_dropout_prob", "dropout", "embedding_dropout", "mlp_dropout"),
    "attention": ("attention_probs_dropout_prob", "attention_dropout"),
    "classifier": ("classifier_dropout", "seq_classif_dropout"),
}


class UnsupportedFamily(ValueError):
    """A model_type packing does not run (a decoder, custom code): one line naming it."""


def family_of(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise UnsupportedFamily(
            f"model_type {model_type!r} is not a packed model family (encoder or decoder); supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


def usable_positions(model_type: str, max_position_embeddings: int, pad_token_id: int | None) -> int:
    """Tokens per sequence a position table of `max_position_embeddings` holds. RoBERTa-style
    families number positions from their padding index + 1: the config's pad_token_id, or
    for MPNet a fixed 1 (its embeddings ignore the config)."""
    family = FAMILIES.get(model_type)
    if family is None or not family.positions_after_padding:
        return max_position_embeddings
    return max_position_embeddings - (padding_index(model_type, pad_token_id) + 1)


def padding_index(model_type: str, pad_token_id: int | None) -> int:
    """The padding index RoBERTa-style positions count from (the family's fixed one, else the
    config's pad_token_id)."""
    fixed = FAMILIES[model_type].fixed_padding_index
    return fixed if fixed is not None else int(pad_token_id or 0)


def max_tokens(config) -> int:
    """Tokens per sequence a config's position table holds (usable_positions): for every
    model, BERT's included (its table holds max_position_embeddings)."""
    return usable_positions(config.model_type, config.max_position_embeddings, config.pad_token_id)


def use_packed_attention(hf_model) -> None:
    """Route an already-loaded model's attention through `packed_attention` (calls without
    a packed layout still run transformers' SDPA): for a model a user loaded, such as a
    SentenceTransformer's."""
    if family_of(hf_model.config.model_type).pair_mask is None:
        _register_packed_attention()
        hf_model.set_attn_implementation(PACKED_ATTENTION)


# ----- attention ---------------------------------------------------------------------------------
def mask_stand_in(input_ids: torch.Tensor) -> torch.Tensor:
    """bool [1, 1, 1, 1]: what a packed forward hands transformers as its attention mask.
    transformers returns a 4-D mask as given instead of building its own (a [B, 1, S, S]
    mask per forward from Python-level mask functions: minutes per evaluation at S = 8192);
    packed_attention never reads it (the layout confines attention). A tensor rather than a
    flag, so that a compiled forward traces it (a ContextVar is a graph break) and an
    ordinary call of the same model, in any thread, still gets transformers' mask."""
    return torch.ones((1, 1, 1, 1), dtype=torch.bool, device=input_ids.device)


@dataclass
class PackedLayout:
    """Built once per forward from the rows, read by every layer's attention."""

    sequence_ids: torch.Tensor  # [B, S]
    positions: torch.Tensor  # [B, S]: position inside its own sequence
    _masks: dict
    # Length buckets (model.causal_buckets): None chooses by the row length (mask path up to
    # MASK_MAX_LENGTH tokens); an int forces buckets of that granularity; 0 forces the mask.
    granularity: int | None = None

    def buckets(self):
        """The bucket layout every layer shares (built at the first call), or None where
        attention goes through the mask."""
        if "buckets" not in self._masks:
            from packed_transformers.model.causal_buckets import bucket_plan

            # A compiled forward takes the mask: buckets' shapes follow the data (a new graph
            # for nearly every batch); the mask's are the row's, so one graph serves the run.
            fixed_shapes = self.granularity == 0 or torch.compiler.is_compiling()
            plan = None if fixed_shapes else bucket_plan(self.sequence_ids, self.granularity)
            self._masks["buckets"] = plan
        return self._masks["buckets"]

    def allowed(self, window: int | None = None, causal: bool = False) -> torch.Tensor:
        """bool [B, 1, S, S]: same non-zero sequence (a padding token: itself); with `causal`,
        only keys at or before the query (j <= i inside the sequence); with `window`, at most
        that many positions apart (bidirectional: |i - j| <= window, as transformers draws an
        encoder's window) or, causal, fewer than `window` back (i - j < window, its causal
        sliding window)."""
        key = (window, causal)
        if key not in self._masks:
            allowed = allowed_pairs(self.sequence_ids)  # the project's one definition of the mask
            back = self.positions[:, :, None] - self.positions[:, None, :]  # i - j inside a sequence
            if causal:  # a token's distance to itself is 0: padding keeps its diagonal
                allowed = allowed & (back >= 0)
                if window is not None:
                    allowed = allowed & (back < window)
            elif window is not None:
                allowed = allowed & (back.abs() <= window)
            self._masks[key] = allowed[:, None]
        return self._masks[key]


def packed_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, **kwargs
):
    """transformers' attention-function signature (query/key/value [B, heads, S, d]) ->
    ([B, S, heads, d], None): SDPA confined to each packed sequence. The layout arrives as
    the forward's keyword `packed_layout`, which transformers passes down to attention."""
    layout: PackedLayout | None = kwargs.pop("packed_layout", None)
    if layout is None:  # an ordinary (unpacked) call of the same model: transformers' SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )  # fmt: skip
    causal = bool(getattr(module, "is_causal", False))
    if causal:  # a decoder's causal window: i - j < the layer's sliding_window (None: global)
        window = sliding_window
    else:
        # A local layer's window as the family's own mask draws it: transformers' bidirectional
        # sliding-window mask allows |i - j| <= config.sliding_window (the layer's
        # sliding_window is that + 1, flash-attention's convention).
        window = getattr(module.config, "sliding_window", None) if sliding_window else None
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    plan = layout.buckets()
    if plan is not None:  # the sum of l_i^2: each sequence in its length bucket
        from packed_transformers.model.causal_buckets import bucket_attention

        p = dropout if module.training else 0.0
        return bucket_attention(query, key, value, plan, causal, window, p, scaling), None
    mask = layout.allowed(window, causal)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout if module.training else 0.0, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


def _register_packed_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)

    # an ordinary call of a model routed here (use_packed_attention) gets SDPA's mask; a packed
    # forward hands a 4-D stand-in (mask_stand_in), which transformers passes through unbuilt
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, sdpa_mask)


# ----- causal language modelling -----------------------------------------------------------------
IGNORED = -100  # transformers' "no label"


def next_token_targets(labels: torch.Tensor, sequence_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] token labels -> [B, S] targets: at t, the label of t + 1 where t + 1 is in the
    same sequence, else -100. A sequence's last token never predicts the next one's first."""
    same = (sequence_ids[:, 1:] == sequence_ids[:, :-1]) & (sequence_ids[:, 1:] != 0)
    targets = torch.where(same, labels[:, 1:], torch.full_like(labels[:, 1:], IGNORED))
    return F.pad(targets, (0, 1), value=IGNORED)


def causal_lm_outputs(logits, shift_labels, num_items_in_batch=None) -> dict:
    """{"logits"} and, with targets, {"loss": the mean cross-entropy over the predicted tokens
    (over Trainer's num_items_in_batch where given: gradient accumulation weighs tokens),
    "token_loss_sum", "token_count"}."""
    if shift_labels is None:
        return PackedOutput(logits=logits)
    loss = _token_loss(
        logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1).long(), num_items_in_batch
    )
    # the loss first, as transformers' outputs order it: out[0] is the loss
    return PackedOutput(loss=loss.pop("loss"), logits=logits, **loss)


def predicted_token_outputs(hidden, shift_labels, lm_head, num_items_in_batch=None) -> dict:
    """A training step's causal-LM outputs with the LM head run only where a token has a
    target: hidden [B, S, H], shift_labels [B, S] (-100: none), lm_head [N, H] -> [N, V].
    -> {"loss", "token_loss_sum", "token_count" (as causal_lm_outputs), "predicted_logits"
    [N, V] and "predicted_targets" [N] (the predicted tokens in row-major order)}.

    Why: the head is a [H] x [V] product per token, and in supervised fine-tuning most tokens
    (the prompt's, -100) have no target. On a random Llama of 4 x 512 with a 16k vocabulary
    the head's forward and backward were a third of a step; over prompt-heavy rows it now
    runs on the completions only, and the [B, S, V] logits are never built. The loss is the
    same sum over the same tokens (the order of the additions differs)."""
    flat_targets = shift_labels.reshape(-1)
    predicted = (flat_targets != IGNORED).nonzero().squeeze(1)  # [N]
    targets = flat_targets.index_select(0, predicted).long()
    logits = lm_head(hidden.reshape(-1, hidden.shape[-1]).index_select(0, predicted))  # [N, V]
    loss = _token_loss(logits, targets, num_items_in_batch)
    return PackedOutput(loss=loss.pop("loss"), predicted_logits=logits, predicted_targets=targets, **loss)


def _token_loss(logits, targets, num_items_in_batch) -> dict:
    """logits [N, V], targets [N] (-100 ignored) -> the loss over Trainer's num_items_in_batch
    (else over the predicted tokens), its sum and the count of predicted tokens."""
    loss_sum = F.cross_entropy(logits.float(), targets, ignore_index=IGNORED, reduction="sum")
    count = (targets != IGNORED).sum()
    divisor = num_items_in_batch if num_items_in_batch is not None else count.clamp(min=1)
    if torch.is_tensor(divisor):
        divisor = divisor.to(loss_sum.device)
    return {"loss": loss_sum / divisor, "token_loss_sum": loss_sum.detach(), "token_count": count}


def tokenizer_hands_token_types(folder, default: bool = False, config=None) -> bool:
    """Whether transformers' tokenizer of `folder` returns token_type_ids (its
    model_input_names); `default` where the folder has none transformers can build.
    config: the model's config, already read (None: transformers reads config.json)."""
    from transformers import AutoTokenizer

    given = {} if config is None else {"config": config}
    try:
        return "token_type_ids" in AutoTokenizer.from_pretrained(folder, **given).model_input_names
    except Exception:  # noqa: BLE001 - no tokenizer files, or one transformers cannot build
        return default
