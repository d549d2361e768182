"""Running a loaded model: a `LoadedModel` (door/) and options in, arrays in input order out.

    runner            the one packed forward outside a training step (Runner, runner_of; backend_of:
                      the one place a torch model's runtime is chosen)
    backend           Backend: numpy packed rows in, numpy outputs out, one per runtime (torch_backend,
                      onnx_graphs, openvino_graphs; an exported folder's session: exported_backend)
    batching, rows    batch tables (padded | dynamic | uniform | packed); tables -> rows -> input order
    precision         float32 / bfloat16, refused where the device has no bf16
    int8              torch's x86 int8 kernels in the transformer layers (dtype="int8")
    openvino_graphs   the packed rows through OpenVINO, one graph for every row shape (runtime="openvino")
    onnx_graphs       the packed rows through ONNX Runtime, one graph, rows and width open (runtime="onnxruntime")
    runtime_choice    runtime="auto": torch or OpenVINO per CPU kind, from a measured table
    classify          classification of new text (InferenceOptions: the one options type)
    predictions       logits -> scores and records (never NaN in a JSON line)
    embedding         texts -> vectors, chunk by chunk (encode, iter_encode, packed_encode)
    question_answering, qa_answers   windows -> spans -> answers and SQuAD's files
    token_task        token classification's entities

Never parses a command line. Never imports finetune/, ray_jobs/, hf_integration/,
serving/, commands/ or training/ (tests/house/test_house.py).
"""
