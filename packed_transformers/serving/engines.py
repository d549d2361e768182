"""What the server runs: a fine-tuned folder (`finetune.train`'s output) or an embedding
folder (sentence-transformers') as three steps.

    engine = load_engine(folder)                         # classification, QA, tokens or embedding
    prepared = engine.prepare(request)                   # tokenizer thread: serving.api.Request -> sequences
    outputs = engine.run(token_ids, segment_ids, table, width)   # worker thread: one forward
    body = engine.answer(prepared, outputs)              # the route's JSON answer, in input order

Every engine has these three signatures; routes know none of an engine's arguments (the
Request carries the route and its flags).

Tokenization and scoring are `commands.predict`'s (the folder's vocabulary and
data.classification_data.tokenize; QA windows by data.qa_windows with the folder's
window length and stride, answers by inference.qa_answers), so the server answers what
`python -m packed_transformers.finetune.predict` writes for the same texts. The engine runs whatever table the
policy gives: packed rows (K > 1) and one-sequence rows alike, through the same model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from packed_transformers.data.classification_data import ExampleError, Examples
from packed_transformers.door.loaded import LoadedModel
from packed_transformers.door.opener import AsTheFolderSays, open_folder
from packed_transformers.inference.embedding import l2_normalize
from packed_transformers.inference.predictions import class_scores
from packed_transformers.inference.runner import Runner, per_sequence, per_sequence_tokens, runner_of
from packed_transformers.serving.api import Request, RequestError


@dataclass
class Prepared:
    """A request's sequences (int64 arrays) and whatever answering needs afterwards."""

    token_ids: list
    segment_ids: list
    context: object = None
    request: Request | None = None


def load_engine(
    folder: Path,
    device: str = "cpu",
    attention_backend: str | None = None,
    dtype: str = "float32",
    pooling=None,
    runtime: str = "torch",
):
    """The engine for a model folder: the folder opened once (door.opener.open_folder: a
    model with a head, or an embedding model), its Runner, and ENGINES[spec.task]. Raises
    ExampleError for a bad folder; attention_backend overrides BERT's (every backend computes
    the same outputs); dtype: inference.precision's (bfloat16 under autocast); runtime "openvino":
    classification and embedding folders through OpenVINO (ValueError, one line, for others);
    "auto": inference.runtime_choice's for serving (torch, measured faster under load)."""
    loaded = open_folder(folder, AsTheFolderSays(pooling, attention_backend, device))
    from packed_transformers.common.choices import GRAPH_TASKS
    from packed_transformers.inference.runtime_choice import resolved_runtime

    chosen = resolved_runtime(runtime, loaded.spec.task, device, dtype, serving=True)
    runtime = chosen.runtime
    if runtime != "torch" and loaded.spec.task not in GRAPH_TASKS:
        raise ValueError(f"--runtime {runtime} serves {' and '.join(GRAPH_TASKS)} folders; {folder} is a "
                         f"{loaded.spec.task} folder: leave --runtime out")  # fmt: skip
    engine = ENGINES[loaded.spec.task](runner_of(loaded, device, dtype, runtime=runtime), loaded)
    engine.runtime_chosen = chosen.why
    return engine


# fp32 FLOP/s assumed of a cold server's forward: a fraction of the 60-130 GFLOP/s the 2-core
# machines here measure on the model's matmuls (bench/bench_flops.py).
COLD_FLOPS_PER_SECOND = 20e9


class _Engine:
    """What every engine shares: its inference.runner.Runner (model, device, dtype)."""

    task: str

    def __init__(self, runner: Runner, loaded: LoadedModel, name: str = ""):
        # max_sequence_length: the length the folder's texts were made for (the padded policy's
        # width); max_length: the most a text may have, as the door computed it (LoadedModel)
        self.runner, self.model = runner, runner.model
        self.max_sequence_length, self.name = loaded.spec.max_sequence_length, name
        self.max_length = loaded.max_length
        self.runtime_chosen = ""  # load_engine: what --runtime auto chose and why

    def cold_tokens_per_second(self) -> float:
        """A conservative first estimate of the forward's speed, for admission before any
        batch has run (serving/admission.py): 2 FLOPs per parameter per token at
        COLD_FLOPS_PER_SECOND, a rate most CPUs beat several times over, so that a cold server
        refuses only what could not run in time even then."""
        count = getattr(self.model, "parameter_count", None)  # an exported graph's, from its export
        parameters = count if count is not None else sum(p.numel() for p in self.model.parameters())
        return COLD_FLOPS_PER_SECOND / max(2 * parameters, 1)

    def warm_up(self) -> None:
        """Before the server admits a request: where the runtime compiles its graph at the first
        batch (OpenVINO: one bounded graph for every row shape, inference.openvino_session), one
        forward of a two-token sequence (its outputs dropped), so that no request waits for the
        compile (it had put 227 ms on the p99 at half load: docs/embeddings.md). torch and ONNX
        Runtime compile nothing at a first batch: nothing is run."""
        if self.runner.runtime == "openvino":
            ids = [np.zeros(2, dtype=np.int64)]
            self.run(ids, [np.zeros(2, dtype=np.int64)], np.array([[0]]), 2)

    def _forward(self, token_ids: list, segment_ids: list, table: np.ndarray, width: int, outputs) -> list:
        """One forward of the policy's table -> [RunBatch] (inference.runner's read-back helpers)."""
        return [self.runner.forward(token_ids, table, width, segment_ids, outputs)]


class ClassificationEngine(_Engine):
    """Single- and multi-label classification: TEI's /predict."""

    task = "classification"

    def __init__(self, runner: Runner, folder):
        super().__init__(runner, folder)
        self.folder = folder
        self.labels = list(folder.spec.labels)
        self.multi_label = folder.spec.multi_label

    def prepare(self, request: Request) -> Prepared:
        """/predict's [(text, pair or None)] or /rerank's (query, text) pairs -> token ids
        as commands.predict makes them. Too long without truncate: 413, as TEI answers."""
        if request.route == "rerank" and len(self.labels) != 1:
            raise RequestError(
                422,
                f"/rerank needs a one-label (cross-encoder) model; this one has {len(self.labels)} labels",
            )
        prepared = self._tokenize(request.inputs, request.truncate)
        prepared.request = request
        return prepared

    def _tokenize(self, sequences: list[tuple[str, str | None]], truncate: bool) -> Prepared:
        where = [f"inputs[{i}]" for i in range(len(sequences))]
        examples = Examples(
            [s[0] for s in sequences], [s[1] for s in sequences], [None] * len(sequences), where
        )
        labels = np.zeros(len(sequences), dtype=np.int64)
        try:
            data = self.folder.tokenize(
                examples, labels, self.max_length, "truncate" if truncate else "error"
            )
        except ExampleError as err:
            message = (
                str(err)
                .replace("data.max_sequence_length", "the model's maximum")
                .replace("(set data.too_long: truncate to cut it)", '(send "truncate": true to cut it)')
            )
            raise RequestError(413, message) from None
        as_int64 = [t.astype(np.int64) for t in data.token_ids]
        return Prepared(as_int64, [s.astype(np.int64) for s in data.segment_ids])

    def run(self, token_ids: list, segment_ids: list, table: np.ndarray, width: int) -> list:
        """Logits float32 [C] per sequence, in the order of token_ids."""
        batches = self._forward(token_ids, segment_ids, table, width, ("logits",))
        return list(per_sequence(batches, "logits", len(token_ids)))

    def scores(self, logits: np.ndarray, raw_scores: bool) -> np.ndarray:
        """[n, C]: logits (raw_scores), else commands.predict's own scores."""
        return logits if raw_scores else class_scores(logits, self.multi_label)

    def answer(self, prepared: Prepared, outputs: list):
        """/predict: per input, every label with its score, best first (one input given
        alone: its list); /rerank: the ranked (index, score[, text]) list."""
        request = prepared.request
        raw_scores = request.options.get("raw_scores", False)
        if request.route == "rerank":
            ranked = self.rerank(outputs, raw_scores)
            if request.options.get("return_text"):
                for item in ranked:
                    item["text"] = request.inputs[item["index"]][1]
            return ranked
        answers = self.label_scores(outputs, raw_scores)
        return answers[0] if request.single else answers

    def rerank(self, outputs: list, raw_scores: bool) -> list[dict]:
        """A one-label model's (query, text) scores, best first: TEI's /rerank answer. The
        score is the sigmoid of the logit (raw_scores: the logit), as TEI's."""
        logits = np.stack(outputs)[:, 0]
        scores = logits if raw_scores else 1 / (1 + np.exp(-logits.astype(np.float64)))
        order = np.argsort(-scores, kind="stable")
        return [{"index": int(i), "score": float(scores[i])} for i in order]

    def label_scores(self, outputs: list, raw_scores: bool) -> list[list[dict]]:
        """Per input: every label with its score, best first (TEI's order)."""
        scores = self.scores(np.stack(outputs), raw_scores)
        return [
            [{"score": float(row[c]), "label": self.labels[c]} for c in np.argsort(-row, kind="stable")]
            for row in scores
        ]


class QaEngine(_Engine):
    """Extractive question answering: windows of the folder's length and stride."""

    task = "question_answering"

    def __init__(self, runner: Runner, folder):
        from packed_transformers.inference.question_answering import answer_settings

        spec = folder.spec
        super().__init__(runner, folder)
        self.tokenizer = folder.hf_tokenizer()
        self.window = spec.max_sequence_length
        self.doc_stride = int(spec.qa["doc_stride"])
        self.settings = answer_settings(spec.qa)

    def prepare(self, request: Request) -> Prepared:
        """[{"question", "context"}] -> every window of every question."""
        from packed_transformers.data.qa_data import QaExamples
        from packed_transformers.data.qa_windows import make_windows

        questions = request.inputs
        n = len(questions)
        examples = QaExamples(
            [str(i) for i in range(n)],
            [q["question"] for q in questions],
            [q["context"] for q in questions],
            [None] * n,
            [f"inputs[{i}]" for i in range(n)],
        )
        try:
            windows = make_windows(examples, self.tokenizer, self.window, self.doc_stride)
        except ExampleError as err:
            raise RequestError(413, str(err)) from None
        return Prepared(
            [t.astype(np.int64) for t in windows.token_ids],
            [s.astype(np.int64) for s in windows.segment_ids],
            (examples, windows),
            request,
        )

    def run(self, token_ids: list, segment_ids: list, table: np.ndarray, width: int) -> list:
        """(start, end) logits float32 [length] per window, in the order of token_ids."""
        batches = self._forward(token_ids, segment_ids, table, width, ("start_logits", "end_logits"))
        lengths = [len(t) for t in token_ids]
        starts, ends = (
            per_sequence_tokens(batches, name, lengths) for name in ("start_logits", "end_logits")
        )
        return list(zip(starts, ends))

    def answer(self, prepared: Prepared, outputs: list) -> list[dict]:
        """Per question: the transformers pipeline's {"score", "start", "end", "answer"}."""
        from packed_transformers.inference.qa_answers import best_answers
        from packed_transformers.inference.question_answering import offsets_table

        examples, windows = prepared.context
        width = max(len(s) for s, _ in outputs)
        start = np.full((len(outputs), width), -np.inf, dtype=np.float32)
        end = start.copy()
        for w, (s, e) in enumerate(outputs):
            start[w, : len(s)], end[w, : len(e)] = s, e
        answers = best_answers(
            start,
            end,
            offsets_table(windows, width),
            windows.example_of_window,
            examples.contexts,
            self.settings,
        )
        out = [
            {"score": float(p), "start": int(s), "end": int(e), "answer": text}
            for text, (s, e), p in zip(answers.text, answers.spans, answers.probability)
        ]
        return out[0] if prepared.request.single else out


class TokenEngine(_Engine):
    """Token classification (NER): per input, transformers' token-classification pipeline's
    entities (aggregation "none"; inference.token_task), POST /tokens."""

    task = "token_classification"

    def __init__(self, runner: Runner, folder):
        super().__init__(runner, folder)
        self.folder = folder
        self.labels = list(folder.spec.labels)

    def prepare(self, request: Request) -> Prepared:
        from packed_transformers.inference.token_task import tokenize_for_tags

        texts = request.inputs
        try:
            tagged = tokenize_for_tags(
                texts, [f"inputs[{i}]" for i in range(len(texts))], self.folder.tokenizer, self.max_length,
                request.truncate,
            )  # fmt: skip
        except ExampleError as err:
            status = 413 if "at most" in str(err) else 422
            hint = ' (send "truncate": true to cut it)' if status == 413 else ""
            raise RequestError(status, f"{err}{hint}") from None
        return Prepared(tagged.token_ids, tagged.segment_ids, tagged, request)

    def run(self, token_ids: list, segment_ids: list, table: np.ndarray, width: int) -> list:
        """Per-token logits float32 [length, C] per sequence, in the order of token_ids."""
        batches = self._forward(token_ids, segment_ids, table, width, ("logits",))
        return per_sequence_tokens(batches, "logits", [len(t) for t in token_ids])

    def answer(self, prepared: Prepared, outputs: list) -> list[list[dict]]:
        from packed_transformers.inference.token_task import entities

        out = [entities(logits, prepared.context, i, self.labels) for i, logits in enumerate(outputs)]
        return out[0] if prepared.request.single else out


class EmbeddingEngine(_Engine):
    """Sentence embeddings: TEI's /embed and OpenAI's /v1/embeddings. The model pools; the
    request decides normalization (TEI's `normalize`, default true)."""

    task = "embedding"

    def __init__(self, runner: Runner, encoder: LoadedModel):
        super().__init__(runner, encoder, encoder.name)
        self.encoder = encoder
        self.dimension = encoder.dimension

    def prepare(self, request: Request) -> Prepared:
        """Texts -> token ids as commands.embed makes them. Too long without truncate: 413,
        naming the field (TEI's `inputs`, OpenAI's `input`)."""
        texts, field = request.inputs, "input" if request.route == "openai" else "inputs"
        try:
            prompt = self.encoder.prompt(request.options.get("prompt_name"))
        except ExampleError as err:
            raise RequestError(422, f'field "prompt_name": {err}') from None
        texts = [prompt + text for text in texts] if prompt else texts
        try:
            token_ids, _ = self.encoder.tokenize_texts(
                texts, [f"{field}[{i}]" for i in range(len(texts))], request.truncate,
                request.options.get("direction", "right"),
            )  # fmt: skip
        except ExampleError as err:
            hint = ' (send "truncate": true to cut it)' if field == "inputs" else ""  # OpenAI's API has none
            raise RequestError(413, f"{err}{hint}") from None
        return Prepared(token_ids, [np.zeros_like(t) for t in token_ids], None, request)

    def run(self, token_ids: list, segment_ids: list, table: np.ndarray, width: int) -> list:
        """Pooled embeddings float32 [D] per sequence, in the order of token_ids."""
        batches = self._forward(token_ids, segment_ids, table, width, ("embeddings",))
        return list(per_sequence(batches, "embeddings", len(token_ids)))

    def vectors(self, outputs: list, normalize: bool, dimensions: int | None = None) -> np.ndarray:
        """[n, D] (or the first `dimensions` of each, re-normalized: OpenAI's shortening)."""
        vectors = np.stack(outputs).astype(np.float32)
        if dimensions is not None:
            vectors = l2_normalize(vectors[:, :dimensions])
        return l2_normalize(vectors) if normalize else vectors

    def answer(self, prepared: Prepared, outputs: list):
        """/embed: the vectors as lists (normalized unless asked not to); /v1/embeddings:
        OpenAI's body (float lists or base64 of little-endian float32, usage in tokens)."""
        import base64

        request = prepared.request
        if request.route == "embed":
            return self.vectors(outputs, request.options["normalize"]).tolist()
        vectors = self.vectors(outputs, True, request.options["dimensions"])
        tokens = int(sum(len(t) for t in prepared.token_ids))
        base64_encoded = request.options["encoding"] == "base64"
        data = [
            {"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if base64_encoded else v.tolist()}
            for i, v in enumerate(vectors)
        ]  # fmt: skip
        return {"object": "list", "data": data, "model": self.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip


# FolderSpec.task -> the engine that answers its routes
ENGINES: dict[str, type[_Engine]] = {
    "classification": ClassificationEngine,
    "question_answering": QaEngine,
    "token_classification": TokenEngine,
    "embedding": EmbeddingEngine,
}
