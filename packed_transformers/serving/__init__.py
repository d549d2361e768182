"""Online packed inference: an HTTP server that packs requests as they arrive.

    python -m packed_transformers.serving --model runs/bbc/model [--policy packed] [--port 8080]

cli.py (the command) -> api.py (requests read strictly) -> engines.py (tokenize; one
forward; answers: classification, rerank, QA, embeddings) -> scheduler.py (bounded queue,
deadlines, one worker thread) with policies.py (which sequences run next, in which rows)
-> app.py (FastAPI routes, lifecycle) -> metrics.py; headers.py bounds request heads below
the app. Builds on door/ (one opener) and inference/ (the runner, rows, answers); never
imports finetune/, training/, ray_jobs/, hf_integration/ or commands/.
"""
